"""A run on a mixture of two real datasets, read by the real source: the realised shares match
the weights, a resume continues exactly, and datasets that make other rows are refused."""

import itertools
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest

from kiln.config import load_config
from kiln.data.check import resolve_against_data
from kiln.data.mixture import Dataset
from kiln.data.sources import ParquetSource
from kiln.errors import ConfigError

WORLD, MICRO = 2, 4


def _owner(*datasets: Dataset) -> dict[tuple, int]:
    """Every train row's (id, tokens) -> the dataset it is from (the ids of two datasets
    overlap, and so may a row's tokens, such as a licence line)."""
    owner = {}
    for d, ds in enumerate(datasets):
        for _, loc in ds.manifest.shards("train"):
            table = pq.read_table(loc.path)
            for i, row in zip(table.column("id").to_pylist(), table.column("tokens").to_pylist()):
                assert (i, tuple(row)) not in owner
                owner[(i, tuple(row))] = d
    return owner


@pytest.fixture(scope="module")
def mixture(byte_dataset, prose_dataset):
    cfg, datasets = resolve_against_data(
        load_config(None, [f"data.mix=[{{path: {byte_dataset}, weight: 1}}, {{path: {prose_dataset}, weight: 3}}]"])
    )
    assert [d.name for d in datasets] == ["bytes", "prose"] and cfg.data.path == str(byte_dataset)
    return datasets


def _source(datasets, rank, reshuffle=True):
    return ParquetSource(datasets, rank, WORLD, MICRO, seed=7, reshuffle=reshuffle)


def _take(source, skip, n):
    return [(ids.tolist(), rows) for ids, rows in itertools.islice(source.train_samples(skip), n)]


def test_the_realised_mix_follows_the_weights_and_is_what_the_metrics_say(mixture):
    owner = _owner(*mixture)
    per_epoch = _source(mixture, 0).batches_in_epoch(0)
    n = per_epoch + per_epoch // 2  # into the second epoch
    streams = [_take(_source(mixture, r), 0, n) for r in range(WORLD)]
    counts = Counter()
    for j in (per_epoch // 3, per_epoch, n):  # after a third of an epoch, one epoch, and more
        counts = Counter(
            owner[(i, tuple(row.tolist()))] for s in streams for ids, rows in s[:j] for i, row in zip(ids, rows)
        )
        share = counts[1] / sum(counts.values())
        blocks = sum(counts.values()) / 64  # the order's unit: 64 rows at seq_len 64
        assert abs(share - 0.75) < 4 * np.sqrt(0.75 * 0.25 / blocks) + 0.01, (j, share)
        metrics = _source(mixture, 0).data_metrics(j)  # exact, from the order alone
        assert metrics["data/mix/prose_frac"] == pytest.approx(share, abs=1e-12), (j, metrics)
        assert metrics["data/mix/bytes_frac"] == pytest.approx(1 - share, abs=1e-12)
    # Each dataset's rows come once per pass over it. Prose, weighted above its size, makes more
    # than one pass an epoch; code, below it, less than one.
    order = [
        owner[(i, tuple(row.tolist()))] * (1 << 40) + i
        for j in range(per_epoch)
        for s in streams
        for i, row in zip(*s[j])
    ]
    for d, ds in enumerate(mixture):
        ids = [x for x in order if x >> 40 == d]
        rows = ds.manifest.split("train")["rows"]
        first_pass = ids[:rows]
        assert len(set(first_pass)) == len(first_pass), d
        assert (len(ids) > rows) == (d == 1), (d, len(ids), rows)


@pytest.mark.parametrize("reshuffle", [True, False])
def test_a_mixture_resumes_exactly_mid_epoch_and_across_epochs(mixture, reshuffle):
    per_epoch = _source(mixture, 1, reshuffle).batches_in_epoch(0)
    total = per_epoch + 6
    whole = _take(_source(mixture, 1, reshuffle), 0, total)
    for k in (5, per_epoch - 1, per_epoch + 3):
        resumed = _take(_source(mixture, 1, reshuffle), k, total - k)
        assert [ids for ids, _ in resumed] == [ids for ids, _ in whole[k:]], k
        assert all((a == b).all() for (_, a), (_, b) in zip(resumed, whole[k:]))
    if reshuffle:  # the second epoch is another order of rows
        assert [ids for ids, _ in whole[per_epoch : per_epoch + 6]] != [ids for ids, _ in whole[:6]]


def test_one_dataset_reshuffled_covers_every_row_once_per_epoch_in_a_new_order(byte_dataset):
    cfg, datasets = resolve_against_data(load_config(None, [f"data.path={byte_dataset}"]))
    source = ParquetSource(datasets, 0, 1, MICRO, seed=3, reshuffle=True)
    per_epoch = source.batches_in_epoch(0)
    epochs = [list(itertools.chain(*(ids.tolist() for ids, _ in source.epoch("train", 0, e)))) for e in (0, 1)]
    rows = datasets[0].manifest.split("train")["rows"]
    assert len(epochs[0]) == per_epoch * MICRO == rows - rows % MICRO
    assert len(set(epochs[0])) == len(epochs[0]) and len(set(epochs[1])) == len(epochs[1])
    assert epochs[0] != epochs[1] and len(set(epochs[0]) & set(epochs[1])) > 0.99 * len(epochs[0])
    m = datasets[0].manifest
    in_manifest_order = [
        first + i for (e, _), first in zip(m.shards("train"), m.first_ids("train")) for i in range(e["rows"])
    ][: len(epochs[0])]
    fixed = ParquetSource(datasets, 0, 1, MICRO)  # no reshuffle: the manifest's order, every epoch
    assert [list(itertools.chain(*(ids.tolist() for ids, _ in fixed.epoch("train", 0, e)))) for e in (0, 1)] == [
        in_manifest_order
    ] * 2
    assert sorted(epochs[0]) == sorted(in_manifest_order)


def test_datasets_of_another_tokenizer_are_refused_naming_the_one(byte_dataset, tmp_path_factory, corpus):
    from kiln.data.prepare import PrepareConfig, prepare

    bpe = tmp_path_factory.mktemp("data") / "bpe"
    prepare(PrepareConfig(inputs=corpus[:1], output=str(bpe), tokenizer="bpe", vocab_size=300, seq_len=64))
    with pytest.raises(
        ConfigError,
        match=r"data\.mix\[1\] = .*bpe was tokenized with another tokenizer than "
        r"data\.mix\[0\].*--tokenizer byte",
    ):
        resolve_against_data(load_config(None, [f"data.mix=[{{path: {byte_dataset}}}, {{path: {bpe}}}]"]))
