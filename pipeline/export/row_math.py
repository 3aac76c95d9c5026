"""LoRA on a Linear weight the base stores as rows of another tensor: the merge adds each row of the
delta where the base keeps that row.

Sarvam-MoE stores `q_proj`, `k_proj` and `v_proj` as the rows of one
`query_key_value`; Transformers splits it on load and joins it on save. LoRA
adapts the live `q_proj`, so its delta `s * B @ A` (out, in) belongs in rows
of `query_key_value` (in), and the pairs of `k_proj` and `v_proj` in other rows
of the same tensor. `pipeline.model.base_keys.BaseKeys.rows` says which rows
(`StoredRows`); a rotary permutation (Mistral Large 3's `wq`) is the same with
the rows reordered. Pure, as `pipeline.export.lora_math`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes


@dataclass(frozen=True)
class RowPart:
    """One LoRA pair's delta rows `live` added to rows `stored` of a stored tensor."""

    module: str
    a_key: str
    b_key: str
    scaling: float
    live: tuple[int, ...]
    stored: tuple[int, ...]
    magnitude_key: str | None = None  # DoRA: the live module's lora_magnitude_vector (one per live row)


@dataclass(frozen=True)
class StoredRowsTarget:
    """A stored tensor that holds rows of one or more adapted Linear weights."""

    base_key: str
    parts: tuple[RowPart, ...]


def add_part(plan: dict, module: str, pair: Mapping[str, str], placed, adapter_shapes: Mapping[str, tuple],
             base_shapes: Mapping[str, tuple], rank: int, scaling: float, unsplittable: list[str] = (),
             magnitude_key: str | None = None) -> None:
    """Put the LoRA pair of `module` into `plan` (base key -> target) at the rows `placed` (`StoredRows`
    of the live weight); UserError where the shapes do not fit, another kind of target holds the tensor, or
    the module has what the merge cannot split into rows (`unsplittable`: a saved base layer, ...).
    `magnitude_key`: its DoRA magnitude, one per live row (`dora_math.check_magnitude` has checked it)."""
    if unsplittable:
        raise UserError(f"adapter's {module} has {unsplittable[0]}, which the merge cannot split into the rows "
                        f"the base stores it as ({placed[0].key})")
    a, b = tuple(adapter_shapes[pair["A"]]), tuple(adapter_shapes[pair["B"]])
    if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
        raise UserError(f"{module}: lora_A {a} / lora_B {b} disagree with the config's rank {rank}")
    if sum(len(p.live) for p in placed) != b[0]:
        raise UserError(f"{module}: lora_B {b} has {b[0]} rows; the base stores {sum(len(p.live) for p in placed)}")
    for rows in placed:
        shape = tuple(base_shapes[rows.key])
        if len(shape) != 2 or shape[1] != a[1] or max(rows.stored) >= shape[0]:
            raise UserError(f"{module}: the base's {rows.key} {shape} cannot hold its rows (in features {a[1]})")
        part = RowPart(module, pair["A"], pair["B"], scaling, rows.live, rows.stored, magnitude_key)
        held = plan.get(rows.key)
        if held is not None and not isinstance(held, StoredRowsTarget):
            raise UserError(f"base tensor {rows.key} is targeted twice")
        taken = {r for p in held.parts for r in p.stored} if held else set()
        if taken & set(rows.stored):
            raise UserError(f"{module}: rows of {rows.key} already take another module's delta")
        plan[rows.key] = StoredRowsTarget(rows.key, (*held.parts, part) if held else (part,))


def merged(target: StoredRowsTarget, weight: torch.Tensor, adapter: Mapping[str, torch.Tensor],
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`weight` with each part's delta rows added in fp32, cast to `out_dtype` (default: its own), checked finite.

    Under DoRA each of a part's rows is then rescaled to its magnitude over its norm: DoRA's norm is per output
    feature (a row of the live weight, all its inputs), so a row keeps its own factor wherever it is stored."""
    out = weight.to(torch.float32, copy=True)
    for part in target.parts:
        delta = adapter[part.b_key].to(torch.float32) @ adapter[part.a_key].to(torch.float32)
        rows = out[list(part.stored)] + delta[list(part.live)].mul_(part.scaling)
        if part.magnitude_key is not None:
            magnitude = adapter[part.magnitude_key].to(torch.float32)[list(part.live)]
            rows.mul_((magnitude / torch.linalg.norm(rows, dim=1)).unsqueeze(1))
        out[list(part.stored)] = rows
    out_dtype = out_dtype or weight.dtype
    if not dtypes.fits(out, out_dtype):
        raise UserError(f"merging into {target.base_key} gives values that are not finite in {out_dtype}")
    return out.to(out_dtype)
