"""safetensors files read and written one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once,
so writing a 5 GB shard would cost 5 GB of RAM. A safetensors file is an
8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw bytes back to back; once the dtypes and
shapes are known (they are, from the input's header) the header can be written
first and the tensors streamed after it. `StreamingWriter` does exactly that,
so peak memory is one tensor, not one file.

Reading uses the library's `safe_open`, one handle per tensor (`read_tensor`):
`get_tensor` returns a view of a memory map of the file, and every page read
through it stays in the process's RSS until both the handle and the tensor are
gone. A handle kept open over a whole shard would grow RSS to the shard's
size; a handle per tensor releases each tensor's pages as soon as it is
dropped. (`read_specs` reads only the header.)
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from pipeline.storage import dtypes

# The reference writer pads the header so the data starts 8-byte aligned.
_ALIGN = 8


class TensorSpec(NamedTuple):
    """What the header says about one tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def read_specs(path: Path) -> list[TensorSpec]:
    """Name, dtype and shape of every tensor in a file, in name order; reads only the header."""
    specs = []
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            view = handle.get_slice(name)
            specs.append(TensorSpec(name, dtypes.from_safetensors(view.get_dtype()), tuple(view.get_shape())))
    return specs


def read_metadata(path: Path) -> dict[str, str] | None:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a file, through a handle of its own (see the module docstring).

    The result may be backed by the file's memory map: treat it as read-only.
    """
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


class StreamingWriter:
    """Writes one safetensors file whose layout is fixed up front by `specs`.

    Contract: `write` must be called once per spec, in spec order, with a tensor
    of exactly that dtype and shape; `close` refuses a file with tensors
    missing. Use as a context manager; on an exception the partial file is
    deleted so a reader never sees a truncated file.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":  # the format is little-endian; we dump raw memory
            raise RuntimeError("StreamingWriter needs a little-endian machine")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in one safetensors file")
        self.path = Path(path)
        self._specs = list(specs)
        self._next = 0
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for spec in self._specs:
            end = offset + spec.nbytes
            header[spec.name] = {
                "dtype": dtypes.to_safetensors(spec.dtype),
                "shape": list(spec.shape),
                "data_offsets": [offset, end],
            }
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(len(raw) + 8) % _ALIGN)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise ValueError(f"{self.path.name}: unexpected extra tensor {name!r}")
        spec = self._specs[self._next]
        if name != spec.name:
            raise ValueError(f"{self.path.name}: expected tensor {spec.name!r} next, got {name!r}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{self.path.name}: {name} is {tensor.dtype}{tuple(tensor.shape)}, "
                f"header says {spec.dtype}{spec.shape}"
            )
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            # A byte view of the tensor's own memory: no copy beyond `contiguous`.
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._next != len(self._specs):
            missing = [spec.name for spec in self._specs[self._next:]]
            self.path.unlink(missing_ok=True)
            raise ValueError(f"{self.path.name}: {len(missing)} tensor(s) never written, e.g. {missing[0]!r}")

    def abort(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
