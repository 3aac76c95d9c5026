"""A large dataset split into shards, each validated and tokenized by a job of its own.

A dataset file of ``data.shard_mb`` MiB or more (`shard_count`: its bytes on
disk) is read as N shards. Shard k owns the records of blocks k, k + N, k + 2N,
... of `BLOCK` records each (`owns`): every shard gets its share of every part
of the file (no count of the records is needed first), and a record's place in
the file -- its index and line, which every problem names -- is the same as a
single job sees, because each shard reads the whole file and decodes only its
own records (the others are counted, not parsed).

Merging the shards (`interleave`) gives the records back in file order, so the
merged validation report and token cache are what one job writes; duplicates
and split overlaps are found by merging the shards' digests
(`pipeline.data.scan`), not by one process reading every record.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipeline.data import kinds
from pipeline.storage import hub_data

BLOCK = 2048  # records per block (the tokenizer's batch): shard k owns blocks k, k + N, ...
DEFAULT_SHARD_MB = 256  # data.shard_mb: a file this large or larger is split, one shard per this many MiB


def shard_count(path: str | Path, shard_mb: float | None) -> int:
    """Shards of the dataset at `path`: one per `shard_mb` MiB on disk (a directory: its files), at least one;
    one when `shard_mb` is None or 0 (sharding off) or the path does not exist (yet). A hub pin, a glob: its files."""
    path = Path(path)
    if not shard_mb:
        return 1
    try:
        matched = kinds.glob_files(path)
    except kinds.KindError:  # several splits: validation says so
        return 1
    if not (path.exists() or matched):
        return 1
    pinned = hub_data.pinned_files(path)
    if pinned is not None or matched is not None:
        size = sum(p.stat().st_size for p in pinned or matched if p.is_file())
    elif path.is_dir():  # a directory of data files: those (not its images); a save_to_disk one: all
        try:
            files = kinds.shard_files(path) or [p for p in path.rglob("*") if p.is_file()]
        except kinds.KindError:  # several splits: validation says so
            return 1
        size = sum(p.stat().st_size for p in files)
    else:
        size = path.stat().st_size
    return max(1, math.ceil(size / (shard_mb * 2**20)))


def owns(shard: int, shards: int) -> Callable[[int], bool] | None:
    """Whether shard `shard` of `shards` owns the record at an index; None (every record) for one shard."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not one of 0..{shards - 1}")
    if shards == 1:
        return None
    return lambda index: (index // BLOCK) % shards == shard


def owner(index: np.ndarray, shards: int) -> np.ndarray:
    """The shard that owns each record index."""
    return (np.asarray(index) // BLOCK) % shards


def interleave(records: int, shards: int) -> list[tuple[int, int, int]]:
    """The file's `records` as (shard, first index, end index) blocks, in file order: how to put the shards'
    outputs back in order."""
    return [(b % shards, start, min(start + BLOCK, records))
            for b, start in enumerate(range(0, records, BLOCK))]


def parse_shard(text: str) -> tuple[int, int]:
    """'2/4' -> (2, 4): shard 2 of 4 (counted from 0)."""
    shard, sep, shards = text.partition("/")
    try:
        k, n = int(shard), int(shards)
    except ValueError:
        raise ValueError(f"--shard {text!r}: give K/N, shard K of N counted from 0") from None
    if not sep or not 0 <= k < n:
        raise ValueError(f"--shard {text!r}: give K/N with 0 <= K < N")
    return k, n

