"""Mixed precision: which autocast dtype, and whether a GradScaler is needed.

`auto` picks bf16 autocast on GPUs that support it, fp16 autocast with a
GradScaler on older GPUs, and plain fp32 on CPU (bf16 autocast on CPUs is
about 10x slower than fp32 there). On a CPU, `bf16` and `fp16` are honoured
when asked for explicitly: slow, but the same code paths as on a GPU (autocast,
the GradScaler and its skipped updates), which is what lets CI test them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" | "bf16" | "fp16"
    device_type: str
    init_scale: float = 2.0**16  # the GradScaler's first scale (fp16 only)

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.name == "fp32" else dtypes.BY_NAME[self.name]

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scaler(self) -> torch.amp.GradScaler:
        # A disabled scaler is a no-op with an empty state_dict, so the loop has one code path.
        return torch.amp.GradScaler(self.device_type, init_scale=self.init_scale, enabled=self.needs_scaler)


def choose(mode: str, device: torch.device, *, init_scale: float = 2.0**16) -> Precision:
    """Resolve `precision.mode` for this device: `auto` is fp32 on a CPU, explicit half precision is honoured."""
    if device.type != "cuda":
        if mode == "auto":
            mode = "fp32"
        return Precision(mode, device.type, init_scale)
    if mode == "auto":
        mode = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if mode == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError("precision.mode=bf16 but this GPU does not support bf16; use auto or fp16")
    return Precision(mode, "cuda", init_scale)


def use_tf32(device: torch.device, enabled: bool) -> None:
    """Let fp32 matmuls and convolutions on CUDA use TF32 tensor cores (`precision.tf32`), or not.

    Process-wide (PyTorch's own defaults: full fp32 matmuls, TF32 convolutions); nothing to do
    on a CPU. Through the long-standing API: once the newer `torch.backends.*.fp32_precision`
    is set, `torch.get_float32_matmul_precision()` (which other libraries call) raises.
    """
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def weights_dtype(name: str, precision: Precision) -> torch.dtype:
    """dtype to load the base weights in (`model.dtype`)."""
    if name == "auto":
        # Under autocast the frozen base can live in the compute dtype (half the
        # memory); on CPU everything stays fp32.
        return precision.dtype or torch.float32
    return dtypes.BY_NAME[name]
