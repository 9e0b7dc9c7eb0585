"""Live progress: a one-line bar redrawn in place on a terminal, periodic log lines elsewhere.

`kiln train` (and the local launcher) draw the bar when stderr is a terminal. Under Ray the
workers have no terminal, so rank 0 pushes each step to a small `ProgressBoard` actor that the
driver polls and draws (`kiln.ray.progress`). In CI, in a pipe or under `ray job logs`
nothing is a terminal, and rank 0 logs a line every `logging.progress_every` steps instead.
Nothing here imports torch or Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import IO, Protocol

# Lines for the user's console, wherever they are logged: on a Ray worker the driver's
# `kiln.ray.console` shows this logger's lines and sends other INFO lines to the run's log file.
CONSOLE_LOGGER = "kiln.console"
console = logging.getLogger(CONSOLE_LOGGER)


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a run stands after one step; what the bar and the log line show."""

    step: int
    total: int
    loss: float
    tokens_per_s: float
    lr: float
    mean_step_s: float
    """Mean seconds per steady-state step; drives the ETA (0: not measured yet, no ETA)."""
    val: float | None = None

    @property
    def eta_s(self) -> float:
        return max(0.0, self.mean_step_s * (self.total - self.step))


def duration(seconds: float) -> str:
    """`1h02m`, `4m05s` or `9s`: short enough for one terminal line."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def format_line(p: Progress, width: int = 24) -> str:
    filled = min(width, int(width * p.step / max(p.total, 1)))
    bar = "#" * filled + "-" * (width - filled)
    val = f" | val {p.val:.3f}" if p.val is not None else ""
    return (
        f"[{bar}] step {p.step}/{p.total} | loss {p.loss:.3f}{val} | {p.tokens_per_s:,.0f} tok/s"
        f" | lr {p.lr:.2e} | eta {duration(p.eta_s) if p.mean_step_s > 0 else '--'}"
    )


class ProgressSink(Protocol):
    def update(self, p: Progress) -> None: ...

    def close(self) -> None: ...


class DriverBar(ProgressSink, Protocol):
    """A bar the driver draws from rank 0's progress (`TerminalBar`, `TqdmBar`), with room for
    other lines above it."""

    def print_above(self, lines: str) -> None: ...


class LogLines:
    """A log line on the first step, every `every` steps and on the last: readable in CI logs
    and `ray job logs`, where a redrawn line would be one line per frame."""

    def __init__(self, every: int):
        self.every = max(1, every)

    def update(self, p: Progress) -> None:
        if p.step == 1 or p.step % self.every == 0 or p.step == p.total:
            console.info("%s", format_line(p))

    def close(self) -> None:
        pass


class TerminalBar:
    """Redraws one line in place (carriage return, erase line), at most every `min_interval_s`
    so a fast run does not spend its time writing to the terminal; the last step always draws."""

    def __init__(self, stream: IO[str], min_interval_s: float = 0.1):
        self.stream, self.min_interval_s = stream, min_interval_s
        self._last_draw = float("-inf")  # the first frame always draws
        self._drawn = False
        self._text = ""

    def update(self, p: Progress) -> None:
        self.draw(format_line(p), force=p.step >= p.total)

    def draw(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval_s:
            return
        self.stream.write("\r\x1b[K" + text[: max(20, self._columns() - 1)])
        self.stream.flush()
        self._last_draw, self._drawn, self._text = now, True, text

    def _columns(self) -> int:
        """The width of the terminal drawn on: $COLUMNS if set, else the stream's own terminal
        (not stdout's, which `shutil.get_terminal_size` asks, and which is a file or a pipe
        when only stderr is a terminal), else 120 columns."""
        if os.environ.get("COLUMNS", "").isdigit() and int(os.environ["COLUMNS"]) > 0:
            return int(os.environ["COLUMNS"])
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or 120
        except (AttributeError, OSError, ValueError):  # no descriptor, or not a terminal
            return 120

    def print_above(self, lines: str) -> None:
        """Lines (each ending in a newline) above the bar, which is drawn again below them."""
        self.stream.write(("\r\x1b[K" if self._drawn else "") + lines)
        self.stream.flush()
        if self._drawn:
            self.draw(self._text, force=True)

    def close(self) -> None:
        if self._drawn:  # leave the last frame on screen and move past it
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


class TqdmBar:
    """The bar for notebooks and scripts (`kiln.train`): `tqdm.auto`, a widget in Jupyter and a
    text bar elsewhere, fed the same `Progress` as `TerminalBar`."""

    def __init__(self):
        self._bar = None

    def update(self, p: Progress) -> None:
        from tqdm.auto import tqdm

        if self._bar is None:
            self._bar = tqdm(total=p.total, unit="step", desc="train", dynamic_ncols=True)
        self._bar.n = p.step
        val = f" | val {p.val:.3f}" if p.val is not None else ""
        self._bar.set_postfix_str(
            f"loss {p.loss:.3f}{val} | {p.tokens_per_s:,.0f} tok/s | lr {p.lr:.2e}", refresh=False
        )
        self._bar.refresh()

    def print_above(self, lines: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(lines.rstrip("\n"))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM", "") != "dumb"


def sink_for(stream: IO[str], every: int) -> ProgressSink:
    """The bar on a terminal, log lines anywhere else."""
    return TerminalBar(stream) if is_terminal(stream) else LogLines(every)
