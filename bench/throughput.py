"""`make bench`: Kiln against a plain PyTorch loop on the same model, data and cores, in one run.

Reports steady-state tokens/s of each and their ratio, the time from command start to the first
optimizer step, and the share of step time Kiln's workers spent waiting for data: medians over
`--repeats` rounds, each between two plain-loop runs whose mean it is compared with (this VM's
speed drifts by 10-20% between minutes); `bench/step_ab.py` resolves the step's own overhead
below that noise, in one process. Prints a table and appends it to bench/results/throughput.md with the
command and the machine.

    python -m bench.throughput                     # CPU: the demo config (2 workers, ZeRO-2)
    python -m bench.throughput --launcher local --device cuda --config jobs/configs/gpt2-124m.yaml \
        --data data/stdlib-bpe-1024 --batch 16      # one GPU without Ray
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import BIN, REPO, machine, publish, results_file
from kiln.clock import startup_breakdown
from kiln.topology import ParallelConfig, sharding

PLAIN = "Plain PyTorch loop, 1 process"


def run_kiln(args, overrides: list[str], out_json: str) -> dict | None:
    sets = [a for o in overrides for a in ("--set", o)]
    if args.launcher == "ray":
        cmd = [str(BIN / "kiln"), "train", "--config", args.config, *sets, "--summary-json", out_json]
    else:
        cmd = [sys.executable, "-m", "kiln.launch.local", "--config", args.config, *sets, "--summary-json", out_json]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        if args.keep_going:  # its row says so; the other rows still measure
            print(f"kiln run failed:\n{proc.stderr[-4000:]}", flush=True)
            return None
        sys.exit(f"kiln run failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(out_json).read_text())


def run_plain(args, batch: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.plain_loop",
        "--data",
        args.data,
        "--flavour",
        args.flavour,
        "--batch",
        str(batch),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        "--precision",
        args.precision,
        "--host-malloc",
        args.plain_host_malloc,
        *(["--compile"] if args.compile else []),
    ]
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
    p.add_argument(
        "--batch",
        type=int,
        default=16,
        help="micro-batch per worker of the first (largest) Kiln config; every run, the plain loop "
        "included, uses the same global batch",
    )
    p.add_argument("--workers", default="2,1", help="Kiln worker counts to compare, e.g. 2,1")
    p.add_argument("--launcher", choices=["ray", "local"], default="ray")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument(
        "--zero-stages",
        default="2",
        help="with --launcher local: ZeRO stages to run, DeepSpeed's (0-3) or FSDP2's (fsdp2-2, fsdp2-3); "
        "empty: only the --run rows",
    )
    p.add_argument(
        "--run",
        dest="runs",
        action="append",
        default=[],
        metavar="LABEL|KEY=VALUE ...",
        help="with --launcher local: one more Kiln row, its label and its overrides (space-separated), "
        "e.g. 'ZeRO-2, no overlap|parallel.zero_stage=2 "
        "parallel.deepspeed.zero_optimization.overlap_comm=false'; repeatable",
    )
    p.add_argument("--compile", action="store_true", help="train.compile for Kiln, model.compile() for the plain loop")
    p.add_argument(
        "--plain-host-malloc",
        choices=["default", "keep"],
        default="default",
        help="the plain loop's malloc: glibc's defaults, as a user's loop has them, or set as Kiln's "
        "parallel.host_malloc=keep sets it (to compare the rest of Kiln's path alike)",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="a Kiln run that fails gets a 'failed' row instead of ending the benchmark (for a lent GPU)",
    )
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra Kiln override, repeatable")
    p.add_argument("--results", default=results_file("throughput"))
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of every Kiln run, each round between two plain-loop runs; the table shows "
        "medians (this VM's speed drifts by 10-20%% between minutes)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rounds = bracketed_rounds(args, tmp)
    text = report(args, rounds)
    publish(text + "\n", args.results)


def kiln_configs(args, tmp: str) -> list[tuple[str, list[str]]]:
    """(label, overrides) of each Kiln run; every one has the same global batch as the plain loop."""
    cores = os.cpu_count() or 1
    common = [
        f"data.path={args.data}",
        f"model.flavour={args.flavour}",
        f"train.max_steps={args.steps}",
        "train.eval_every=0",
        "train.eval_batches=4",
        f"train.micro_batch_size={args.batch}",
        f"train.precision={args.precision}",
        "logging.experiment=bench",
        f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
        f"train.storage_path={tmp}/runs",
        f"train.compile={args.compile}",
        *args.sets,
    ]
    if args.launcher == "local":
        local = common + [
            "parallel.num_workers=1",
            f"parallel.use_gpu={args.device == 'cuda'}",
            f"parallel.cpus_per_worker={cores if args.device == 'cpu' else 1}",
        ]
        rows = [stage_row(z) for z in args.zero_stages.split(",") if z]
        rows += [(label, over.split()) for label, over in (r.split("|", 1) for r in args.runs)]
        return [
            (f"Kiln: local launcher (no Ray), 1 {args.device} worker, {label}, {args.precision}", local + over)
            for label, over in rows
        ]
    configs = []
    for n in (int(w) for w in args.workers.split(",")):
        cpus, zero, micro = max(1, cores // n), 2 if n > 1 else 0, global_batch(args) // n
        configs.append(
            (
                f"Kiln: Ray Train, {n} worker(s) x {cpus} CPU, micro-batch {micro}, ZeRO-{zero}",
                common
                + [
                    f"parallel.num_workers={n}",
                    f"parallel.cpus_per_worker={cpus}",
                    f"parallel.zero_stage={zero}",
                    f"train.micro_batch_size={micro}",
                ],
            )
        )
    return configs


FAILED = {
    "tok": None,
    "first": None,
    "first_s": None,
    "wait": None,
    "mfu": None,
    "mem": None,
    "alloc": None,
    "startup": [],
}


def stage_row(entry: str) -> tuple[str, list[str]]:
    """`--zero-stages` entry -> (label, overrides): '2' is DeepSpeed's ZeRO-2, 'fsdp2-3' FSDP2's."""
    engine, _, stage = entry.rpartition("-")
    engine = engine or "deepspeed"
    over = [f"parallel.engine={engine}", f"parallel.zero_stage={stage}"]
    return sharding(ParallelConfig(engine=engine, zero_stage=int(stage))), over


def global_batch(args) -> int:
    """Sequences per optimizer step in every run: `--batch` per worker of the first (largest)
    worker count on Ray, `--batch` on the local launcher's one worker."""
    return args.batch * (int(args.workers.split(",")[0]) if args.launcher == "ray" else 1)


