"""SDPA record by record: how packed micro-batches keep their records apart on a CPU.

A packed micro-batch in one flat row (`pipeline.model.batch`, layout "records")
holds several records back to back, their boundaries given as plain ints
(`RECORD_BOUNDS`, computed by the collator: nothing is read back from a tensor). Under SDPA with the block-causal mask
transformers builds from the position ids, the CPU kernel computes every
(query, key) pair of a row and masks those across records; run record by record
with its causal kernel, it computes only each record's lower triangle, and the
flat row needs no padding and no mask at all (about 1.5x the tokens/s of a
forward + backward at rows of 511 tokens holding two records each, demo
architecture, one CPU thread). On a GPU flash-attention's varlen kernel does
the same in one call (`pipeline.planning.packing`); there a loop of small
kernels per record would not pay.

`use(model)` switches a transformers model to `NAME`, registered with
transformers' `AttentionInterface`. No mask function is registered for it, so
transformers builds no mask at all for that model: a flat packed batch is kept
apart by its boundaries, and any other batch runs causally without a mask.
That is exact only for a right-padded text decoder whose mask only hides keys
and whose positions do not depend on it (`pipeline.model.loss.can_drop_mask`:
its padding is never a loss position), and without a sliding window narrower
than its records: `runs_per_record` says which models qualify, and only those
are switched (in the training process only: evaluation jobs load the model as
configured).
"""

from __future__ import annotations

import torch

from pipeline.model.batch import RECORD_BOUNDS
from pipeline.model.loss import MASK_FREE_FAMILIES

NAME = "sft_sdpa_per_record"


def runs_per_record(config, longest: int) -> bool:
    """Can a text model of `config` (a transformers config) attend record by record without any mask,
    its records at most `longest` tokens? A mask-free family (`MASK_FREE_FAMILIES`) whose sliding
    window, if any, covers every record (then it equals the causal mask)."""
    if getattr(config, "model_type", None) not in MASK_FREE_FAMILIES:  # text decoders only (packing is)
        return False
    window = getattr(config, "sliding_window", None)
    used = getattr(config, "use_sliding_window", True)  # Qwen2/3 keep a window in the config, unused by default
    return window is None or not used or window >= longest


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, per record when the batch gives its boundaries (one flat row:
    query (1, heads, tokens, dim)); as is otherwise. Output as transformers' (batch, tokens, heads, dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    edges = kwargs.pop(RECORD_BOUNDS, None)
    if edges is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    parts = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, is_causal=True,
                                    **kwargs)[0] for s, e in zip(edges, edges[1:])]
    return torch.cat(parts, dim=1), None


def use(model) -> None:
    """Switch the transformers `model` (not a peft wrapper) to attend record by record (`NAME`).
    RuntimeError if the model cannot switch implementations (its family does not use transformers'
    attention interface)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise RuntimeError(f"{type(model).__name__} cannot switch its attention implementation to {NAME}")
