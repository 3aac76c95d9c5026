"""Reading a Hugging Face model's weights straight into FSDP shards: each rank reads only its rows.

Loading the base into every rank before sharding costs one full copy of the
model per rank in host memory (8 ranks x 16 GB for an 8B model). Instead the
FSDP strategy builds an empty skeleton (`pipeline.model.loading.empty_base`),
shards it, and then each rank reads, for every parameter, only the rows of its
own shard (FSDP2 shards dim 0 in `torch.chunk` order) from the safetensors
files. The files are memory-mapped and each tensor's handle closed after use,
so a rank's resident memory holds its shards, and a node reads each byte of the
model about once, whatever the number of ranks.

Parameter names map to checkpoint keys as stored by `save_pretrained`; under
LoRA the adapter's own parameters (already initialized) are skipped and peft's
wrapping (`base_model.model.` prefix, `.base_layer` infix, and for a module
trained in full, `modules_to_save`, the `.original_module` / `.modules_to_save.default`
infixes: both copies start as the base's) is removed. Where the files keep
another layout than the live model's names (Transformers 5 renames the modules
of LLaVA, Qwen2-VL and other vision-language families on load), the name is
mapped back as `save_pretrained` would write it (`pipeline.model.base_keys`).
A model with parameters the files still do not hold (under that key, in that
shape) is loaded whole instead (`pipeline.train.fsdp`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.errors import UserError
from pipeline.model.base_keys import BaseKeys
from pipeline.storage import hf_dir, packed as stored_packed

_PEFT_PREFIX = "base_model.model."
_PEFT_INFIXES = (".base_layer.", ".original_module.", ".modules_to_save.default.")


_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_GLIBC_DEFAULT_MMAP_THRESHOLD = 128 * 1024


def pin_mmap_threshold() -> bool:
    """Keep glibc serving blocks over 128 KiB with mmap, so buffers that FSDP frees leave the resident set.

    glibc raises its mmap threshold (up to 32 MiB) each time it frees a block
    it had mmapped. The skeleton's parameters are such blocks, freed by
    `fully_shard`; without this, every later buffer under that size (a
    layer's all-gathered weights, its gradients) comes from the heap, where
    freed memory stays resident: on 2 CPU ranks of a 222M model, a rank's
    peak was 1.29x the whole-model load's (`bench/results/fsdp_memory.md`),
    against 0.74-0.77x with the pin. Setting the threshold, here to glibc's
    own default, turns the adjustment off. Returns whether it was set: not
    where the C library is not glibc, nor where MALLOC_MMAP_THRESHOLD_ already
    decides.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_MMAP_THRESHOLD))


def checkpoint_key(name: str) -> str:
    """The key a parameter of the (possibly peft-wrapped) model has in the base model's files."""
    name = name.removeprefix(_PEFT_PREFIX)
    for infix in _PEFT_INFIXES:
        name = name.replace(infix, ".")
    return name


class StoredKeys:
    """Parameter name of the (possibly peft-wrapped) live model -> its key in `model_dir`'s weight
    files (`checkpoint_key`, then the base's layout: `BaseKeys`); `specs` the stored tensors."""

    def __init__(self, model_dir: str | Path):
        weights = hf_dir.find_weights(model_dir, "model")
        # a base stored in MXFP4 (GPT-OSS as published) or FP8: each quantized pair one tensor of numbers
        self.packed = stored_packed.packed_if_stored(weights)
        self.specs = self.packed.all_specs if self.packed else weights.all_specs
        self._base = BaseKeys(Path(model_dir), set(self.specs))

    def __call__(self, name: str) -> str:
        key = checkpoint_key(name)
        if key in self.specs:
            return key
        try:
            return self._base(key)
        except UserError:  # an architecture that cannot be built here: no renamings known
            return key

    def holds(self, name: str, shape) -> bool:
        spec = self.specs.get(self(name))
        return spec is not None and tuple(spec.shape) == tuple(shape)


def missing_keys(model, keys: StoredKeys, skip: set[str]) -> list[str]:
    """Parameters (other than `skip`) the weight files do not hold (under their key, in their shape):
    nothing to load them from."""
    return [name for name, p in model.named_parameters() if name not in skip and not keys.holds(name, p.shape)]


@torch.no_grad()
def load_shards(model, model_dir: str | Path, skip: set[str], keys: StoredKeys | None = None) -> int:
    """Fill every parameter but `skip` with this rank's rows of it; returns the bytes read.

    Parameters may be DTensors sharded on dim 0 (FSDP, HSDP) or plain tensors
    (read whole). Persistent buffers that the files hold are read whole.
    """
    weights = hf_dir.find_weights(model_dir, "model")
    where = {spec.name: weights.root / file for file, specs in weights.specs.items() for spec in specs}
    keys = keys or StoredKeys(model_dir)
    read = 0
    for name, param in model.named_parameters():
        if name in skip:
            continue
        local, offset = _local_rows(param)
        if not local.numel():
            continue
        if keys.packed is not None and keys(name) in keys.packed.pairs:  # dequantized, this rank's rows only
            local.copy_(keys.packed.rows(keys(name), offset, offset + local.shape[0]).to(local.dtype))
            read += local.numel() * local.element_size()
        else:
            read += _read_rows(where[keys(name)], keys(name), offset, local)
    for name, buffer in model.named_buffers():
        key = keys(name)
        if key in where:
            read += _read_rows(where[key], key, 0, buffer)
    return read


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of a parameter and the global index of its first row."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, 0
    local, offset = param.to_local(), 0
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise NotImplementedError(f"sharded load of a tensor sharded on dim {placement.dim}")
            chunk = -(-param.shape[0] // param.device_mesh.size(mesh_dim))  # torch.chunk's size
            offset = min(param.device_mesh.get_local_rank(mesh_dim) * chunk, param.shape[0])
    return local, offset


def _read_rows(file: Path, key: str, offset: int, out: torch.Tensor) -> int:
    # One handle per tensor: its memory map (and the pages it touched) go away with it.
    with safe_open(str(file), framework="pt") as f:
        rows = f.get_slice(key)[offset:offset + out.shape[0]] if out.dim() else f.get_tensor(key)
    if tuple(rows.shape) != tuple(out.shape):
        raise ValueError(f"{file}: {key} rows {offset}.. have shape {tuple(rows.shape)}, the model expects "
                         f"{tuple(out.shape)}")
    out.copy_(rows.to(out.dtype))
    return rows.numel() * rows.element_size()
