"""How `kiln data prepare` reports: a progress bar over the input bytes while it runs, and the
throughput the manifest records once it is done (both from the units' records).
"""

from __future__ import annotations

import logging
import time

from kiln.data.listing import Units

log = logging.getLogger("kiln.data.prepare")  # the lines a user has always seen under this name


def throughput(done: list[dict], began: float, ended: float) -> dict:
    """What this run prepared (a resume counts only its own units), per second of the span
    from the pipeline's start (`began`, unix time; the actors' start is in it) to the last
    record back (`ended`)."""
    mb = sum(r["bytes"] for r in done) / 1e6
    tokens = sum(r["splits"][s]["tokens"] for r in done for s in ("train", "val"))
    busy = sum(r["seconds"] for r in done)  # the workers' own time on the units
    seconds = ended - began
    # how long the first unit waited for a worker (an actor's start), and the last one's end
    # before the end (its record's way back); the rest of the idle time is the workers' uneven shares
    first = min((r["started"] for r in done if "started" in r), default=began) - began
    last = max((r["started"] + r["seconds"] for r in done if "started" in r), default=ended)
    return {
        "seconds": round(seconds, 3),
        "workers": len({r.get("pid") for r in done}),
        "nodes": len({r.get("node") for r in done}),
        "units": len(done),
        "mb": round(mb, 3),
        "mb_per_s": mb / max(seconds, 1e-9),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "busy_s": round(busy, 3),
        "mb_per_busy_s": mb / max(busy, 1e-9),
        "first_unit_after_s": round(max(0.0, first), 3),
        "after_last_unit_s": round(max(0.0, ended - last), 3),
    }


class Progress:
    """A bar over the input bytes with rows, tokens/s and the ETA (tqdm, where stderr is a
    terminal); elsewhere a log line at every tenth of the units."""

    def __init__(self, units: Units, done: dict[int, dict]):
        from tqdm.auto import tqdm

        self.units, self.seen, self.t0, self.tokens = len(units), len(done), time.perf_counter(), 0
        self.rows = sum(r["splits"][s]["rows"] for r in done.values() for s in ("train", "val"))
        self.bar = tqdm(
            total=int(units.sizes.sum()),
            initial=sum(r["bytes"] for r in done.values()),
            unit="B",
            unit_scale=True,
            desc="prepare",
            disable=None,
            mininterval=1.0,
        )

    def __enter__(self) -> Progress:
        return self

    def update(self, rec: dict) -> None:
        self.seen += 1
        self.rows += sum(rec["splits"][s]["rows"] for s in ("train", "val"))
        self.tokens += sum(rec["splits"][s]["tokens"] for s in ("train", "val"))
        tok_s = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.rows:,} rows, {tok_s:,.0f} tok/s", refresh=False)
        self.bar.update(rec["bytes"])
        if self.bar.disable and self.seen * 10 // self.units > (self.seen - 1) * 10 // self.units:
            log.info("prepare: %d/%d units, %d rows, %.0f tokens/s", self.seen, self.units, self.rows, tok_s)

    def __exit__(self, *exc) -> None:
        self.bar.close()
