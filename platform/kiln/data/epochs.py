"""Which rows make each epoch, and in which order: one dataset or a weighted mixture, in the
same order every epoch or reshuffled by seed.

The unit of order is the **block**: `row_group_rows` consecutive rows of one shard, which is
one Parquet row group of a streamed prepare. Whatever the order, a replica whose micro-batches
span whole blocks still reads only its own row groups (`kiln.data.order.read_slice`).

The rules (docs/data-order.md says the same):

- A dataset's train blocks come in **passes**; in one pass every block of the dataset comes
  once, so a sample id comes once per pass. Without `data.reshuffle` every pass is the
  manifest's order (the prepare already shuffled each unit's rows and ordered the units by
  seed). With it, pass p of dataset d is drawn from `(seed, d, p)`: the shards are permuted,
  the blocks are shuffled within windows of `WINDOW_SHARDS` consecutive shards of that
  permutation (a reader has at most that many shards of a dataset open at once, and no array
  of the whole dataset's rows is ever built), and each block's rows are permuted.
- An **epoch** is as many blocks as all the datasets hold together. Dataset d gives `quota[d]`
  of them (its weight's share, largest remainders), taken on from where its previous epoch
  stopped in its stream of passes: a dataset weighted below its size is covered over several
  epochs, one weighted above it makes more than one pass per epoch. Which dataset each of the
  epoch's blocks comes from is a seeded permutation of the quotas (drawn from `(seed, epoch)`
  with `data.reshuffle`, the same every epoch without), so any stretch of training sees the
  weights up to sampling error.
- One dataset without reshuffle is exactly the manifest's order, every epoch.

Everything is a function of (manifests, weights, seed, epoch): a resume computes the epoch it
stopped in and goes on at the exact micro-batch, whatever happened before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WINDOW_SHARDS = 16  # shards whose blocks are shuffled together: mixing across 16 units' rows,
# while a reader's cache of shard footers (kiln.data.order) holds every shard it has open
_MIX, _PASS = 1, 0  # seed domains: the mixture's label order, a dataset's pass order


@dataclass(frozen=True)
class Blocks:
    """One dataset's blocks of a split, in manifest order (arrays over the blocks)."""

    shard: np.ndarray
    start: np.ndarray  # first row within its shard
    size: np.ndarray
    shards: int

    @classmethod
    def of(cls, shard_rows: list[int], block_rows: int) -> Blocks:
        shard, start, size = [], [], []
        for s, rows in enumerate(shard_rows):
            firsts = np.arange(0, rows, block_rows, dtype=np.int64)
            shard.append(np.full(len(firsts), s, dtype=np.int64))
            start.append(firsts)
            size.append(np.minimum(block_rows, rows - firsts))
        return cls(_cat(shard), _cat(start), _cat(size), len(shard_rows))

    def __len__(self) -> int:
        return len(self.size)


