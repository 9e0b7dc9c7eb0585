"""What attending within documents costs: the same runs with data.document_mask off and on.

Packed rows attend causally over the whole row (`is_causal`, SDPA's fastest path); with
document masks every micro-batch builds a block-diagonal causal mask (B, 1, T, T) and its
per-document positions, and SDPA takes the mask (`kiln.model.document_attention`). Each pair of
runs trains the same model on the same rows from the same seed, with the local launcher (one
process, no Ray), fp32: plain text (the stdlib's json, email, http and logging packages, whole
files as documents, as in pretraining) and instruction data (each stdlib function's signature
as the prompt and its next lines as the response: many short examples to a row). Recorded:
steady-state tokens/s, their ratio, and the validation loss after the last step (each run
validates as it trained). Appends a table to bench/results/throughput.md.

    python -m bench.document_mask          # ~3 min on 2 cores
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

from bench.common import BIN, LOCAL, machine, publish, results_file, train_summary

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXT = [str(STDLIB / d) for d in ("json", "email", "http", "logging")]


def examples(path: Path) -> None:
    """Instruction records of real text, one JSON line each."""
    with path.open("w") as out:
        for src in sorted(p for d in TEXT for p in Path(d).rglob("*.py")):
            lines = src.read_text().splitlines()
            for i, line in enumerate(lines):
                if line.lstrip().startswith("def ") and i + 4 < len(lines):
                    record = {"prompt": line.strip(), "response": "\n".join(lines[i + 1 : i + 5])}
                    out.write(json.dumps(record) + "\n")


def prepare(inputs: list[str], out: str, seq_len: int, *more: str) -> None:
    cmd = [str(BIN / "kiln"), "data", "prepare", *[a for i in inputs for a in ("--input", i)], "--output", out]
    cmd += ["--tokenizer", "byte", "--seq-len", str(seq_len), *more]
    subprocess.run(cmd, check=True, capture_output=True)


def run(overrides: list[str], tmp: str, name: str) -> dict:
    """One local run's summary metrics."""
    return train_summary(overrides, tmp, name, launcher=LOCAL)["metrics"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--flavour", default="llama-debug")
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-docmask-bench-") as tmp:
        examples(Path(tmp) / "sft.jsonl")
        prepare(TEXT, f"{tmp}/plain", args.seq_len)
        prepare(
            [f"{tmp}/sft.jsonl"], f"{tmp}/sft", args.seq_len, "--prompt-field", "prompt", "--response-field", "response"
        )
        common = [
            f"model.flavour={args.flavour}",
            "train.micro_batch_size=4",
            "parallel.num_workers=1",
            "parallel.cpus_per_worker=2",
            "train.precision=fp32",
            f"train.max_steps={args.steps}",
            f"train.eval_every={args.steps}",
            "train.eval_batches=8",
            "logging.progress_every=1000",
            "logging.log_model=false",
            f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"train.storage_path={tmp}/runs",
        ]
        for data in ("plain", "sft"):
            for mask in ("false", "true"):
                name = f"{data}-{mask}"
                m = run(
                    [*common, f"data.path={tmp}/{data}", f"data.document_mask={mask}", f"logging.run_name={name}"],
                    tmp,
                    name,
                )
                rows.append((data, mask, m["throughput/tokens_per_s"], m["loss/val"]))
    _publish(rows, args)


def _publish(rows: list[tuple], args: argparse.Namespace) -> None:
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — document masks off and on, local launcher, cpu, fp32",
        "",
        f"Command: `python -m bench.document_mask {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        f"{args.flavour}, rows of {args.seq_len} byte tokens, micro-batch 4, {args.steps} steps; plain text is the "
        "stdlib's json, email, http and logging packages (a file a document), instruction data their "
        "functions (signature -> the next four lines). The validation loss is each run's own, after the "
        "last step, scored as it trained.",
        "",
        "| data | document_mask | tokens/s | ratio to off | val loss |",
        "|---|---|---:|---:|---:|",
    ]
    off = {data: tps for data, mask, tps, _ in rows if mask == "false"}
    for data, mask, tps, val in rows:
        name = "plain text" if data == "plain" else "instruction"
        lines.append(f"| {name} | {mask} | {tps:,.0f} | {tps / off[data]:.2f} | {val:.3f} |")
    lines.append("")
    publish("\n".join(lines), args.results)


if __name__ == "__main__":
    main()
