"""The token cache: one safetensors file per split, read back through a memory map.

Layout (all tensors flat, so a split of any size is three arrays):

* ``input_ids`` int32 [T]   -- every record's tokens, back to back
* ``labels``    int32 [T]   -- the token id where it is supervised, -100 elsewhere
* ``offsets``   int64 [N+1] -- record i is ``[offsets[i], offsets[i+1])``

A cache of a vision-language dataset also holds each record's images (the
tokens already hold their expansion into image tokens; pixels are made at batch
time from these files):

* ``image_offsets``      int64 [N+1] -- record i's images are ``[image_offsets[i], image_offsets[i+1])``
* ``image_path_bytes``   uint8 [B]   -- every image path, UTF-8, back to back
* ``image_path_offsets`` int64 [M+1] -- image j's path is ``image_path_bytes[image_path_offsets[j]:...[j+1]]``

A text-only cache has none of the three (its bytes are what they were before
images existed).

The safetensors metadata (string -> string) records what the cache was built
from (source file sha256, tokenizer fingerprint, max_length, ...), so a later
stage can refuse a cache that does not match its inputs.

`CacheWriter` writes a split batch by batch (the tokens spooled to disk, not
held), so tokenizing a dataset of any size takes bounded memory.
`TokenCache` maps the file instead of loading it: opening a multi-GB cache is
instant, and DataLoader workers share the page cache rather than copies.
"""

from __future__ import annotations

import json
import operator
import shutil
import struct
from pathlib import Path

import numpy as np

from pipeline.errors import DataError
from pipeline.storage import publish

FORMAT = "pipeline-token-cache/1"
IGNORE_INDEX = -100  # the label value torch's cross-entropy skips

# tensor name -> (safetensors dtype, numpy dtype)
_TENSORS = {
    "input_ids": ("I32", np.int32),
    "labels": ("I32", np.int32),
    "offsets": ("I64", np.int64),
}
_IMAGE_TENSORS = {
    "image_offsets": ("I64", np.int64),
    "image_path_bytes": ("U8", np.uint8),
    "image_path_offsets": ("I64", np.int64),
}
_ALL_TENSORS = {**_TENSORS, **_IMAGE_TENSORS}
_COUNT_TOKENS = 1 << 24  # labels read at a time by `TokenCache.supervised_counts` (128 MB of running sums)


def write_cache(
    path: str | Path,
    *,
    input_ids: np.ndarray,
    labels: np.ndarray,
    offsets: np.ndarray,
    metadata: dict[str, str],
    images: list[list[str]] | None = None,
) -> None:
    """Write one split atomically (temp file + rename: a crash never leaves half a cache).

    `images`: per record, the paths of its images (written only if any record has one).
    The arrays in hand in one go: `CacheWriter` appends them batch by batch instead.
    """
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != np.asarray(input_ids).size:
        raise ValueError("offsets must start at 0 and end at len(input_ids)")
    if images is not None and any(images) and len(images) != offsets.size - 1:
        raise ValueError("images must list the image paths of every record")
    with CacheWriter(path) as writer:
        writer.append(input_ids, labels, np.diff(offsets), images if images is not None and any(images) else None)
        writer.close(metadata)