@dataclass(frozen=True)
class Layout:
    """An epoch: its blocks in order (arrays over them). `key` seeds the permutation of a
    block's rows; `shuffled` says whether they are permuted at all."""

    source: np.ndarray
    shard: np.ndarray
    start: np.ndarray
    size: np.ndarray
    key: np.ndarray
    shuffled: bool

    @property
    def rows(self) -> int:
        return int(self.size.sum())

    def rows_at(self, part: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """The shard row at `offset` of each given block."""
        if not self.shuffled:
            return self.start[part] + offset
        return self.start[part] + _within_block(self.key, self.size, part, offset)

    def rows_by_source(self, positions: int, sources: int) -> np.ndarray:
        """How many of the epoch's first `positions` rows come from each dataset."""
        cum = np.concatenate([[0], np.cumsum(self.size)])
        full = int(np.searchsorted(cum, positions, side="right")) - 1
        counts = np.bincount(self.source[:full], weights=self.size[:full], minlength=sources)
        if full < len(self.size):
            counts[self.source[full]] += positions - cum[full]
        return counts.astype(np.int64)


class EpochOrder:
    """The epochs of one split of a run's data (see the module's rules). `weights` None: each
    dataset once, in order (a validation split)."""

    def __init__(self, blocks: list[Blocks], weights: list[float] | None, seed: int, reshuffle: bool):
        self.blocks, self.seed, self.reshuffle = blocks, seed, reshuffle
        sizes = [len(b) for b in blocks]
        self.quota = sizes if weights is None else quotas(weights, sum(sizes))
        self.concatenated = weights is None
        self._passes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._layouts: dict[int, Layout] = {}

    def layout(self, epoch: int) -> Layout:
        if epoch not in self._layouts:
            if len(self._layouts) >= 4:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[epoch] = self._build(epoch)
        return self._layouts[epoch]

    def _build(self, epoch: int) -> Layout:
        labels = np.repeat(np.arange(len(self.blocks)), self.quota)
        if not self.concatenated and len(self.blocks) > 1:
            np.random.default_rng([self.seed, _MIX, epoch if self.reshuffle else 0]).shuffle(labels)
        n = len(labels)
        out = {f: np.zeros(n, dtype=np.int64) for f in ("shard", "start", "size")}
        key = np.zeros(n, dtype=np.uint64)
        for d, b in enumerate(self.blocks):
            picked, keys = self._stream(d, epoch * self.quota[d], self.quota[d])
            at = labels == d
            out["shard"][at], out["start"][at], out["size"][at] = b.shard[picked], b.start[picked], b.size[picked]
            key[at] = keys
        return Layout(labels.astype(np.int64), out["shard"], out["start"], out["size"], key, self.reshuffle)

    def _stream(self, d: int, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Blocks `first`..`first + count` of dataset d's stream of passes, with their row keys."""
        g = len(self.blocks[d])
        if count == 0 or g == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64)
        pos = np.arange(first, first + count, dtype=np.int64)
        passes, index = pos // g, pos % g
        picked, keys = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.uint64)
        for p in np.unique(passes):
            order, pass_keys = self._pass(d, int(p))
            at = passes == p
            picked[at], keys[at] = order[index[at]], pass_keys[index[at]]
        return picked, keys

    def _pass(self, d: int, p: int) -> tuple[np.ndarray, np.ndarray]:
        """Pass p of dataset d: its blocks in order, and a key per block for its rows' order."""
        if (d, p) in self._passes:
            return self._passes[(d, p)]
        b = self.blocks[d]
        if not self.reshuffle:
            result = np.arange(len(b)), np.zeros(len(b), dtype=np.uint64)
        else:
            rng = np.random.default_rng([self.seed, _PASS, d, p])
            place = np.argsort(rng.permutation(b.shards))  # each shard's place in the pass
            window = place[b.shard] // WINDOW_SHARDS
            order = np.lexsort((rng.random(len(b)), window))
            result = order, rng.integers(0, 2**63, size=len(b), dtype=np.uint64)[order]
        if len(self._passes) >= 2 * len(self.blocks) + 2:
            self._passes.pop(next(iter(self._passes)))
        self._passes[(d, p)] = result
        return result


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def quotas(weights: list[float], total: int) -> list[int]:
    """`total` blocks shared by weight, largest remainders first (ties to the earlier dataset);
    every dataset with a weight gets at least one."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    share = np.maximum(np.floor(exact).astype(np.int64), 1)
    for i in np.argsort(-(exact - np.floor(exact)), kind="stable")[: max(0, total - int(share.sum()))]:
        share[i] += 1
    return [int(x) for x in share]


def _within_block(key: np.ndarray, size: np.ndarray, part: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The row at `offset` of each block's permutation (a block's order: its rows sorted by a
    hash of the block's key and the row, so any block's order is computed without the others)."""
    touched, back = np.unique(part, return_inverse=True)
    n = size[touched]
    base = np.concatenate([[0], np.cumsum(n)])
    owner = np.repeat(np.arange(len(touched)), n)
    row = np.arange(int(base[-1])) - base[owner]
    h = _mix64(key[touched][owner] + row.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    perm = row[np.lexsort((h, owner))]
    return perm[base[back] + offset]


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, on arrays (uint64 arithmetic wraps, as the algorithm wants)."""
    x = x.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
