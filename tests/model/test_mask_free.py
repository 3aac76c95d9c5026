"""Right-padded text batches without their attention mask (`pipeline.model.loss.MASK_FREE_FAMILIES`).

The property: for a causal decoder of a listed family, the loss and every
gradient of a right-padded batch are the same with and without the mask (fp32,
within 1e-6), so dropping it (which lets SDPA take its causal kernel on a GPU)
changes no result beyond the kernels' rounding.
"""

from __future__ import annotations

import pytest
import torch
from kits import lm

from pipeline.data.cache import IGNORE_INDEX
from pipeline.model.loss import MASK_FREE_FAMILIES, TokenLoss, can_drop_mask, collate

VOCAB, PAD = lm.VOCAB, 0


def _model(family: str):
    return lm.model(family, "sdpa", pad=PAD)  # a window shorter than the sequences where the family has one


def _cache():
    """Three records of different lengths (the batch is right-padded), prompt tokens unsupervised."""
    g = torch.Generator().manual_seed(1)
    records = []
    for n in (11, 7, 4):
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[:3] = IGNORE_INDEX
        records.append((ids, labels))
    return records


def _loss_and_grads(model, batch, mask_free: bool):
    model.zero_grad(set_to_none=True)
    loss = TokenLoss(model, mask_free=mask_free)(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(MASK_FREE_FAMILIES))  # every family the list names
def test_mask_free_batch_gives_the_masked_loss_and_gradients(family):
    model = _model(family)
    batch = collate(_cache(), [0, 1, 2], PAD)
    assert "attention_mask" in batch.inputs  # padding present: the masked path is the one compared against
    masked, masked_grads = _loss_and_grads(model, batch, mask_free=False)
    free, free_grads = _loss_and_grads(model, batch, mask_free=True)
    assert torch.allclose(free, masked, rtol=0, atol=1e-6), (family, float(free - masked))
    assert masked_grads.keys() == free_grads.keys() and len(masked_grads) > 10
    worst = max(float((free_grads[n] - g).abs().max()) for n, g in masked_grads.items())
    assert worst <= 1e-6, (family, worst)


def test_mask_free_sends_no_mask_and_a_masked_model_keeps_it():
    model = _model("llama")
    batch = collate(_cache(), [0, 1, 2], PAD)
    default, masked = TokenLoss(model), TokenLoss(model, mask_free=False)  # llama: mask-free by default
    seen = []
    model.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("attention_mask" in kwargs),
                                          with_kwargs=True)
    default(batch)
    masked(batch)
    assert seen == [False, True]


def test_which_families_drop_the_mask():
    import transformers as tf

    assert {"llama", "mistral", "qwen2"} <= MASK_FREE_FAMILIES
    assert can_drop_mask(_model("llama"))
    # A family not checked keeps its mask (Bloom's ALiBi reads positions from it), and so does a
    # vision-language model (Qwen2-VL's rope positions come from the mask).
    assert not can_drop_mask(type("M", (), {"config": tf.BloomConfig()})())
    assert not can_drop_mask(type("M", (), {"config": tf.Qwen2VLConfig()})())
