"""What checkpointing costs: steady-state tokens/s with a save every N steps against none.

Runs the local launcher (one process, no Ray) on the same data and steps, once without
intermediate checkpoints and once saving every N steps, for the `debug` flavour and a larger one
that still trains on a CPU (gpt2-124m's width, 4 layers). The cost is measured inside the run:
`throughput/tokens_per_s_with_checkpoints` counts the seconds the saves took within the
steady-state steps, `throughput/tokens_per_s` does not. Appends a table to bench/results/throughput.md.

    python -m bench.checkpoint_overhead              # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import LOCAL, REPO, machine, publish, results_file, train_summary
from kiln.model import config_for  # noqa: E402
from kiln.model_size import num_params  # noqa: E402

MODELS = [  # (label, flavour, layers (0: the flavour's), micro-batch)
    ("debug", "debug", 0, 16),
    ("gpt2-124m width, 4 layers", "gpt2-124m", 4, 4),
]
WARMUP_STEPS_EXCLUDED = 5  # kiln.core.loop's: saves within the first steps are not counted


def run(overrides: list[str], tmp: str, name: str) -> dict:
    return train_summary(overrides, tmp, name, launcher=LOCAL)


def size_gib(path: str) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO / "data/stdlib-bpe"))
    p.add_argument("--steps", type=int, default=45)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--results", default=results_file("throughput"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-ckpt-bench-") as tmp:
        data = json.loads((Path(args.data) / "manifest.json").read_text())
        for label, flavour, layers, micro in MODELS:
            shape = config_for(
                flavour,
                vocab_size=data["tokenizer"]["vocab_size"],
                seq_len=data["seq_len"],
                **({"n_layer": layers} if layers else {}),
            )
            label = f"{label} ({num_params(shape, non_embedding=False) / 1e6:.1f}M params)"
            model = [f"model.flavour={flavour}", f"train.micro_batch_size={micro}"] + (
                [f"model.n_layer={layers}"] if layers else []
            )
            common = [
                f"data.path={args.data}",
                f"train.max_steps={args.steps}",
                "train.eval_every=0",
                "parallel.zero_stage=0",
                "parallel.cpus_per_worker=2",
                "logging.progress_every=1000",
                f"logging.tracking_uri=sqlite:///{tmp}/mlflow.db",
                f"train.storage_path={tmp}/runs",
                *model,
            ]
            for every in (0, args.every):
                name = f"{len(rows)}"
                s = run([*common, f"train.checkpoint_every={every}", f"logging.run_name=ckpt-{name}"], tmp, name)
                m = s["metrics"]
                rows.append(
                    (
                        label,
                        every,
                        m["throughput/tokens_per_s"],
                        m["throughput/tokens_per_s_with_checkpoints"],
                        size_gib(s["checkpoint"]),
                    )
                )
    base = {label: with_ckpt for label, every, _, with_ckpt, _ in rows if every == 0}
    saves = len([s for s in range(args.every, args.steps, args.every) if s > WARMUP_STEPS_EXCLUDED])
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M')} — checkpoint overhead, local launcher, cpu, fp32, {args.steps} steps",
        "",
        f"Command: `python -m bench.checkpoint_overhead {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine()}",
        "",
        "| model | checkpoints | tokens/s counting saves | ratio vs none | one checkpoint (GiB) |",
        "|---|---|---|---|---|",
    ]
    for label, every, _, with_ckpt, gib in rows:
        what = f"every {every} steps ({saves} saves)" if every else "none (only the final save, not counted)"
        lines.append(f"| {label} | {what} | {with_ckpt:,.0f} | {with_ckpt / base[label]:.3f} | {gib:.3f} |")
    lines.append("")
    text = "\n".join(lines)
    publish(text, args.results)


if __name__ == "__main__":
    main()