class CacheWriter:
    """Write one split's cache incrementally, in bounded memory: `append` batches, then `close(metadata)`.

    The token arrays go to two spool files beside the cache as they come (a
    split of any size never sits in RAM); what stays in memory is 8 bytes of
    length per record (the offsets) and, for a vision-language dataset, the
    image paths. `close` writes the safetensors file -- its header needs every
    tensor's size, so it comes last -- by copying the spools behind the header,
    and renames it into place. The bytes are exactly what
    ``safetensors.numpy.save_file`` writes for the same arrays (tensors by
    dtype size, then name; the header padded to 8 bytes), so a cache does not
    depend on which writer made it. Leaving the ``with`` block without
    `close` (an error) removes the spools and writes nothing.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._spools = {name: open(publish.temp_sibling(self.path, name), "w+b")
                        for name in ("input_ids", "labels")}
        self._lengths: list[np.ndarray] = []
        self._images: list[list[str] | None] = []  # per append: its records' image paths, None if it has none
        self.tokens = 0

    def append(self, input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray,
               images: list[list[str]] | None = None) -> None:
        """Records back to back: their flat ids and labels, tokens per record, and (if any) their image paths."""
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        labels = np.ascontiguousarray(labels, dtype=np.int32)
        lengths = np.asarray(lengths, dtype=np.int64)
        if input_ids.shape != labels.shape or input_ids.ndim != 1:
            raise ValueError("input_ids and labels must be flat arrays of the same length")
        if int(lengths.sum()) != input_ids.size or np.any(lengths < 0):
            raise ValueError("the record lengths must add up to len(input_ids)")
        if images is not None and len(images) != lengths.size:
            raise ValueError("images must list the image paths of every record")
        self._spools["input_ids"].write(input_ids.tobytes())
        self._spools["labels"].write(labels.tobytes())
        self._images.append(images if images is not None and any(images) else None)
        self._lengths.append(lengths)
        self.tokens += input_ids.size

    def close(self, metadata: dict[str, str]) -> None:
        """Write the cache file with `metadata` (plus its format) and rename it into place."""
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        small = {"offsets": offsets}
        if any(chunk is not None for chunk in self._images):
            small.update(_image_tensors([paths for chunk, lengths in zip(self._images, self._lengths)
                                         for paths in (chunk if chunk is not None else [[]] * lengths.size)]))
        sizes = {"input_ids": ("I32", self.tokens, 4), "labels": ("I32", self.tokens, 4)}
        sizes.update({name: (_ALL_TENSORS[name][0], a.size, a.itemsize) for name, a in small.items()})
        # safetensors' order: larger dtypes first, then by name.
        order = sorted(sizes, key=lambda name: (-sizes[name][2], name))
        meta = {"format": FORMAT, **{str(k): str(v) for k, v in metadata.items()}}
        header: dict = {"__metadata__": dict(sorted(meta.items()))}
        start = 0
        for name in order:
            dtype, count, itemsize = sizes[name]
            header[name] = {"dtype": dtype, "shape": [count], "data_offsets": [start, start + count * itemsize]}
            start += count * itemsize
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-len(raw) % 8)
        with publish.staged_file(self.path) as tmp, open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            for name in order:
                if name in small:
                    out.write(small[name].tobytes())
                else:
                    spool = self._spools[name]
                    spool.flush()
                    spool.seek(0)
                    shutil.copyfileobj(spool, out, 1 << 24)
        self._discard()

    def _discard(self) -> None:
        for spool in self._spools.values():
            spool.close()
            Path(spool.name).unlink(missing_ok=True)

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._discard()


def _image_tensors(images: list[list[str]]) -> dict[str, np.ndarray]:
    encoded = [p.encode() for paths in images for p in paths]
    return {
        "image_offsets": np.concatenate([[0], np.cumsum([len(paths) for paths in images])]).astype(np.int64),
        "image_path_bytes": np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(),
        "image_path_offsets": np.concatenate([[0], np.cumsum([len(b) for b in encoded])]).astype(np.int64),
    }


class TokenCache:
    """Random access to the records of one cache file.

    ``cache[i]`` is ``(input_ids, labels)`` as 1-D LongTensors (fresh copies,
    safe to modify). `lengths` is the token count per record, `num_tokens`
    their sum, `metadata` the safetensors metadata; `images(i)` the image
    paths of record i (none in a text-only cache, `has_images` False).
    `records`: the first N records alone (all of them when the file holds
    fewer, or when None); the file is checked whole either way.
    """

    def __init__(self, path: str | Path, records: int | None = None):
        self.path = Path(path)
        self.records = records
        self._open()

    def _open(self) -> None:
        header, data_start = _read_header(self.path)
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        arrays = {}
        wanted = {**_TENSORS, **(_IMAGE_TENSORS if "image_offsets" in header else {})}
        for name, (st_dtype, np_dtype) in wanted.items():
            entry = header.get(name)
            if entry is None or entry.get("dtype") != st_dtype or len(entry.get("shape", ())) != 1:
                raise DataError(f"{self.path}: not a token cache (tensor {name!r} missing or not {st_dtype}[n])")
            (count,) = entry["shape"]
            begin, end = entry["data_offsets"]
            if end - begin != count * np.dtype(np_dtype).itemsize:
                raise DataError(f"{self.path}: tensor {name!r} has inconsistent data offsets")
            if count == 0:
                arrays[name] = np.zeros(0, dtype=np_dtype)  # mmap cannot map zero bytes
            else:
                arrays[name] = np.memmap(self.path, dtype=np_dtype, mode="r", offset=data_start + begin, shape=(count,))
        self._input_ids = arrays["input_ids"]
        self._labels = arrays["labels"]
        # Offsets are small (8 bytes a record) and read on every access: keep them in RAM.
        self._offsets = np.array(arrays["offsets"])
        if (
            self._offsets.size < 1
            or self._offsets[0] != 0
            or self._offsets[-1] != self._input_ids.size
            or self._labels.size != self._input_ids.size
            or np.any(np.diff(self._offsets) < 0)
        ):
            raise DataError(f"{self.path}: corrupt token cache (offsets do not match the token arrays)")
        # Small next to the tokens (a few offsets and a path per image): kept in RAM.
        self._image_offsets = np.array(arrays.get("image_offsets", np.zeros(len(self) + 1, dtype=np.int64)))
        self._path_bytes = bytes(arrays.get("image_path_bytes", np.zeros(0, dtype=np.uint8)))
        self._path_offsets = np.array(arrays.get("image_path_offsets", np.zeros(1, dtype=np.int64)))
        if (self._image_offsets.size != len(self) + 1 or self._image_offsets[-1] != self._path_offsets.size - 1
                or self._path_offsets[-1] != len(self._path_bytes)):
            raise DataError(f"{self.path}: corrupt token cache (image offsets do not match the image paths)")
        if self.records is not None:
            self._offsets = self._offsets[:self.records + 1]
            self._image_offsets = self._image_offsets[:self.records + 1]

    def __len__(self) -> int:
        return self._offsets.size - 1

    def __getitem__(self, i: int):
        import torch

        n = len(self)
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record {i} out of range for a cache of {n} records")
        begin, end = int(self._offsets[i]), int(self._offsets[i + 1])
        ids = torch.from_numpy(self._input_ids[begin:end].astype(np.int64))
        labels = torch.from_numpy(self._labels[begin:end].astype(np.int64))
        return ids, labels

    def images(self, i: int) -> list[str]:
        """Paths of record i's images, in the order of their tokens."""
        begin, end = int(self._image_offsets[i]), int(self._image_offsets[i + 1])
        return [self._path_bytes[self._path_offsets[j]:self._path_offsets[j + 1]].decode() for j in range(begin, end)]

    @property
    def has_images(self) -> bool:
        return bool(self._image_offsets[-1])

    @property
    def image_counts(self) -> np.ndarray:
        """Images per record (int64 array of length ``len(self)``)."""
        return np.diff(self._image_offsets)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per record (int64 array of length ``len(self)``)."""
        return np.diff(self._offsets)

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def supervised_counts(self) -> np.ndarray:
        """Per record, the tokens that carry a loss: positions after its first whose label is set (the loss at
        position j predicts token j from those before it). Read from the stored arrays a slice of records at a
        time (`_COUNT_TOKENS` tokens), never record by record: instant at any size."""
        out = np.zeros(len(self), dtype=np.int64)
        starts, ends = self._offsets[:-1], self._offsets[1:]
        first = 0
        while first < len(self):
            last = int(np.searchsorted(self._offsets, self._offsets[first] + _COUNT_TOKENS, side="right")) - 1
            last = max(last, first + 1)  # at least one record, however long
            lo, hi = int(self._offsets[first]), int(self._offsets[last])
            set_ = np.concatenate([[0], np.cumsum(self._labels[lo:hi] != IGNORE_INDEX, dtype=np.int64)])
            begin = np.minimum(starts[first:last] + 1, ends[first:last]) - lo  # skip each record's first position
            out[first:last] = set_[ends[first:last] - lo] - set_[begin]
            first = last
        return out

    # Pickle by path, so DataLoader workers re-map the file instead of copying arrays.
    def __getstate__(self) -> dict:
        return {"path": self.path, "records": self.records}

    def __setstate__(self, state: dict) -> None:
        self.path, self.records = state["path"], state.get("records")
        self._open()

    def __repr__(self) -> str:
        return f"TokenCache({str(self.path)!r}, records={len(self)}, tokens={self.num_tokens})"


def _read_header(path: Path) -> tuple[dict, int]:
    """The safetensors JSON header and the byte offset where tensor data starts."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise DataError(f"{path}: not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", prefix)
            if size > 100_000_000:
                raise DataError(f"{path}: not a safetensors file (header size {size})")
            raw = f.read(size)
    except OSError as err:
        raise DataError(f"cannot read token cache {path}: {err.strerror}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{path}: not a safetensors file (bad header)") from None
    return header, 8 + size
