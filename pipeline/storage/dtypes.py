"""Dtype names as the export commands spell them, and what each implies.

Three vocabularies meet here: the short names of the configs and CLIs
(`bf16|fp16|fp32`, plus `auto`), safetensors headers (`BF16`, `F16`, ...) and
Hugging Face `config.json` (`"bfloat16"`). This is the one place that maps
them (training precision, export and verification all read it), so the three
stay in step.
"""

from __future__ import annotations

import torch

from pipeline.errors import UserError

# short name -> torch dtype: precision.mode, model.dtype, --dtype, --compute-dtype
BY_NAME = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CLI_CHOICES = ("auto", *BY_NAME)

# safetensors dtype codes <-> torch dtypes (the subset a checkpoint realistically holds).
_ST_TO_TORCH = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}

# Relative logit tolerance of a merged model stored (or run) in this dtype. Weights
# rounded to the dtype carry a relative error of about its unit roundoff u
# (2^-8 bf16, 2^-11 fp16); the logits of a deep model accumulate a few u, so the
# tolerance is ~10-15 u. fp32 is bounded by summation-order noise instead.
_REL_LOGIT_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def parse_cli(name: str) -> torch.dtype | None:
    """`bf16|fp16|fp32` -> torch dtype; `auto` -> None (keep what is stored)."""
    if name == "auto":
        return None
    try:
        return BY_NAME[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(CLI_CHOICES)}") from None


def from_safetensors(code: str) -> torch.dtype:
    try:
        return _ST_TO_TORCH[code]
    except KeyError:
        raise UserError(f"unsupported safetensors dtype {code!r}") from None


def to_safetensors(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise UserError(f"dtype {dtype} cannot be written to safetensors by this tool") from None


def config_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16', the spelling of config.json's `dtype` field."""
    return str(dtype).removeprefix("torch.")


def output_dtype(stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in: floats follow the request, the rest never change.

    Integer / bool tensors (position ids, masks) must keep their type: casting
    them to a float dtype would corrupt them.
    """
    if requested is None or not stored.is_floating_point:
        return stored
    return requested


def dominant_float(dtypes) -> torch.dtype | None:
    """The floating dtype most tensors use (weighted by element count); None if no floats.

    `dtypes` yields `(dtype, numel)` pairs. Used to label a whole model
    (config.json `dtype`, the verify tolerance) after e.g. norms stayed fp32.
    """
    totals: dict[torch.dtype, int] = {}
    for dtype, numel in dtypes:
        if dtype.is_floating_point:
            totals[dtype] = totals.get(dtype, 0) + numel
    if not totals:
        return None
    return max(totals, key=totals.__getitem__)


def fits(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when every value is finite and within `dtype`'s range, so casting keeps it finite.

    One `aminmax` pass (NaN propagates into it, inf exceeds any limit): several
    times faster than `isfinite(...).all()` on CPU, which mattered in the merge.
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor)
    limit = torch.finfo(dtype).max if dtype.is_floating_point else torch.finfo(tensor.dtype).max
    return bool(low >= -limit) and bool(high <= limit)


def relative_logit_tolerance(*dtypes: torch.dtype) -> float:
    """The loosest relative tolerance among the dtypes involved (storage, compute)."""
    known = [_REL_LOGIT_TOL.get(d, _REL_LOGIT_TOL[torch.bfloat16]) for d in dtypes if d is not None]
    return max(known) if known else _REL_LOGIT_TOL[torch.float32]
