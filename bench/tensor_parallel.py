"""Tensor parallelism against data parallelism at equal tokens, on the same model, data and cores.

Two ranks under torchrun (the local launcher, no Ray): TP=2 (one replica, each rank half of every
block's projections, micro-batch 2b) against DP=2 (two replicas, micro-batch b each), both
ZeRO-0 in fp32, so every optimizer step trains on the same 2b sequences. Reports steady-state
tokens/s, the step time, the backward time, and for TP the measured time per step in its
all-reduces (`time/tensor_parallel_comm_s`), medians over the steps after warm-up, read from
the runs' MLflow history. Appends a section to bench/results/throughput.md.

    python -m bench.tensor_parallel                     # the debug GPT, micro-batch 8 per DP rank
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, machine, publish, results_file

KEYS = ("throughput/tokens_per_s", "time/step_s", "time/forward_s", "time/backward_s", "time/tensor_parallel_comm_s")


def run(args, tmp: str, name: str, sets: list[str]) -> dict[str, float]:
    common = [
        f"data.path={args.data}",
        f"model.flavour={args.flavour}",
        f"train.max_steps={args.steps}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.precision=fp32",
        "logging.log_every=1",
        "logging.experiment=bench-tp",
        f"logging.run_name={name}",
        f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
        f"train.storage_path={tmp}/runs",
        "parallel.num_workers=2",
        "parallel.zero_stage=0",
        "parallel.cpus_per_worker=1",
    ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",  # its rendezvous on a port the OS picks as it binds: none to lose
        "-m",
        "kiln.launch.local",
        "--config",
        args.config,
        *[a for s in [*common, *sets] for a in ("--set", s)],
    ]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run {name} failed:\n{proc.stderr[-4000:]}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    run_id = client.search_runs(
        [client.get_experiment_by_name("bench-tp").experiment_id], f"attributes.run_name = '{name}'"
    )[0].info.run_id
    out = {}
    for key in KEYS:
        steady = [m.value for m in client.get_metric_history(run_id, key) if m.step > args.warmup]
        out[key] = statistics.median(steady) if steady else float("nan")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="jobs/configs/debug.yaml")
    p.add_argument("--data", default="data/stdlib-bpe")
    p.add_argument("--flavour", default="debug")
    p.add_argument("--batch", type=int, default=8, help="micro-batch per data-parallel rank (TP takes twice it)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dp = run(args, tmp, "dp2", [f"train.micro_batch_size={args.batch}"])
        tp = run(args, tmp, "tp2", [f"train.micro_batch_size={2 * args.batch}", "parallel.tensor_parallel=2"])
    rows = [
        (f"DP=2 (ZeRO-0), micro-batch {args.batch} per rank", dp),
        (f"TP=2 (ZeRO-0), micro-batch {2 * args.batch} on both ranks", tp),
    ]
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — tensor parallelism against data parallelism, "
        f"2 ranks, cpu, {args.flavour}, fp32, {2 * args.batch} sequences per step, {args.steps} steps",
        "",
        f"Command: `python -m bench.tensor_parallel --batch {args.batch} --steps {args.steps}`  ",
        f"Machine: {machine()}  ",
        f"Medians over steps {args.warmup + 1}-{args.steps} of rank 0's metrics, from the runs' MLflow history.",
        "",
        "| run | tokens/s | ratio vs DP=2 | step s | forward s | backward s | TP all-reduce s per step | share of step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, m in rows:
        comm, tok, step = m["time/tensor_parallel_comm_s"], m["throughput/tokens_per_s"], m["time/step_s"]
        timed = comm == comm  # not NaN: the run logged it (TP only)
        lines.append(
            f"| {label} | {tok:,.0f} | {tok / dp['throughput/tokens_per_s']:.3f} | {step:.4f} | "
            f"{m['time/forward_s']:.4f} | {m['time/backward_s']:.4f} | "
            f"{f'{comm:.4f}' if timed else '-'} | {f'{comm / step:.1%}' if timed else '-'} |"
        )
    publish("\n".join(lines) + "\n\n", args.results)


if __name__ == "__main__":
    main()
