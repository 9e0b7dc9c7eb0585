"""LoRA against full fine-tuning: the same checkpoint, the same tokens, the same steps.

A Llama of llama-1b's width (2 layers, ~130M parameters with the demo's 2048-token vocab) is
pretrained briefly on the demo's data (the stdlib's top-level modules) and exported; then it is
fine-tuned on other text (the stdlib's json, email, http and logging packages, tokenized with the
base's tokenizer) twice, with every weight and with LoRA adapters (rank 16 on every projection),
each with the local launcher (one process, no Ray), ZeRO-2, fp32. Recorded per run: tokens/s at
steady state, the process's peak RSS, the engine's weight, master and optimizer-state bytes,
the final checkpoint's size, and the validation loss at the end. Appends a table to
bench/results/throughput.md.

    python -m bench.lora                # ~15 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench.common import REPO, machine, publish, results_file

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FINETUNE_TEXT = [str(STDLIB / d) for d in ("json", "email", "http", "logging")]
MODEL = ["model.flavour=llama-1b", "model.n_layer=2"]


def run(overrides: list[str], tmp: str, name: str) -> tuple[dict, float]:
    """One local run in a process of its own: (its summary, that process tree's peak RSS in GiB)."""
    out = f"{tmp}/{name}.json"
    cmd = [sys.executable, "-m", "kiln.launch.local", "--config", str(REPO / "jobs/configs/debug.yaml")]
    cmd += [a for o in overrides for a in ("--set", o)] + ["--summary-json", out]
    print("+", " ".join(cmd), flush=True)
    # A wrapper per run: RUSAGE_CHILDREN's peak is the largest child's so far, so each run gets
    # a fresh parent to measure it.
    wrapper = (
        "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], cwd=tmp, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed:\n{proc.stderr[-4000:]}")
    peak_kib = int(proc.stdout.strip().splitlines()[-1])
    return json.loads(Path(out).read_text()), peak_kib / 2**20


def size_mib(path: str) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO / "data/stdlib-bpe"), help="the pretraining data (make demo's)")
    p.add_argument("--pretrain-steps", type=int, default=30)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-lora-bench-") as tmp:
        common = [
            "train.micro_batch_size=4",
            "parallel.zero_stage=2",
            "parallel.cpus_per_worker=2",
            "train.precision=fp32",
            "logging.progress_every=1000",
            "logging.log_model=false",
            f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"train.storage_path={tmp}/runs",
        ]
        base, _ = run(
            [
                *common,
                *MODEL,
                f"data.path={args.data}",
                f"train.max_steps={args.pretrain_steps}",
                "optim.lr=1e-3",
                "train.eval_every=0",
                "logging.run_name=base",
            ],
            tmp,
            "base",
        )
        subprocess.run(
            [str(Path(sys.executable).with_name("kiln")), "export", base["checkpoint"], "--output", f"{tmp}/base"],
            check=True,
        )
        subprocess.run(
            [
                str(Path(sys.executable).with_name("kiln")),
                "data",
                "prepare",
                *[arg for d in FINETUNE_TEXT for arg in ("--input", d)],
                "--output",
                f"{tmp}/ft-data",
                "--tokenizer",
                f"{tmp}/base",
                "--seq-len",
                "128",
                "--shard-tokens",
                "131072",
            ],
            check=True,
        )
        finetune = [
            *common,
            f"model.init_from={tmp}/base",
            f"data.path={tmp}/ft-data",
            f"train.max_steps={args.steps}",
            f"train.eval_every={args.steps}",
            "train.eval_batches=8",
            "schedule.warmup_steps=5",
        ]
        runs = {
            "full fine-tune": ["optim.lr=1e-4", "logging.run_name=full"],
            f"LoRA rank {args.rank}, every projection": [
                f"model.lora.rank={args.rank}",
                f"model.lora.alpha={2 * args.rank}",
                "optim.lr=1e-3",
                "logging.run_name=lora",
            ],
        }
        for label, more in runs.items():
            summary, peak = run([*finetune, *more], tmp, label.split()[0].lower())
            m = summary["metrics"]
            held = sum(m[f"memory/{k}_bytes"] for k in ("params", "master_params", "optimizer_state")) / 2**20
            rows.append(
                (label, m["throughput/tokens_per_s"], peak, held, size_mib(summary["checkpoint"]), m["loss/val"])
            )
    _publish(rows, args)


def _publish(rows: list[tuple], args: argparse.Namespace) -> None:
    full = rows[0]
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — LoRA against full fine-tuning, local launcher, cpu, fp32, ZeRO-2",
        "",
        f"Command: `python -m bench.lora {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        f"A Llama of llama-1b's width, 2 layers, pretrained {args.pretrain_steps} steps on the stdlib's top-level "
        f"modules, then fine-tuned {args.steps} steps of 4 x 128 tokens on its json, email, http and logging "
        "packages; the validation loss is that data's, after the last step.",
        "",
        "| run | tokens/s | ratio | peak RSS (GiB) | weights + master + optimizer state (MiB) "
        "| checkpoint (MiB) | ratio | val loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, tps, peak, held, ckpt, val in rows:
        lines.append(
            f"| {label} | {tps:,.0f} | {tps / full[1]:.2f} | {peak:.2f} | {held:,.0f} | {ckpt:,.1f} "
            f"| {ckpt / full[4]:.3f} | {val:.3f} |"
        )
    lines.append("")
    publish("\n".join(lines), args.results)


if __name__ == "__main__":
    main()
