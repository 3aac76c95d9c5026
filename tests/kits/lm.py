"""Tiny random text decoders of the families the packing and mask-free lists name
(`pipeline.planning.packing.PACKABLE_FAMILIES`, `pipeline.model.loss.MASK_FREE_FAMILIES`), built from the
stock transformers config classes: 2 layers, 32 wide, 4 heads over 2 K/V heads of 8, a 48-token vocabulary.

Each family's own config class, at its defaults but for those sizes; where the class has them, a head size of 8,
a sliding window of `window` tokens (4: shorter than the records the tests use, so a sliding mask is exercised)
and no dropout (a test compares two forwards). GPT-2 names its sizes otherwise; a mixture-of-experts family is
`kits.moe`'s config (4 experts, 2 per token) at this vocabulary.
"""

from __future__ import annotations

import torch

VOCAB = 48
# family -> settings of its own beyond the common ones
_OWN = {"qwen2": {"tie_word_embeddings": True},  # a tied head
        # Gemma 4's per-layer inputs at this vocabulary (at the shipped 262,144 x 256 per layer: 134M parameters)
        "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8}}
_EXPERTS = {"num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}


def config(family: str, *, window: int = 4, pad: int = 0):
    """The config of a tiny `family` model (its `model_type`)."""
    import transformers as tf

    from kits import moe

    if family in moe.FAMILIES:
        return moe.config(family, _Vocabulary(pad))
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=pad)
    if family not in tf.CONFIG_MAPPING:  # a family newer than the installed transformers (the floors env's)
        import pytest

        pytest.skip(f"transformers {tf.__version__} has no model type {family!r}")
    cls = tf.CONFIG_MAPPING[family]
    defaults = cls().to_dict()
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=pad, bos_token_id=1,
                    eos_token_id=2)
    settings.update({k: 0.0 for k in defaults if k.endswith("dropout")})
    if "head_dim" in defaults:
        settings["head_dim"] = 8
    if "sliding_window" in defaults:
        settings["sliding_window"] = window
    # a mixture of experts that `kits.moe` does not build: 4 experts of 16, 2 per token
    settings.update({k: v for k, v in _EXPERTS.items() if k in defaults})
    return cls(**settings, **_OWN.get(family, {}))


class _Vocabulary:
    """What `kits.moe.config` reads of a tokenizer."""

    bos_token_id, eos_token_id = 1, 2

    def __init__(self, pad: int):
        self.pad_token_id = pad

    def __len__(self) -> int:
        return VOCAB


def model(family: str, implementation: str, *, window: int = 4, pad: int = 0):
    """A tiny random `family` model in fp32 with the attention `implementation` (seeded: the same weights each call)."""
    import transformers as tf

    cfg = config(family, window=window, pad=pad)
    cfg._attn_implementation = implementation
    torch.manual_seed(0)
    from pipeline.model.base import auto_class

    return auto_class(cfg).from_config(cfg).float()
