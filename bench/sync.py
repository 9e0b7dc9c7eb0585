"""PowerSGD, local SGD and DiLoCo against synchronous training, at equal tokens.

Each run trains the `debug` GPT in fp32 at ZeRO-0 on the demo's data with `kiln train` on 2 Ray
workers (the embedded Ray), from the same seed, on the same rows, for the same steps:
synchronous (a gradient all-reduce every step), PowerSGD (`parallel.grad_compression`, rank 4
from step 10), local SGD and DiLoCo every H steps (`parallel.sync`), and DiLoCo with its
pseudo-gradient in bf16. Recorded per run: the bytes a rank sends a step
(`comm/bytes_per_step`, a sync's spread over its H steps), the validation loss along the way and
after the last step (a loss more than 5% above synchronous training's is flagged), and tokens/s.

On one machine the ranks talk over loopback, which costs next to nothing, so the same methods run
again over a slow link, simulated: `bench/slow_link` makes every collective wait for its bytes at
`--link-mbps` (loopback cannot be throttled without root). There the tokens/s show what fewer
bytes buy. Appends a section to bench/results/throughput.md.

    python -m bench.sync                     # ~25 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from bench.common import REPO, machine, publish, results_file, train_summary

SLOW_LINK = REPO / "bench" / "slow_link"


def methods(h: int) -> dict[str, list[str]]:
    """The runs, by label: their `parallel.*` settings."""
    return {
        "every step": ["parallel.sync=every_step"],
        "powersgd, rank 4": ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4"],
        f"local_sgd, H={h}": ["parallel.sync=local_sgd", f"parallel.sync_every={h}"],
        f"diloco, H={h}": ["parallel.sync=diloco", f"parallel.sync_every={h}"],
        f"diloco, H={h}, bf16": ["parallel.sync=diloco", f"parallel.sync_every={h}", "parallel.grad_compression=bf16"],
    }


def val_curve(summary: dict) -> list[tuple[int, float]]:
    """(step, loss/val) along the run, from its MLflow store."""
    from mlflow.tracking import MlflowClient

    history = MlflowClient(summary["tracking_uri"]).get_metric_history(summary["run_id"], "loss/val")
    return sorted((m.step, m.value) for m in history)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO / "data/stdlib-bpe"), help="make demo's data")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sync-every", type=int, default=20, help="H")
    p.add_argument("--eval-every", type=int, default=200, help="a multiple of H")
    p.add_argument("--link-mbps", type=float, default=100.0, help="the simulated slow link")
    p.add_argument("--slow-steps", type=int, default=200, help="steps of each slow-link run")
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    rows, slow = [], []
    with tempfile.TemporaryDirectory(prefix="kiln-sync-bench-") as tmp:
        common = [
            f"data.path={args.data}",
            "train.precision=fp32",
            "train.micro_batch_size=8",
            "parallel.zero_stage=0",
            "parallel.num_workers=2",
            "parallel.cpus_per_worker=1",
            "train.eval_batches=16",
            "logging.progress_every=1000",
            "logging.log_model=false",
            f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"train.storage_path={tmp}/runs",
            "train.checkpoint_every=0",
        ]
        for i, (label, sets) in enumerate(methods(args.sync_every).items()):
            steps = [f"train.max_steps={args.steps}", f"train.eval_every={args.eval_every}"]
            s = train_summary([*common, *sets, *steps, f"logging.run_name=sync-{i}"], tmp, f"sync-{i}")
            rows.append((label, s["metrics"], val_curve(s)))
        env = {"KILN_BENCH_LINK_MBPS": str(args.link_mbps), "PYTHONPATH": str(SLOW_LINK)}
        for i, (label, sets) in enumerate(methods(args.sync_every).items()):
            steps = [f"train.max_steps={args.slow_steps}", f"train.eval_every={args.slow_steps}"]
            s = train_summary([*common, *sets, *steps, f"logging.run_name=slow-{i}"], tmp, f"slow-{i}", env=env)
            slow.append((label, s["metrics"]))
    _publish(rows, slow, args)


def _publish(rows: list[tuple], slow: list[tuple], args: argparse.Namespace) -> None:
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — PowerSGD, local SGD and DiLoCo against synchronous training, 2 Ray workers, cpu, fp32",
        "",
        f"Command: `python -m bench.sync {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        f"debug GPT on the demo's data, ZeRO-0, micro-batch 8 a worker, {args.steps} steps, the same seed "
        "and rows (equal tokens); DiLoCo's outer Nesterov SGD at lr 0.7, momentum 0.9. Bytes are what a "
        "rank sends a step, a sync's spread over its H steps.",
        "",
        "| method | MiB a step | bytes vs every step | tokens/s | vs every step | val loss | vs every step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[0][1]
    for label, m, _ in rows:
        b, tps, val = m["comm/bytes_per_step"], m["throughput/tokens_per_s"], m["loss/val"]
        flag = " (over 5% worse)" if val > 1.05 * base["loss/val"] else ""
        lines.append(
            f"| {label} | {b / 2**20:.3f} | {b / base['comm/bytes_per_step']:.3f} | {tps:,.0f} | "
            f"{tps / base['throughput/tokens_per_s']:.2f} | {val:.4f}{flag} | {val / base['loss/val']:.4f} |"
        )
    steps = [step for step, _ in rows[0][2]]
    lines += ["", "Validation loss along the way:", "", "| method | " + " | ".join(f"step {s}" for s in steps) + " |"]
    lines.append("|---|" + "---:|" * len(steps))
    for label, _, curve in rows:
        lines.append(f"| {label} | " + " | ".join(f"{v:.4f}" for _, v in curve) + " |")
    lines += [
        "",
        f"Over a simulated {args.link_mbps:g} Mb/s link (`bench/slow_link`: each collective waits for its "
        f"bytes at that rate; an injected delay, not a throttled network), {args.slow_steps} steps each:",
        "",
        "| method | tokens/s | vs every step | comm s a step |",
        "|---|---:|---:|---:|",
    ]
    base_tps = slow[0][1]["throughput/tokens_per_s"]
    for label, m in slow:
        tps = m["throughput/tokens_per_s"]
        lines.append(f"| {label} | {tps:,.0f} | {tps / base_tps:.2f} | {m.get('comm/time_s', float('nan')):.3f} |")
    lines.append("")
    publish("\n".join(lines), args.results)


if __name__ == "__main__":
    main()
