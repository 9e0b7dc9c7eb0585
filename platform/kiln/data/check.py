"""A run config against its dataset: the manifest and shards are there, the model's vocab and
sequence length fit the data, and every worker gets at least one micro-batch.

Used before launch (`kiln.launch.preflight`), by a sweep's trials, and by `kiln plan`, which
reads a config's shapes from its data where it can.
"""

from __future__ import annotations

import dataclasses

from kiln.config import RunConfig
from kiln.data.manifest import Manifest, check_shards, load_manifest
from kiln.errors import ConfigError
from kiln.model import padded_vocab
from kiln.storage import absolute, resolve


def resolve_against_data(cfg: RunConfig) -> tuple[RunConfig, Manifest]:
    """Load and check the dataset; fill in model.vocab_size/seq_len; refuse mismatches. A local
    data.path becomes absolute: workers read the shards themselves, from another directory."""
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path)))
    loc = resolve(cfg.data.path, cfg.data.s3_endpoint, cfg.data.s3_region)
    manifest = load_manifest(loc)
    check_shards(manifest)
    vocab, seq = manifest.vocab_size, manifest.seq_len
    m = cfg.model
    if m.vocab_size and m.vocab_size < vocab:
        raise ConfigError(
            f"model.vocab_size = {m.vocab_size} is smaller than the vocab of {loc.uri} ({vocab}): "
            f"expected model.vocab_size >= {vocab}, or 0 to take it from the data"
        )
    if m.seq_len and m.seq_len != seq:
        raise ConfigError(
            f"model.seq_len = {m.seq_len} does not match the seq_len of {loc.uri} ({seq}): "
            f"expected {seq}, or 0 to take it from the data"
        )
    model = dataclasses.replace(m, vocab_size=m.vocab_size or padded_vocab(vocab), seq_len=seq)
    cfg = dataclasses.replace(cfg, model=model)
    per_step = cfg.data_parallel_size * cfg.train.micro_batch_size
    for split in ("train", "val"):
        rows = manifest.split(split)["rows"]
        if rows < per_step:
            raise ConfigError(
                f"the {split} split of {loc.uri} has {rows} rows, fewer than one micro-batch on every "
                f"worker ({cfg.parallel.num_workers} x {cfg.train.micro_batch_size}); lower "
                "train.micro_batch_size or parallel.num_workers, or prepare more data"
            )
    return cfg, manifest
