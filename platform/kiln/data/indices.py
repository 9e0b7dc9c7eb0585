"""Which sample ids each optimizer step trained on, written as the run trains (`data.index_log`)
and read back across restarts, resizes and rollbacks.

OLMo keeps the same record (`save_data_indices`) to find the rows behind a loss spike; here it
also shows that a resume or a resize read every row once per epoch. Hand-written: the record
must follow Kiln's own data order and worker groups, which no library knows.

Each data-parallel replica (its first pipeline stage and tensor-parallel rank) appends one JSON
line a step to `group-<start>.replica<r>.jsonl`: the step, what became of it (`trained`, or
`skipped` / `dropped` by the health guard), and each micro-batch's epoch and sample ids, in the
order the replica read them. `<start>` is the worker group's start (microseconds, the same on
every rank). A later group's lines win over an earlier group's for the same step (a restart
trains again what its group lost), and within a group the last line for a step wins (a
rollback trains steps again).
"""

from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

TRAINED, SKIPPED, DROPPED = "trained", "skipped", "dropped"  # a step's fate: kept, or the health guard's
_NAME = re.compile(r"group-(\d+)\.replica(\d+)\.jsonl")


class IndexLog:
    """One replica's record. `tap` passes its (ids, tokens) micro-batches on as tokens and keeps
    the ids of those read ahead; `record` writes the ones the step took."""

    def __init__(self, directory: str, group: int, replica: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"group-{group}.replica{replica}.jsonl")
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - open for the run; a line a step
        self._ahead: collections.deque = collections.deque()  # (epoch, ids) read, not yet recorded
        self._recorded = 0

    def tap(self, samples: Iterator[tuple[int, np.ndarray, torch.Tensor]], consumed: int) -> Iterator[torch.Tensor]:
        """The token rows of `samples` ((epoch, ids, tokens) micro-batches, from the replica's
        micro-batch `consumed` on); the ids kept. The prefetch thread runs this: deque appends
        and pops are atomic."""
        self._recorded = consumed
        return self._kept(samples)

    def _kept(self, samples: Iterator[tuple[int, np.ndarray, torch.Tensor]]) -> Iterator[torch.Tensor]:
        for epoch, ids, tokens in samples:
            self._ahead.append((epoch, ids.tolist()))
            yield tokens

    def record(self, step: int, consumed: int, status: str = TRAINED) -> None:
        """Step `step` took the micro-batches drawn since the last record, up to `consumed`."""
        taken = [self._ahead.popleft() for _ in range(consumed - self._recorded)]
        self._recorded = consumed
        self._file.write(
            json.dumps(
                {"step": step, "status": status, "epochs": [e for e, _ in taken], "ids": [ids for _, ids in taken]}
            )
            + "\n"
        )

    def close(self) -> None:
        self._file.close()


def trained_ids(directory: str | Path) -> dict[int, list[tuple[int, int]]]:
    """{step: [(epoch, sample id), ...]} of every step the run kept, over all its replicas
    (replica by replica, in reading order): each step as the last group that trained it did."""
    groups: dict[int, dict[int, dict[int, dict]]] = collections.defaultdict(dict)  # group, replica, step
    for path in Path(directory).glob("group-*.replica*.jsonl"):
        match = _NAME.fullmatch(path.name)
        if match is None:
            continue
        steps: dict[int, dict] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                steps[entry["step"]] = entry
        groups[int(match[1])][int(match[2])] = steps
    out: dict[int, list[tuple[int, int]]] = {}
    for group in sorted(groups):  # later groups overwrite earlier ones' steps
        replicas = groups[group]
        for step in sorted({s for steps in replicas.values() for s in steps}):
            entries = [replicas[r][step] for r in sorted(replicas) if step in replicas[r]]
            out[step] = [
                (e, i)
                for entry in entries
                if entry["status"] == TRAINED
                for e, ids in zip(entry["epochs"], entry["ids"])
                for i in ids
            ]
    return {s: ids for s, ids in sorted(out.items()) if ids}
