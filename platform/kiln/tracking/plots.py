"""End-of-run PNG plots of a run's metric history: people would rather look than read.

`training_plots(history, out_dir)` writes loss (train and val), learning rate, throughput and
the step-time breakdown, each from the metrics the loop logged; a plot whose series were never
logged (the breakdown under pipeline parallelism) is left out.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("kiln.train")

History = dict[str, list[tuple[int, float]]]

# file name -> (title, y label, [(metric key, legend)], stacked)
PLOTS: dict[str, tuple[str, str, list[tuple[str, str]], bool]] = {
    "loss.png": ("Loss", "loss", [("loss/train", "train"), ("loss/val", "val")], False),
    "lr.png": ("Learning rate", "lr", [("lr", "lr")], False),
    "throughput.png": ("Throughput", "tokens/s", [("throughput/tokens_per_s", "all workers")], False),
    "step_time.png": (
        "Step-time breakdown (rank 0)",
        "seconds",
        [
            ("time/data_wait_s", "data wait"),
            ("time/forward_s", "forward"),
            ("time/backward_s", "backward + all-reduce"),
            ("time/optimizer_s", "optimizer"),
        ],
        True,
    ),
}
PLOTTED = {key for _, _, series, _ in PLOTS.values() for key, _ in series}


def training_plots(history: History, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # no display on workers
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, series, stacked) in PLOTS.items():
        present = [(key, label) for key, label in series if history.get(key)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
        if stacked and len(present) > 1:
            steps = [s for s, _ in history[present[0][0]]]
            by_step = [dict(history[key]) for key, _ in present]
            ax.stackplot(
                steps, [[d.get(s, 0.0) for s in steps] for d in by_step], labels=[label for _, label in present]
            )
        else:
            for key, label in present:
                points = sorted(history[key])
                marker = "o" if len(points) < 10 else None  # sparse series (val) stay visible
                ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker=marker)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    return written
