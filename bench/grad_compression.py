"""What gradient compression saves and costs: `parallel.grad_compression` none, bf16 and fp16.

Each run trains the `debug` GPT in fp32 on the demo's data (the stdlib's top-level modules) with
`kiln train` on 2 Ray workers (the embedded Ray), from the same seed, on the same rows, for the
same steps, at ZeRO-0 (one gradient all-reduce a step) and ZeRO-2 (DeepSpeed all-reduces the
gradients too, then gathers the updated weights). Recorded per run: the bytes a rank hands to the network in
a step (`comm/bytes_per_step`, counted at torch.distributed's collectives), steady-state
tokens/s and the validation loss after the last step, each beside the uncompressed run's.
A loss more than 5% above it is flagged. On one machine the ranks talk over loopback, so the
bytes, not the tokens/s, show what a slow link would gain. Appends a table to
bench/results/throughput.md.

    python -m bench.grad_compression          # ~8 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from bench.common import REPO, machine, publish, results_file, train_summary

METHODS = ("none", "bf16", "fp16")


def run(overrides: list[str], tmp: str, name: str) -> dict:
    """One `kiln train` run's summary metrics."""
    return train_summary(overrides, tmp, name)["metrics"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO / "data/stdlib-bpe"), help="make demo's data")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--zero-stages", default="0,2")
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-compression-bench-") as tmp:
        common = [
            f"data.path={args.data}",
            "train.precision=fp32",
            "train.micro_batch_size=8",
            "parallel.num_workers=2",
            "parallel.cpus_per_worker=1",
            f"train.max_steps={args.steps}",
            f"train.eval_every={args.steps}",
            "train.eval_batches=16",
            "logging.progress_every=1000",
            "logging.log_model=false",
            f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
            f"train.storage_path={tmp}/runs",
        ]
        for stage in args.zero_stages.split(","):
            for method in METHODS:
                name = f"zero{stage}-{method}"
                sets = [f"parallel.zero_stage={stage}", f"parallel.grad_compression={method}"]
                m = run([*common, *sets, f"logging.run_name={name}"], tmp, name)
                rows.append((stage, method, m["comm/bytes_per_step"], m["throughput/tokens_per_s"], m["loss/val"]))
    _publish(rows, args)


def _publish(rows: list[tuple], args: argparse.Namespace) -> None:
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — gradient compression, 2 Ray workers, cpu, fp32",
        "",
        f"Command: `python -m bench.grad_compression {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        f"debug GPT on the demo's data, micro-batch 8 a worker, {args.steps} steps, the same seed and rows; "
        "bytes are what a rank sends in a step (`comm/bytes_per_step`: its collectives under ring "
        "accounting). The ranks share one machine, so loopback, not a network, carries them.",
        "",
        "| ZeRO | grad_compression | MiB a step | bytes vs none | tokens/s | vs none | val loss | vs none |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {stage: (b, tps, val) for stage, method, b, tps, val in rows if method == "none"}
    for stage, method, b, tps, val in rows:
        b0, tps0, val0 = base[stage]
        flag = " (over 5% worse)" if val > 1.05 * val0 else ""
        lines.append(
            f"| {stage} | {method} | {b / 2**20:.2f} | {b / b0:.2f} | {tps:,.0f} | {tps / tps0:.2f} | "
            f"{val:.4f}{flag} | {val / val0:.4f} |"
        )
    lines.append("")
    publish("\n".join(lines), args.results)


if __name__ == "__main__":
    main()
