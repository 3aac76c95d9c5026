"""The fused paths (pipeline/model/kernels.py) compute what the plain ones do: `lora.fused` (one addmm per
LoRA layer) and `model.fused_loss` (a fused linear cross-entropy kernel, wired here with the torch fallback
that has the kernels' contract: Liger's and cut-cross-entropy's kernels are Triton, CUDA only; the `gpu`
tests compare the real ones). Tolerance: loss and every gradient within 1e-5 of the largest value, fp32."""

from __future__ import annotations

import pytest
import torch
from test_model_loss import _assert_close, _cfg, _grads, _model

from pipeline.data.cache import TokenCache
from pipeline.errors import UserError
from pipeline.model import kernels, loading
from pipeline.model.loss import TokenLoss, collate

REL = 1e-5


def _batch(tiny):
    cache = TokenCache(tiny["train"])
    return collate(cache, [1, 2, 3, 7], loading.pad_token_id(tiny["model"]))


def test_fused_lora_layers_give_the_plain_loss_and_gradients(tiny):
    batch = _batch(tiny)
    plain = _model(tiny)
    fused = _model(tiny, "lora.fused=true")
    assert [n for n, _ in loading.trainable(plain)] == [n for n, _ in loading.trainable(fused)]
    fused_layers = [m for m in fused.modules() if getattr(m.__dict__.get("forward"), "__func__", None)
                    is kernels._fused_forward]
    assert len(fused_layers) == 7 * 2  # the 7 all-linear targets of the tiny model's 2 layers
    a, b = TokenLoss(plain)(batch), TokenLoss(fused)(batch)
    assert abs(float(a) - float(b)) <= REL * abs(float(a))
    _assert_close(_grads(plain, a), _grads(fused, b), rel=REL)


def test_lora_fused_needs_no_dropout(tiny):
    with pytest.raises(UserError, match="lora.fused=true .* needs lora.dropout=0"):
        _cfg(tiny, "lora.fused=true", "lora.dropout=0.1")


@pytest.mark.parametrize("kind", ["liger", "cce"])
def test_a_fused_loss_gets_the_chunked_loss_and_gradients(tiny, monkeypatch, kind):
    """The wiring (which rows, which weight, the sum, the gradients' way back into the adapters) with the
    torch fallback in the kernel's place; a CPU run of the real kernel is refused."""
    batch = _batch(tiny)
    model = _model(tiny)
    with pytest.raises(UserError, match=f"model.fused_loss={kind}"):  # not installed here, or on a CPU
        TokenLoss(model, fused_loss=kind)
    monkeypatch.setitem(kernels.FUSED_LOSSES, kind, kernels.torch_linear_cross_entropy)
    fused = TokenLoss(model, fused_loss=kind)
    assert fused.fused is kernels.torch_linear_cross_entropy
    a, b = TokenLoss(model)(batch), fused(batch)
    assert abs(float(a) - float(b)) <= REL * abs(float(a))
    _assert_close(_grads(model, a), _grads(model, b), rel=REL)


def test_auto_is_the_chunked_loss_on_a_cpu_and_with_an_adapted_head(tiny, monkeypatch):
    model = _model(tiny)
    assert TokenLoss(model, fused_loss="auto").fused is None  # a CPU
    monkeypatch.setitem(kernels.FUSED_LOSSES, "liger", kernels.torch_linear_cross_entropy)
    adapted = _model(tiny, "lora.target_modules=[q_proj,lm_head]")
    assert TokenLoss(adapted, fused_loss="liger").fused is None  # a LoRA layer, not a bare weight


def test_cce_needs_a_half_precision_head(tiny):
    """cut-cross-entropy's backward asserts bf16/fp16 weights (found on an H200: an fp32 head passed the
    forward and failed in the backward); ours refuses it up front, naming the setting, and `auto` skips it."""
    model = _model(tiny)
    with pytest.raises(UserError, match="model.fused_loss=cce: .* needs the output head in bf16 or fp16"):
        TokenLoss(model, fused_loss="cce")
    model.get_output_embeddings().to(torch.bfloat16)
    with pytest.raises(UserError, match="model.fused_loss=cce: cut_cross_entropy is not installed|CUDA only"):
        TokenLoss(model, fused_loss="cce")  # past the dtype: the next refusal on this machine


def test_liger_kernels_need_liger(tiny, monkeypatch):
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="model.liger_kernels=true needs Liger-Kernel"):
        _model(tiny, "model.liger_kernels=true")
