"""Trained token rows (peft `trainable_token_indices`) in a merge: the rows of the embeddings, and
of an untied output head, trained for special tokens the run added.

`base_model.model.<module>.token_adapter.trainable_tokens_delta` holds the
trained VALUES of the rows the adapter config lists for that module (peft
replaces those rows, it does not add to them): they replace the rows of
`<module>.weight`. Rows beyond the base's (a grown vocabulary) must all be
listed: the output then has the grown shape. Pure, as `pipeline.export.lora_math`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes


@dataclass(frozen=True)
class TokenRows:
    """A base embedding / head tensor whose `indices` rows the adapter's trained values replace;
    `rows`: the output's row count (more than the base's when the vocabulary grew)."""

    base_key: str
    adapter_key: str
    indices: tuple[int, ...]
    rows: int


def token_indices(value) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """peft's `trainable_token_indices` (a list, or a dict by module) as ((module or "", rows), ...)."""
    if not value:
        return ()
    if isinstance(value, Mapping):
        return tuple((str(k), tuple(int(i) for i in v)) for k, v in value.items())
    return (("", tuple(int(i) for i in value)),)


def token_rows(key: str, module: str, shape: tuple, base_shapes: Mapping[str, tuple[int, ...]],
               indices: tuple[int, ...] | None, stored_key: Callable[[str], str]) -> TokenRows:
    """The base tensor whose rows the adapter's trained values `key` of `module` replace (`indices`: the
    rows the config lists for the module); UserError when they do not fit it."""
    if indices is None:
        raise UserError(f"adapter has {key}, but its config's trainable_token_indices lists no rows for {module}")
    base_key = stored_key(f"{module}.weight")
    if base_key not in base_shapes:
        raise UserError(f"adapter trains token rows of {module}, but the base stores no tensor {base_key!r}")
    base_shape = tuple(base_shapes[base_key])
    if len(base_shape) != 2 or shape != (len(indices), base_shape[1]):
        raise UserError(f"adapter's {key} is {shape}; {len(indices)} rows of the base's {base_key} {base_shape} "
                        "expected")
    rows = max(base_shape[0], max(indices) + 1)
    untrained = sorted(set(range(base_shape[0], rows)) - set(indices))
    if untrained:
        raise UserError(f"adapter grows {base_key} to {rows} rows but trains none of rows {untrained[:5]}: their "
                        "values are not in the adapter")
    return TokenRows(base_key, key, tuple(indices), rows)


def token_rows_merged(target: TokenRows, base_weight: torch.Tensor, values: torch.Tensor,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`base_weight` (its rows unchanged) grown to `target.rows`, the trained rows set to `values`,
    as peft's forward computes it (`index_copy` of the values; every grown row is among them)."""
    out_dtype = out_dtype or base_weight.dtype
    if not dtypes.fits(values.to(torch.float32), out_dtype):
        raise UserError(f"{target.adapter_key} has values that are not finite in {out_dtype}")
    if base_weight.dtype != out_dtype and not dtypes.fits(base_weight, out_dtype):
        raise UserError(f"{target.base_key}: values that are not finite in {out_dtype}")
    out = torch.empty((target.rows, *base_weight.shape[1:]), dtype=out_dtype)
    out[: base_weight.shape[0]] = base_weight
    out.index_copy_(0, torch.tensor(target.indices), values.to(out_dtype))
    return out
