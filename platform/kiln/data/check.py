"""A run config against its dataset: the manifest and shards are there, the model's vocab and
sequence length fit the data, and every worker gets at least one micro-batch.

Used before launch (`kiln.launch.preflight`), by a sweep's trials, and by `kiln plan`, which
reads a config's shapes from its data where it can.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from kiln.data.manifest import Manifest, check_shards
from kiln.data.mixture import Dataset, check_agree, run_datasets
from kiln.data.tokenizer import describe, pretrained
from kiln.errors import ConfigError
from kiln.hf_checkpoint import init_from_dir, pretrained_shape
from kiln.model import GPTConfig, padded_vocab
from kiln.storage import absolute

if TYPE_CHECKING:  # the config composes the data section: a type here, never an import
    from kiln.config import RunConfig


def resolve_against_data(cfg: RunConfig, pretrained: GPTConfig | None = None) -> tuple[RunConfig, list[Dataset]]:
    """Load and check the run's datasets (`data.path`, or each of `data.mix`, which must agree);
    fill in model.vocab_size/seq_len; refuse mismatches. `pretrained`: model.init_from's shape
    where the caller has read it already. Local paths become absolute: workers
    read the shards themselves, from another directory; data.path becomes the mixture's first."""
    mix = [dataclasses.replace(m, path=absolute(m.path)) for m in cfg.data.mix]
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, mix=mix, path=mix[0].path if mix else absolute(cfg.data.path))
    )
    datasets = run_datasets(cfg)
    check_agree(datasets)  # first: it reads the manifests only
    for d in datasets:
        check_shards(d.manifest)
    manifest = datasets[0].manifest
    loc = manifest.location
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
    if m.init_from:
        model = _pretrained_model(cfg, manifest, pretrained)
    else:
        model = dataclasses.replace(m, vocab_size=m.vocab_size or padded_vocab(vocab), seq_len=seq)
    cfg = dataclasses.replace(
        cfg, model=model, data=dataclasses.replace(cfg.data, document_mask=document_mask(cfg, datasets))
    )
    per_step = cfg.data_parallel_size * cfg.train.micro_batch_size
    for split in ("train", "val"):
        rows = sum(d.manifest.split(split)["rows"] for d in datasets)
        if rows < per_step:
            where = loc.uri if len(datasets) == 1 else "the datasets of data.mix"
            raise ConfigError(
                f"the {split} split of {where} has {rows} rows, fewer than one micro-batch on every "
                f"worker ({cfg.parallel.max_workers} x {cfg.train.micro_batch_size}); lower "
                "train.micro_batch_size or parallel.num_workers, or prepare more data"
            )
    return cfg, datasets


def masks_by_default(manifests: list[Manifest]) -> bool:
    """data.document_mask = auto's rule for data (a run adds: no pipeline): instruction or chat
    data, every dataset recording where its documents start."""
    return any(m.examples for m in manifests) and all(m.document_starts for m in manifests)


def document_mask(cfg: RunConfig, datasets: list[Dataset]) -> Literal["true", "false"]:
    """data.document_mask resolved against the datasets, "true" or "false": auto masks
    instruction and chat data, and only where every dataset records its document starts and
    no pipeline runs (true asks for both, and is refused without them)."""
    lacking = [d for d in datasets if not d.manifest.document_starts]
    if cfg.data.document_mask == "auto":
        on = masks_by_default([d.manifest for d in datasets]) and cfg.parallel.pipeline_stages == 1
        return "true" if on else "false"
    if cfg.data.document_mask == "true" and lacking:
        d = lacking[0]
        raise ConfigError(
            f"data.document_mask = true: {d.where} = {d.manifest.location.uri} does not record where its "
            "documents start (an older kiln data prepare wrote it): prepare it again, or set "
            "data.document_mask = false"
        )
    return "true" if cfg.data.document_mask == "true" else "false"


def _pretrained_model(cfg: RunConfig, manifest: Manifest, shape: GPTConfig | None):
    """model.init_from's checkpoint against the data: its context must hold the data's rows, and
    the data must be tokenized with its tokenizer (same vocab, same ids)."""
    m, where = cfg.model, f"model.init_from = {cfg.model.init_from!r}"
    d = cfg.data
    shape = shape or pretrained_shape(m.init_from, d.s3_endpoint, d.s3_region)
    local = init_from_dir(m.init_from, d.s3_endpoint, d.s3_region)
    if m.vocab_size or m.n_layer:
        raise ConfigError(f"{where} sets the model's shape: leave model.vocab_size and model.n_layer at 0")
    if manifest.seq_len > shape.seq_len:
        raise ConfigError(
            f"{where}: its context is {shape.seq_len} tokens, shorter than the rows of "
            f"{manifest.location.uri} ({manifest.seq_len}); prepare the data with --seq-len "
            f"<= {shape.seq_len}"
        )
    if not (local / "tokenizer.json").is_file():
        raise ConfigError(f"{where}: has no tokenizer.json, so the data's tokenizer cannot be checked against it")
    theirs, ours = pretrained(str(local)), manifest.tokenizer()
    same = ours.vocab() == theirs.vocab()
    if not same or ours.vocab_size > shape.vocab_size:
        raise ConfigError(
            f"{where}: {manifest.location.uri} was tokenized with a different tokenizer "
            f"({ours.vocab_size} tokens, {describe(ours)['type']}) than the model's "
            f"({theirs.vocab_size} tokens); prepare it with kiln data prepare --tokenizer {local}"
        )
    return dataclasses.replace(m, vocab_size=shape.vocab_size, seq_len=manifest.seq_len)
