"""What validation and tokenization keep while records stream past: batches, and first occurrences by digest.

A dataset file is read record by record (`pipeline.data.formats.stream_file`)
and worked on in batches (`batched`), so memory does not grow with the
records' text. What must be remembered across the whole file -- which id,
which conversation came first, for duplicate and split-overlap checks -- is
kept as fixed-size digests in a `DigestIndex`: 24 bytes a distinct key (a
16-byte BLAKE2b digest and the index of its first record), so 1M records cost
24 MB per index, whatever their length. A 128-bit digest makes a false match
as likely as a hardware fault (about 1e-27 for a million records).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator

import numpy as np

from pipeline.data.formats import Record, conversation_key

DIGEST_BYTES = 16
_KEY = f"S{DIGEST_BYTES}"


def batched(items: Iterable, size: int) -> Iterator[list]:
    """`items` in lists of `size` (the last one shorter)."""
    it = iter(items)
    while batch := list(itertools.islice(it, size)):
        yield batch


def digest(text: str) -> bytes:
    """A 16-byte digest of `text`."""
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def sample_digest(record: Record) -> bytes:
    """Equal for exact duplicates as `formats.duplicate_of` defines them: same messages, same image paths."""
    return digest(conversation_key(record.messages) + "\0" + json.dumps(record.images))


def loose_digest(record: Record) -> bytes:
    """Equal for conversations that match across splits (`conversation_key(loose=True)`), images aside."""
    return digest(conversation_key(record.messages, loose=True))


class DigestIndex:
    """digest -> the value (a record's file index) stored with its first occurrence, in O(distinct keys x 24 B).

    Kept as sorted runs of numpy arrays, merged like a binary counter (a run
    is merged into the one before it once it is as large), so adding N keys
    costs O(N log N) and a lookup one binary search per run (O(log N) runs).
    """

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []

    def __len__(self) -> int:
        return sum(keys.size for keys, _ in self._runs)

    def first(self, keys: list[bytes], values: list[int], *, add: bool = True) -> list[int | None]:
        """For each key, the value of its earliest occurrence (an earlier call's, or earlier in this list),
        None where this is the first; the first occurrences are then added with their values. With
        ``add=False`` only earlier calls' keys count, and nothing is added."""
        if not keys:
            return []
        batch = np.array(keys, dtype=_KEY)
        vals = np.asarray(values, dtype=np.int64)
        found = np.full(batch.size, -1, dtype=np.int64)
        for run_keys, run_values in self._runs:
            at = np.minimum(np.searchsorted(run_keys, batch), run_keys.size - 1)
            hit = run_keys[at] == batch
            found[hit] = run_values[at[hit]]
        if not add:  # a lookup only: earlier in this list does not count
            return [None if v < 0 else int(v) for v in found]
        unique, first_at, inverse = np.unique(batch, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        earlier_in_batch = first_at[inverse] != np.arange(batch.size)
        found = np.where((found < 0) & earlier_in_batch, vals[first_at[inverse]], found)
        new = first_at[found[first_at] < 0]
        if new.size:
            self._add(batch[new], vals[new])  # np.unique sorted them
        return [None if v < 0 else int(v) for v in found]

    def _add(self, keys: np.ndarray, values: np.ndarray) -> None:
        self._runs.append((keys, values))
        while len(self._runs) > 1 and self._runs[-1][0].size >= self._runs[-2][0].size:
            (k2, v2), (k1, v1) = self._runs.pop(), self._runs.pop()
            keys, values = np.concatenate([k1, k2]), np.concatenate([v1, v2])
            order = np.argsort(keys, kind="stable")
            self._runs.append((keys[order], values[order]))
