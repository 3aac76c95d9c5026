"""Merge math of LoRA on fused expert weights (peft `ParamWrapper`, `target_parameters`), in fp32.

peft adapts a fused weight of E experts with one LoRA pair for all of them:
`lora_A` (r*E, in) holds expert e's A in rows [e*r, (e+1)*r) (blocked), while
`lora_B` (out, r*E) holds expert e's B in columns e, E + e, 2E + e, ...
(interleaved: peft reshapes B to (out, r, E)). Expert e's delta is

    delta_e = s * B[:, :, e] @ A[e]       (out, in)

laid into the weight as (E, out, in), or transposed where the wrapper reads the
weight as (E, in, out) (GPT-OSS's experts, transformers' `is_transposed`; every
fused weight under peft 0.18, which reads them all so), or as a plain (out, in)
weight when E == 1 (a router's 2-D weight). `expert_delta` computes exactly peft's
`ParamWrapper.get_delta_weight` for one expert (tested against it); getting
the two layouts of A and B wrong is the known way to merge grouped experts
wrongly, and it still runs.

The merge adds it to the stored tensors that hold the weight
(`pipeline.model.expert_keys`): the fused tensor itself, expert by expert, or
each per-expert tensor the part transformers' reverse conversion cuts from
that expert's delta (`split`). Pure: inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes


@dataclass(frozen=True)
class FusedWeight:
    """What the merge knows of one ParamWrapper of an adapter (`expert_keys.param_wrappers`) and the
    stored tensors holding its weight (`expert_keys.ExpertLayout.slices`): (key, expert, piece) each."""

    param: str
    experts: int
    layout: str  # "out_in" | "in_out" | "2d"
    shape: tuple[int, ...]
    stored: tuple[tuple[str, int | None, str | None], ...]


@dataclass(frozen=True)
class ExpertTarget:
    """One stored base tensor that holds (part of) a fused weight a ParamWrapper adapts."""

    module: str  # the adapter's module name for the pair
    base_key: str
    param: str
    a_key: str
    b_key: str
    experts: int
    layout: str
    expert: int | None  # None: the stored tensor is the whole fused weight
    piece: str | None  # the part of the expert's slice (`expert_keys.StoredSlice.piece`); None: all of it
    rank: int
    scaling: float


def in_out(fused: FusedWeight) -> tuple[int, int]:
    """(in, out) features of one expert's matrix, as peft's ParamWrapper reads them from the weight's shape."""
    d1, d2 = fused.shape[-2:]
    return (d2, d1) if fused.layout in ("out_in", "2d") else (d1, d2)


def targets(module: str, pair: Mapping[str, str], fused: FusedWeight, adapter_shapes: Mapping[str, tuple],
            rank: int, scaling: float) -> list[ExpertTarget]:
    """The stored tensors a ParamWrapper's LoRA pair modifies; UserError when the pair's shapes do not fit
    peft's layout for the weight (A (r*E, in), B (out, r*E))."""
    a, b = tuple(adapter_shapes[pair["A"]]), tuple(adapter_shapes[pair["B"]])
    fan_in, fan_out = in_out(fused)
    width = rank * fused.experts
    if a != (width, fan_in) or b != (fan_out, width):
        raise UserError(f"{module}: lora_A {a} / lora_B {b} do not fit {fused.param} {fused.shape} ({fused.experts} "
                        f"expert(s) of rank {rank}: A ({width}, {fan_in}), B ({fan_out}, {width}) expected)")
    return [ExpertTarget(module, key, fused.param, pair["A"], pair["B"], fused.experts, fused.layout, expert, piece,
                         rank, scaling) for key, expert, piece in fused.stored]


def expert_delta(a: torch.Tensor, b: torch.Tensor, *, experts: int, expert: int, scaling: float,
                 layout: str) -> torch.Tensor:
    """Expert `expert`'s fp32 delta, as peft's ParamWrapper computes it (module docstring), in the
    weight's layout for one expert: (out, in), or (in, out) for `in_out`."""
    a32 = a.to(torch.float32).reshape(experts, -1, a.shape[-1])[expert]  # (r, in): rows e*r .. e*r + r - 1
    b32 = b.to(torch.float32).reshape(b.shape[0], -1, experts)[:, :, expert]  # (out, r): columns e, E + e, ...
    delta = (b32 @ a32).mul_(scaling)
    return delta.T if layout == "in_out" else delta


Pieces = Callable[[ExpertTarget, Callable[[], torch.Tensor]], Mapping[str, torch.Tensor]]


def merged(target: ExpertTarget, weight: torch.Tensor, adapter: Mapping[str, torch.Tensor],
           out_dtype: torch.dtype | None, pieces: Pieces | None) -> torch.Tensor:
    """The stored tensor `weight` with its part of the delta added in fp32, cast to `out_dtype`
    (default: its own), checked finite. `pieces(target, delta)`: for a per-expert tensor, the delta
    of the target's expert (`delta()`, shape (1, ...)) cut as the base stores it, keyed by piece
    (`expert_keys.ExpertLayout.split`; the caller may keep them for the expert's other pieces)."""
    a, b = adapter[target.a_key], adapter[target.b_key]
    out = weight.to(torch.float32, copy=True)

    def delta(e: int) -> torch.Tensor:
        return expert_delta(a, b, experts=target.experts, expert=e, scaling=target.scaling, layout=target.layout)

    if target.expert is None and target.layout == "2d":
        out += delta(0)
    elif target.expert is None:  # the fused weight itself: expert by expert, one delta in memory at a time
        for e in range(target.experts):
            out[e] += delta(e)
    else:
        if pieces is None:
            raise UserError(f"{target.base_key}: a per-expert tensor of {target.param} needs the base's layout")
        piece = pieces(target, lambda: delta(target.expert).unsqueeze(0))[target.piece]
        if tuple(piece.shape) != tuple(out.shape):
            raise UserError(f"{target.base_key}: its part of the delta is {tuple(piece.shape)}, the tensor "
                            f"{tuple(out.shape)}")
        out += piece
    out_dtype = out_dtype or weight.dtype
    if not dtypes.fits(out, out_dtype):
        raise UserError(f"merging {target.param} into {target.base_key} gives values that are not finite in {out_dtype}")
    return out.to(out_dtype)
