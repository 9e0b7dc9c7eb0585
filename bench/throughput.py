"""`make bench`: Kiln against a plain PyTorch loop on the same model, data and cores, in one run.

Reports steady-state tokens/s of each and their ratio, the time from command start to the first
optimizer step, and the share of step time Kiln's workers spent waiting for data; prints a
table and appends it to bench/RESULTS.md with the command and the machine.

    python bench/throughput.py                     # CPU: the demo config (2 workers, ZeRO-2)
    python bench/throughput.py --launcher local --device cuda --config jobs/configs/gpt2-124m.yaml \
        --data data/stdlib-bpe-1024 --batch 16      # one GPU without Ray
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kiln.clock import startup_breakdown

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    desc = f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, torch {torch.__version__}"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name()}"
    return desc


def run_kiln(args, overrides: list[str], out_json: str) -> dict:
    sets = [a for o in overrides for a in ("--set", o)]
    if args.launcher == "ray":
        cmd = [str(BIN / "kiln"), "train", "--config", args.config, *sets, "--summary-json", out_json]
    else:
        cmd = [sys.executable, "-m", "kiln.launch.local", "--config", args.config, *sets, "--summary-json", out_json]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"kiln run failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(out_json).read_text())


def run_plain(args, batch: int) -> dict:
    cmd = [sys.executable, str(REPO / "bench" / "plain_loop.py"), "--data", args.data, "--flavour", args.flavour,
           "--batch", str(batch), "--steps", str(args.steps), "--device", args.device, "--precision", args.precision,
           *(["--compile"] if args.compile else [])]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"plain loop failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="jobs/configs/debug.yaml")
    p.add_argument("--data", default="data/stdlib-bpe")
    p.add_argument("--flavour", default="debug")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=16,
                   help="micro-batch per worker of the first (largest) Kiln config; every run, the plain loop "
                        "included, uses the same global batch")
    p.add_argument("--workers", default="2,1", help="Kiln worker counts to compare, e.g. 2,1")
    p.add_argument("--launcher", choices=["ray", "local"], default="ray")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--zero-stages", default="2", help="with --launcher local: ZeRO stages to run")
    p.add_argument("--compile", action="store_true", help="train.compile for Kiln, model.compile() for the plain loop")
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra Kiln override, repeatable")
    p.add_argument("--results", default=str(REPO / "bench" / "RESULTS.md"))
    args = p.parse_args()

    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"data.path={args.data}", f"model.flavour={args.flavour}", f"train.max_steps={args.steps}",
                  "train.eval_every=0", "train.eval_batches=4", f"train.micro_batch_size={args.batch}",
                  f"train.precision={args.precision}", "logging.experiment=bench",
                  f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db", f"train.storage_path={tmp}/runs",
                  f"train.compile={args.compile}", *args.sets]
        kiln_runs = []
        workers = [int(w) for w in args.workers.split(",")] if args.launcher == "ray" else [1]
        global_batch = args.batch * workers[0]
        if args.launcher == "ray":
            for n in workers:
                cpus = max(1, cores // n)
                label = (f"Kiln: Ray Train, {n} worker(s) x {cpus} CPU, micro-batch {global_batch // n}, "
                         f"ZeRO-{2 if n > 1 else 0}")
                over = [f"parallel.num_workers={n}", f"parallel.cpus_per_worker={cpus}",
                        f"parallel.zero_stage={2 if n > 1 else 0}", f"train.micro_batch_size={global_batch // n}"]
                kiln_runs.append((label, n, run_kiln(args, common + over, f"{tmp}/k{n}.json")))
        else:
            for z in (int(s) for s in args.zero_stages.split(",")):
                label = f"Kiln: local launcher (no Ray), 1 {args.device} worker, ZeRO-{z}, {args.precision}"
                over = ["parallel.num_workers=1", f"parallel.zero_stage={z}", f"parallel.use_gpu={args.device == 'cuda'}",
                        f"parallel.cpus_per_worker={cores if args.device == 'cpu' else 1}"]
                kiln_runs.append((label, 1, run_kiln(args, common + over, f"{tmp}/z{z}.json")))
        plain = run_plain(args, global_batch)

    rows.append(("Plain PyTorch loop, 1 process", plain["tokens_per_s"], 1.0, plain["seconds_to_first_step"],
                 plain["first_step_s"], None, plain.get("mfu"), plain.get("max_reserved_gib")))
    for label, _, s in kiln_runs:
        m = s["metrics"]
        rows.append((label, m["throughput/tokens_per_s"], None, s["seconds_to_first_step"], m.get("time/first_step_s"),
                     m["time/data_wait_share"], m.get("mfu"), m.get("memory/max_reserved_gib")))
    # Every run has the same global batch, so ratios compare like with like.
    base = plain["tokens_per_s"]
    rows = [(r[0], r[1], r[1] / base, *r[3:]) for r in rows]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — {args.launcher} launcher, {args.device}, {args.flavour}, "
        f"{args.precision}{', compiled' if args.compile else ''}, micro-batch {args.batch}, {args.steps} steps",
        "",
        f"Command: `python bench/throughput.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        "| run | tokens/s (steady) | ratio vs plain | s to first step | first step s (compile) | data wait share "
        "| MFU | max reserved GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, tok, ratio, first, first_s, wait, mfu, mem in rows:
        lines.append(f"| {label} | {tok:,.0f} | {ratio:.3f} | {first:.1f} | {fmt(first_s, '.1f')} "
                     f"| {fmt(wait and 100 * wait, '.1f')}{'%' if wait is not None else ''} "
                     f"| {fmt(mfu and 100 * mfu, '.1f')}{'%' if mfu is not None else ''} | {fmt(mem, '.2f')} |")
    lines.append("")
    for label, _, summary in kiln_runs:  # where each Kiln run's time to its first step went
        steps = startup_breakdown(summary["metrics"])
        if steps:
            lines.append(f"Start-up, {label}: " + ", ".join(f"{what} {sec:.1f} s" for what, sec in steps) + ".  ")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    results = Path(args.results)
    if not results.exists():
        results.write_text("# Benchmark results\n\nAppended by `make bench` (bench/throughput.py). "
                           "Each section is one run on one machine; compare ratios within a section.\n\n")
    with results.open("a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
