"""The attention masks of packed rows, for the families whose model does not build them from the position ids.

A packed row (`pipeline.model.batch`, layout "rows") keeps its records apart by
its position ids alone: transformers' mask builders (`masking_utils.
create_causal_mask` and its sliding-window twin) find the records where the
positions restart and build a block-causal mask. That needs the model to pass
them the position ids; GPT-OSS does not (transformers 5.17 and 5.24), so its
packed records would attend to each other. For those families the masks are
built here, from the same builders with the position ids, and given to the model
as the mapping (layer type -> mask) its forward takes in place of an attention
mask.
"""

from __future__ import annotations

from pipeline.model.batch import RECORD_BOUNDS

# `config.model_type` of the families whose model builds its masks without the position ids
MASKS_WITHOUT_POSITIONS = frozenset({"gpt_oss"})


def with_row_masks(hf, inputs: dict) -> dict:
    """`inputs` (a micro-batch's, for the transformers model `hf`); for packed rows (position ids, no
    attention mask) of a family of `MASKS_WITHOUT_POSITIONS`, with their block-causal masks, full and
    sliding-window, as the mapping the model takes for `attention_mask`. Otherwise as they are."""
    rows = "position_ids" in inputs and not {"attention_mask", "cu_seq_lens_q", RECORD_BOUNDS} & set(inputs)
    if not rows or getattr(hf.config, "model_type", None) not in MASKS_WITHOUT_POSITIONS:
        return inputs  # padded (its mask given), flat (the varlen kernel's boundaries given), or another family
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    positions = inputs["position_ids"]
    dtype = hf.get_input_embeddings().weight.dtype  # a mask's fill value is that dtype's lowest
    # config, inputs_embeds (read for its shape, dtype and device), attention mask, cache: positional, as the
    # cache's keyword is `past_key_values` at transformers 5.17 and `cache` at 5.24
    args = (hf.config, positions.new_empty((*positions.shape, 0), dtype=dtype), None, None)
    masks = {"full_attention": create_causal_mask(*args, position_ids=positions),
             "sliding_attention": create_sliding_window_causal_mask(*args, position_ids=positions)}
    return {**inputs, "attention_mask": masks}
