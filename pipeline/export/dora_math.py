"""DoRA in a merge (peft `use_dora`): the magnitude vector each adapted layer learns, and the
rescaling W' = m / ||W + s*B@A|| * (W + s*B@A) per output feature that folds it in, as peft's
`merge_and_unload` does. Pure, as `pipeline.export.lora_math`; `target` is its `LoraTarget`.
"""

from __future__ import annotations

from typing import Mapping

import torch

from pipeline.errors import UserError


def check_magnitude(module: str, b_key: str, magnitude_key: str | None, use_dora: bool,
                    adapter_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Under DoRA every LoRA module has its magnitude (`magnitude_key`), one value per output feature (rows
    of its B, `b_key`); without DoRA none has one (peft would ignore it: merging it would change the model)."""
    if use_dora and magnitude_key is None:
        raise UserError(f"adapter config sets use_dora, but module {module} has no lora_magnitude_vector")
    if not use_dora and magnitude_key is not None:
        raise UserError(f"adapter has {magnitude_key}, but its config does not set use_dora")
    if magnitude_key is not None:
        features = adapter_shapes[b_key][0]
        if tuple(adapter_shapes[magnitude_key]) != (features,):
            raise UserError(f"adapter's {magnitude_key} is {tuple(adapter_shapes[magnitude_key])}; "
                            f"({features},) expected (one per output feature of {module})")


def dora_rescale(merged: torch.Tensor, magnitude: torch.Tensor, target) -> None:
    """In place: V (fp32, = W + s*B@A) times m / ||V|| per output feature, as peft's DoRA merge.

    peft (`DoraLinearLayer.get_weight_norm`, `DoraLinearVariant.merge_*`) takes
    the L2 norm of each output feature's weights over the inputs, of the base
    weight plus the scaled delta (the base as loaded, before any merge): dim 1
    of a Linear weight (out, in); a fan_in_fan_out weight (in, out) and an
    Embedding (vocab, dim) hold their output features along dim 1, so the norm
    runs over dim 0 and the factor scales columns. The norm is a constant to
    peft (detached in training); here there is no graph anyway.
    """
    dim = 0 if target.transposed else 1
    factor = magnitude.to(torch.float32) / torch.linalg.norm(merged, dim=dim)
    merged.mul_(factor.unsqueeze(dim))
