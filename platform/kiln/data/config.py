"""The `data` section of a run: which prepared datasets it trains on, and how they stream.

A dataset here is what `kiln data prepare` wrote (its own settings are `PrepareConfig`, in
`kiln.data.prepare_config`). `DataConfig.check` holds the section's own rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from kiln.errors import ConfigError
from kiln.knobs import check_ranges, knob, readable, span
from kiln.storage import is_url

MAX_MIX_WEIGHT = 1e6  # a million to one between two datasets: past any real mixture, short of a typo


@dataclass
class MixSource:
    path: str = ""
    """A dataset written by `kiln data prepare`: a local directory or s3://bucket/prefix."""
    weight: float = 1.0
    """Its share of the training rows, relative to the others' (1, 1, 2 draws a quarter, a
    quarter and a half)."""
    name: str = ""
    """What metrics call it (`data/mix/<name>_frac`). Empty: the path's last part."""


@dataclass
class DataConfig:
    path: str = "data/stdlib-bpe"
    """Dataset written by `kiln data prepare`: a local directory or s3://bucket/prefix. With
    `mix`, the first dataset of the mixture (set for you)."""
    mix: list[MixSource] = field(default_factory=list)
    """Several datasets to train on at once, each at its weight: `[{path: data/code, weight: 1},
    {path: data/prose, weight: 3}]`. They must share a tokenizer and seq_len. Validation runs
    over every dataset's val split. Empty: `path` alone."""
    reshuffle: bool = False
    """Reshuffle the train rows every epoch, by train.seed (shards, then blocks within windows of
    shards, then the rows of each block; docs/data-order.md). False: every epoch in
    the order the dataset was written, which `kiln data prepare` already shuffled."""
    s3_endpoint: str = ""
    """S3-compatible endpoint URL (MinIO, moto, ...). Empty: $AWS_ENDPOINT_URL, else AWS."""
    s3_region: str = "us-east-1"
    """Region passed to the S3 client; most S3-compatible servers ignore it."""
    prefetch_batches: int = knob(2, *span(0, 64))
    """Batches read ahead of the training step, hiding read and decode time: Ray Data's blocks
    ahead, and the depth of the loop's prefetch queue (pinned host memory on a GPU; at least 1)."""
    read_task_cpus: float = knob(0.5, *span(0, 1024, "a number"))
    """CPUs each Ray Data read task reserves. Decoding token Parquet is light next to training,
    so half a CPU; 0 lets reads run even where the training workers hold every CPU."""
    document_mask: Literal["auto", "true", "false"] = "auto"
    """Attend only within a document: a row packs several documents or examples, and with true
    a token sees the earlier tokens of its own document alone, its positions counted from the
    document's start, and a document's first token is not predicted from the one before
    (`kiln.model.document_attention`). auto: true for instruction and chat data (examples
    must not see each other), false for plain text (pretraining on packed text is the
    usual practice, and bench/document_mask.py measures the cost). Resolved against the data
    before launch; true needs datasets that record where documents start (the shards'
    `starts` column, which `kiln data prepare` writes) and no pipeline stages."""
    index_log: str = ""
    """A directory where every data-parallel replica writes, step by step, the sample ids it
    trained on (`kiln.data.indices`: a JSON line a step, read back with `trained_ids`), to find
    the rows behind a loss spike or check a resume. Each node writes its own replicas' files:
    give a shared filesystem to have them all in one place. Relative: under the run's local
    directory (beside local checkpoints). Empty: not written."""

    @property
    def masks_documents(self) -> bool:
        """Whether the run attends within documents (document_mask as resolved before launch)."""
        return self.document_mask == "true"

    def check(self) -> None:
        """Ranges, and data.mix: each entry names a dataset and a positive weight, and metric
        names are distinct."""
        check_ranges(self, "data")
        if is_url(self.index_log):
            raise ConfigError(
                f"data.index_log = {self.index_log!r}: expected a local directory (each replica "
                "appends to its file every step)"
            )
        names: list[str] = []
        for i, m in enumerate(self.mix):
            where = f"data.mix[{i}]"
            if not m.path.strip():
                raise ConfigError(f"{where}.path is empty: expected a dataset directory or s3:// prefix")
            if not 0 < m.weight <= MAX_MIX_WEIGHT:
                raise ConfigError(
                    f"{where}.weight = {m.weight!r} is out of range: expected a number in "
                    f"(0, {readable(MAX_MIX_WEIGHT)}]"
                )
            name = mix_name(m)
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(
                    f"{where}.name = {name!r}: expected letters, digits, '_', '.' or '-' (it names metrics)"
                )
            if name in names:
                raise ConfigError(
                    f"{where}: the name {name!r} is taken by data.mix[{names.index(name)}]; give one of them a name"
                )
            names.append(name)


def mix_name(m: MixSource) -> str:
    """A mixture dataset's name in metrics: its own, else its path's last part."""
    return m.name or m.path.rstrip("/").rsplit("/", 1)[-1]
