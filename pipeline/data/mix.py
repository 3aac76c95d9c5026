"""Several training datasets mixed into one deterministic sample order.

The run reads its samples in *mixed epochs*. A mixed epoch holds `count_i`
records of dataset i (`epoch_counts`):

* ``records: N``: exactly N (fewer than the dataset holds: a cut; more: repeats);
* ``weight: w``: the weighted datasets share as many records as they hold
  together, R = sum of their sizes, in proportion to their weights:
  w_i / sum(w) * R, rounded by largest remainder (every share rounded down, then
  one more record to the largest fractional parts, ties to the earlier dataset),
  so the shares sum to R exactly (0.7 / 0.3 of 48 + 48 records: 67 + 29);
* neither: the whole dataset, once (several such datasets: a plain concatenation).

Which records: dataset i is an endless stream of its own seeded permutations
(its epoch 0, 1, ...); mixed epoch e takes the stream's items
[e * count_i, (e + 1) * count_i). A dataset cut to fewer records than it holds
shows other records in the next mixed epoch (every one within ceil(n / count)
epochs); one drawn more often than its size repeats each record evenly.
Where: each mixed epoch's slots are a seeded shuffle of the datasets' counts.

So the run's g-th sample (update g // global_batch) is a pure function of
(seed, datasets, sizes, g), like the single-dataset sampler: a chunked run, a
resumed one and one long run read the same samples, and the mix spans the
whole run. Duplicates across datasets are allowed (each dataset is validated
on its own); a record in two datasets is drawn as a record of each.

Numpy only: the `plan` job (no torch) computes the counts it shows with the
same code the trainer samples with.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from pipeline.errors import UserError

_MIX_STREAM = 0x6D6978  # the seed stream of the slot shuffles ("mix"), apart from every dataset's


@dataclass(frozen=True)
class Source:
    """One training dataset of a mix: its name, its record count, and its share (weight or records)."""

    name: str
    size: int
    weight: float | None = None
    records: int | None = None


def epoch_counts(sources: list[Source]) -> list[int]:
    """Records of each dataset in one mixed epoch (the module docstring's rules).

    Raises ValueError naming the dataset for an empty one, a weight <= 0,
    records < 1, or both weight and records.
    """
    for s in sources:
        if s.size < 1:
            raise ValueError(f"training dataset {s.name!r} has no records")
        if s.weight is not None and s.records is not None:
            raise ValueError(f"training dataset {s.name!r}: give a weight or records, not both")
        if s.weight is not None and not s.weight > 0:
            raise ValueError(f"training dataset {s.name!r}: weight {s.weight} must be > 0")
        if s.records is not None and s.records < 1:
            raise ValueError(f"training dataset {s.name!r}: records {s.records} must be >= 1")
    counts = [s.records if s.records is not None else s.size for s in sources]
    weighted = [i for i, s in enumerate(sources) if s.weight is not None]
    if weighted:
        total = sum(sources[i].size for i in weighted)
        weights = np.array([sources[i].weight for i in weighted], dtype=np.float64)
        for i, share in zip(weighted, largest_remainder(weights / weights.sum() * total, total)):
            counts[i] = share
    if sum(counts) < 1:
        raise ValueError("the training mix draws no records")
    return counts


def largest_remainder(exact: np.ndarray, total: int) -> list[int]:
    """`exact` (summing to `total`) as integers summing to `total`: floors, then one more to the largest
    fractional parts (a stable sort: ties go to the earlier entry)."""
    floors = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - floors), kind="stable")
    floors[order[:total - int(floors.sum())]] += 1
    return [int(c) for c in floors]


def from_config(entries, sizes: list[int], seed: int) -> Mix:
    """The mix of the trainer's `tokens.mix` entries (name, weight, records) whose caches hold `sizes`
    records: what the plan shows and the trainer samples. A bad share is a `UserError` naming the key."""
    sources = [Source(e.name, size, e.weight, e.records) for e, size in zip(entries, sizes)]
    try:
        return Mix(sources, seed)
    except ValueError as err:
        raise UserError(f"tokens.mix: {err}") from None


class Mix:
    """The run's sample order over several datasets, as indices into their concatenation
    (dataset i's record r is `offsets[i] + r`)."""

    def __init__(self, sources: list[Source], seed: int):
        self.sources = list(sources)
        self.counts = epoch_counts(self.sources)
        self.size = sum(self.counts)  # samples per mixed epoch
        self.offsets = np.concatenate([[0], np.cumsum([s.size for s in self.sources])]).astype(np.int64)
        self.seed = seed % 2**63
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, labels, indices): one kept

    def _labels(self, epoch: int) -> np.ndarray:
        """Which dataset fills each slot of a mixed epoch."""
        labels = np.repeat(np.arange(len(self.sources)), self.counts)
        return np.random.default_rng([self.seed, _MIX_STREAM, epoch]).permutation(labels)

    def _stream(self, i: int, items: np.ndarray) -> np.ndarray:
        """Records at positions `items` of dataset i's stream of permutations."""
        source = self.sources[i]
        laps, at = np.divmod(items, source.size)
        out = np.empty_like(items)
        key = zlib.crc32(source.name.encode())  # by name: a dataset's stream survives reordering the list
        for lap in np.unique(laps):
            perm = np.random.default_rng([self.seed, key, int(lap)]).permutation(source.size)
            where = laps == lap
            out[where] = perm[at[where]]
        return out

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset of each slot, concatenated index of each slot) of one mixed epoch."""
        if self._epoch is None or self._epoch[0] != epoch:
            labels = self._labels(epoch)
            indices = np.empty(self.size, dtype=np.int64)
            for i, count in enumerate(self.counts):
                slots = np.flatnonzero(labels == i)
                items = epoch * count + np.arange(count, dtype=np.int64)
                indices[slots] = self.offsets[i] + self._stream(i, items)
            self._epoch = (epoch, labels, indices)
        return self._epoch[1], self._epoch[2]

    def indices(self, start: int, stop: int) -> list[int]:
        """Concatenated indices of the run's samples [start, stop)."""
        out: list[int] = []
        while start < stop:
            epoch, at = divmod(start, self.size)
            take = min(stop - start, self.size - at)
            out += self.epoch(epoch)[1][at:at + take].tolist()
            start += take
        return out

    def drawn(self, samples: int) -> list[int]:
        """Samples of each dataset among the run's first `samples`."""
        full, rest = divmod(samples, self.size)
        partial = np.bincount(self._labels(full)[:rest], minlength=len(self.sources))
        return [full * c + int(p) for c, p in zip(self.counts, partial)]

    def table(self, samples: int) -> list[dict]:
        """Per dataset, what the plan shows: records, weight / records asked, per mixed epoch, drawn in the run."""
        return [{"name": s.name, "records": s.size, "weight": s.weight, "records_asked": s.records,
                 "per_epoch": count, "drawn": drawn}
                for s, count, drawn in zip(self.sources, self.counts, self.drawn(samples))]


class ConcatCache:
    """Several token caches read as one (record `offsets[i] + r` is cache i's record r): what the
    trainer's collator and sampler see in a mixed run. Same interface as `TokenCache`."""

    def __init__(self, caches: list):
        self.caches = list(caches)
        self.offsets = np.concatenate([[0], np.cumsum([len(c) for c in self.caches])]).astype(np.int64)
        self.path = ", ".join(str(c.path) for c in self.caches)  # what error messages name

    def _locate(self, i: int) -> tuple[object, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} out of range for {len(self)} records of {self.path}")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.caches[k], i - int(self.offsets[k])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int):
        cache, r = self._locate(int(i))
        return cache[r]

    def images(self, i: int) -> list[str]:
        cache, r = self._locate(int(i))
        return cache.images(r)

    @property
    def has_images(self) -> bool:
        return any(c.has_images for c in self.caches)

    @property
    def image_counts(self) -> np.ndarray:
        return np.concatenate([c.image_counts for c in self.caches])

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([c.lengths for c in self.caches])

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.caches)

    def supervised_counts(self) -> np.ndarray:
        return np.concatenate([c.supervised_counts() for c in self.caches])
