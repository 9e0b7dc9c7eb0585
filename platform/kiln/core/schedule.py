"""Learning-rate schedules: pure functions of the optimizer step.

`lr_multiplier(step, schedule, max_steps)` is the LR at `step` (0-based, the number of optimizer
steps taken so far) as a fraction of `optim.lr`. Nothing is carried between steps, so a resumed
run gets exactly the LR it would have had, and `kiln lr plot` draws what training will use.

Warmup (all schedules): (step + 1) / warmup_steps for step < warmup_steps. After it, with
t = step - warmup_steps, T = max_steps - warmup_steps, p = min(1, t / T) and floor = min_lr_ratio:

    constant         1
    linear           floor + (1 - floor) (1 - p)
    cosine           floor + (1 - floor) (1 + cos(pi p)) / 2
    exponential      max(floor, exp(-decay_rate t))                   (lr_t = lr_0 e^(-lambda t))
    inverse_sqrt     max(floor, sqrt(w / (w + t))),  w = max(1, warmup_steps)   (Vaswani et al.)
    cosine_restarts  floor + (1 - floor) (1 + cos(pi t_i / T_i)) / 2  (SGDR, Loshchilov & Hutter
                     2017: cycle i lasts T_i = restart_period * restart_mult^i, t_i is the step
                     within it, and the LR jumps back to the peak at each restart)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kiln.guard import tag, write_file
from kiln.knobs import check_ranges, choice, knob, span
from kiln.limits import MAX_STEPS

# After warmup: (t, T, schedule) -> the LR as a fraction of the peak, as the table above gives it
# (t: steps since warmup; T: steps from warmup to the end, at least 1). A new schedule is its
# function and one line here: the config's allowed names and `kiln lr plot` read this table.
Shape = Callable[[int, int, "ScheduleConfig"], float]


def _cosine_restarts(t: int, _: int, sched: ScheduleConfig) -> float:
    t_i, period = t, sched.restart_period
    while t_i >= period:  # integer arithmetic: restarts land on exact steps
        t_i -= period
        period *= sched.restart_mult
    floor = sched.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t_i / period))


def _warmup_width(sched: ScheduleConfig) -> int:
    return max(1, sched.warmup_steps)


SCHEDULES: dict[str, Shape] = {
    "cosine": lambda t, T, s: (
        s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t / T)))
    ),
    "linear": lambda t, T, s: s.min_lr_ratio + (1.0 - s.min_lr_ratio) * (1.0 - min(1.0, t / T)),
    "constant": lambda t, T, s: 1.0,
    "exponential": lambda t, T, s: max(s.min_lr_ratio, math.exp(-s.decay_rate * t)),
    "inverse_sqrt": lambda t, T, s: max(s.min_lr_ratio, math.sqrt(_warmup_width(s) / (_warmup_width(s) + t))),
    "cosine_restarts": _cosine_restarts,
}


@dataclass
class ScheduleConfig:
    name: str = choice("cosine", SCHEDULES)
    """Shape of the learning rate after warmup: a name in SCHEDULES (kiln.core.schedule has each
    formula)."""
    warmup_steps: int = knob(20, *span(0, MAX_STEPS))
    """Linear warmup from lr/warmup_steps to optim.lr over this many optimizer steps."""
    min_lr_ratio: float = knob(0.1, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
    """Floor of the LR as a fraction of optim.lr: cosine and linear end there, the others never
    go below it."""
    decay_rate: float = knob(0.01, *span(0, 10, "a number", note="per step"))
    """exponential: lambda in lr_t = lr * exp(-lambda * t), t counted in steps after warmup."""
    restart_period: int = knob(100, *span(1, MAX_STEPS))
    """cosine_restarts (SGDR): steps in the first cosine cycle, T_0."""
    restart_mult: int = knob(2, *span(1, 1000))
    """cosine_restarts (SGDR): each cycle is this many times longer than the last, T_mult."""

    def check(self) -> None:
        check_ranges(self, "schedule")


def lr_multiplier(step: int, sched: ScheduleConfig, max_steps: int) -> float:
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    return SCHEDULES[sched.name](step - sched.warmup_steps, max(1, max_steps - sched.warmup_steps), sched)


PLOT_POINTS = 2000  # enough to draw every schedule's shape, warmup included, at the plot's width


def lr_curve(sched: ScheduleConfig, peak_lr: float, max_steps: int, steps: Iterable[int] | None = None) -> list[float]:
    """The LR at each of `steps` (1-based optimizer steps; default every step of the run), in order."""
    return [peak_lr * lr_multiplier(s - 1, sched, max_steps) for s in (steps or range(1, max_steps + 1))]


LR_PLOT = "lr-plot"  # the write guard's kind for `kiln lr plot`'s PNG


def plot_schedule(sched: ScheduleConfig, peak_lr: float, max_steps: int, path: str, title: str = "") -> str:
    """Write a PNG of the schedule to `path`, whole or not at all, over nothing but an earlier
    plot (`kiln.guard`); return the path."""
    import io

    import matplotlib

    matplotlib.use("Agg")  # no display on servers, CI or Ray workers
    import matplotlib.pyplot as plt

    # At most PLOT_POINTS steps, evenly spread: a billion-step schedule plots as fast as a short one.
    steps = (
        sorted({1 + (max_steps - 1) * i // (PLOT_POINTS - 1) for i in range(PLOT_POINTS)})
        if max_steps > PLOT_POINTS
        else range(1, max_steps + 1)
    )
    lrs = lr_curve(sched, peak_lr, max_steps, steps)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    ax.plot(list(steps), lrs, lw=1.8)
    if sched.warmup_steps:
        ax.axvline(sched.warmup_steps, color="grey", ls=":", lw=1, label=f"end of warmup ({sched.warmup_steps})")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(title or f"schedule: {sched.name} (peak {peak_lr:g}, floor {sched.min_lr_ratio:g} x peak)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    try:  # the marker in a PNG text chunk: this file is Kiln's to replace next time (kiln.guard)
        fig.savefig(buf, format="png", metadata={"Software": tag(LR_PLOT)})
    finally:
        plt.close(fig)
    write_file(path, buf.getvalue(), kind=LR_PLOT)
    return path
