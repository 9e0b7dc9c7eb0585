"""A run's datasets: `data.path` alone, or the weighted datasets of `data.mix`, which must
agree on what a row is (tokenizer and seq_len) before anything launches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.data.config import MixSource, mix_name
from kiln.data.manifest import Manifest, load_manifest
from kiln.errors import ConfigError
from kiln.storage import resolve

if TYPE_CHECKING:  # the config composes the data section: a type here, never an import
    from kiln.config import RunConfig


@dataclass(frozen=True)
class Dataset:
    """One dataset of a run, with its weight in the mixture and its name in metrics."""

    manifest: Manifest
    weight: float
    name: str
    where: str  # the config field that named it, for errors


def mix_entries(cfg: RunConfig) -> list[tuple[MixSource, str]]:
    """The run's datasets as config entries, with the field each comes from."""
    if cfg.data.mix:
        return [(m, f"data.mix[{i}]") for i, m in enumerate(cfg.data.mix)]
    return [(MixSource(path=cfg.data.path, weight=1.0, name=mix_name(MixSource(path=cfg.data.path))), "data.path")]


def run_datasets(cfg: RunConfig) -> list[Dataset]:
    """Every dataset of the run, its manifest loaded (no check: `check_agree` is preflight's)."""
    return [
        Dataset(load_manifest(resolve(m.path, cfg.data.s3_endpoint, cfg.data.s3_region)), m.weight, mix_name(m), where)
        for m, where in mix_entries(cfg)
    ]


def check_agree(datasets: list[Dataset]) -> None:
    """The datasets of a mixture must make the same rows: the same seq_len and the same
    tokenizer (the same ids for the same text). The first one that differs from the first
    dataset is named."""
    first = datasets[0]
    ref, ref_vocab = first.manifest, None
    for d in datasets[1:]:
        m = d.manifest
        if m.seq_len != ref.seq_len:
            raise ConfigError(
                f"{d.where} = {m.location.uri} has seq_len {m.seq_len}, but {first.where} = "
                f"{ref.location.uri} has {ref.seq_len}: the datasets of a mixture must share it; "
                f"prepare it again with --seq-len {ref.seq_len}"
            )
        ref_vocab = ref_vocab if ref_vocab is not None else ref.tokenizer().vocab()
        if m.vocab_size != ref.vocab_size or m.tokenizer().vocab() != ref_vocab:
            raise ConfigError(
                f"{d.where} = {m.location.uri} was tokenized with another tokenizer than {first.where} "
                f"= {ref.location.uri} ({m.vocab_size} against {ref.vocab_size} tokens, or other ids): "
                f"the datasets of a mixture must share it; prepare it again with --tokenizer "
                f"{ref.location.join('tokenizer.json').uri if ref.raw['tokenizer'].get('file') else 'byte'}"
            )