def bracketed_rounds(args, tmp: str) -> list[dict[str, dict]]:
    """Every Kiln run once per round, each round between two plain-loop runs (the plain run that
    ends one round begins the next): a round's plain figure is the mean of its two brackets, so
    a drift of this VM's speed during the round cancels to first order."""

    def plain() -> dict:
        m = run_plain(args, global_batch(args))
        return {
            "tok": m["tokens_per_s"],
            "first": m["seconds_to_first_step"],
            "first_s": m["first_step_s"],
            "wait": None,
            "mfu": m.get("mfu"),
            "mem": m.get("max_reserved_gib"),
            "alloc": m.get("max_allocated_gib"),
            "startup": [],
        }

    before, rounds = plain(), []
    for r in range(args.repeats):
        out: dict[str, dict] = {}
        for i, (label, over) in enumerate(kiln_configs(args, tmp)):
            s = run_kiln(args, over, f"{tmp}/r{r}k{i}.json")
            if s is None:
                out[label] = FAILED
                continue
            m = s["metrics"]
            out[label] = {
                "tok": m["throughput/tokens_per_s"],
                "first": s["seconds_to_first_step"],
                "first_s": m.get("time/first_step_s"),
                "wait": m["time/data_wait_share"],
                "mfu": m.get("mfu"),
                "mem": m.get("memory/max_reserved_gib"),
                "alloc": m.get("memory/max_allocated_gib"),
                "startup": startup_breakdown(m),
            }
        after = plain()
        out[PLAIN] = before | {"tok": (before["tok"] + after["tok"]) / 2}
        rounds.append(out)
        before = after
    return rounds


def report(args, rounds: list[dict[str, dict]]) -> str:
    """The table of medians over rounds; a ratio is the median of each round's own ratio."""

    def fmt(v, spec, pct=False):
        return "-" if v is None else format(100 * v if pct else v, spec) + ("%" if pct else "")

    def med(label, key):
        values = [r[label][key] for r in rounds if r[label][key] is not None]
        return statistics.median(values) if values else None

    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — {args.launcher} launcher, {args.device}, {args.flavour}, "
        f"{args.precision}{', compiled' if args.compile else ''}, micro-batch {args.batch}, {args.steps} steps",
        "",
        f"Command: `python -m bench.throughput {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}  ",
        f"Medians of {len(rounds)} round(s), each against the mean of the plain runs before and after it; "
        "the ratio range is the lowest and highest of the rounds' own ratios.",
        "",
        "| run | tokens/s (steady) | ratio vs plain | ratio range | s to first step | first step s (compile) "
        "| data wait share | MFU | max reserved GiB | max allocated GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in [PLAIN, *(k for k in rounds[0] if k != PLAIN)]:
        ratios = [r[label]["tok"] / r[PLAIN]["tok"] for r in rounds if r[label]["tok"] is not None]
        if not ratios:
            lines.append(f"| {label} | failed (see the benchmark's log) | - | - | - | - | - | - | - | - |")
            continue
        shown = label + (
            ", malloc as Kiln's host_malloc=keep" if label == PLAIN and args.plain_host_malloc == "keep" else ""
        )
        lines.append(
            f"| {shown} | {med(label, 'tok'):,.0f} | {statistics.median(ratios):.3f} "
            f"| {min(ratios):.3f}-{max(ratios):.3f} | {med(label, 'first'):.1f} "
            f"| {fmt(med(label, 'first_s'), '.1f')} | {fmt(med(label, 'wait'), '.1f', True)} "
            f"| {fmt(med(label, 'mfu'), '.1f', True)} | {fmt(med(label, 'mem'), '.2f')} "
            f"| {fmt(med(label, 'alloc'), '.2f')} |"
        )
    lines.append("")
    for label, figures in rounds[0].items():  # where each Kiln run's time to its first step went
        if figures["startup"]:
            lines.append(
                f"Start-up (first round), {label}: "
                + ", ".join(f"{what} {sec:.1f} s" for what, sec in figures["startup"])
                + ".  "
            )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
