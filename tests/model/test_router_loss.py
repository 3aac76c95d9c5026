"""The load-balancing loss of a mixture of experts in the training loss (pipeline.model.router)."""

from __future__ import annotations

import pytest
import torch
from kits.moe import save_family

from pipeline import config as train_config
from pipeline.model import loading
from pipeline.model.loss import Batch, TokenLoss
from pipeline.model.precision import Precision


def _loss_model(base, *overrides) -> TokenLoss:
    from kits.train import REPO

    cfg = train_config.resolve(REPO / "config" / "train", "config",
                               [f"model.path={base}", "tokens.train_cache=/t", "lora.dropout=0", *overrides])
    torch.manual_seed(0)
    return TokenLoss(loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu")))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("router") / "qwen3_moe"
    save_family("qwen3_moe", path)
    return path


def _batch(vocab: int) -> tuple[Batch, torch.Tensor]:
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt: not supervised
    index = torch.nonzero(labels[:, 1:].reshape(2, 11) != -100)
    flat = index[:, 0] * 12 + index[:, 1]
    return Batch({"input_ids": ids}, flat, labels[:, 1:][labels[:, 1:] != -100], tokens=24), labels


def test_training_loss_is_the_models_own_loss_with_its_load_balancing_term(base):
    """One micro-batch: our summed loss / supervised tokens == the model's own `loss` with labels and
    output_router_logits (mean cross-entropy + router_aux_loss_coef x its load-balancing loss)."""
    model = _loss_model(base, "moe.router_aux_loss_coef=0.25").train()
    hf = model.lm.get_base_model()
    assert model.router is not None and model.router.coef == 0.25 and hf.config.output_router_logits
    batch, labels = _batch(hf.config.vocab_size)
    with torch.no_grad():
        ours = model(batch) / batch.supervised
        weighted = model.take_router_sum()
        theirs = hf(input_ids=batch.inputs["input_ids"], labels=labels, output_router_logits=True)
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weighted / batch.supervised, theirs.aux_loss, rtol=1e-6, atol=1e-6)
    assert model.take_router_sum() is None  # taken once
    with torch.no_grad():  # validation (eval mode) is cross-entropy alone
        plain = model.eval()(batch) / batch.supervised
    torch.testing.assert_close(plain, theirs.loss - 0.25 * theirs.aux_loss, rtol=1e-6, atol=1e-6)


def test_moe_router_aux_loss_false_trains_on_cross_entropy_alone(base):
    model = _loss_model(base, "moe.router_aux_loss=false").train()
    assert model.router is None and not model.lm.get_base_model().config.output_router_logits
    batch, _ = _batch(model.lm.get_base_model().config.vocab_size)
    model(batch)
    assert model.take_router_sum() is None


def test_a_decoder_that_returns_no_router_logits_trains_on_cross_entropy_alone(base, monkeypatch):
    """Transformers 5.17's Granite MoE families (Granite 4 among them) and DBRX declare no recorder of router
    logits, so their outputs carry none and their own loss adds a load-balancing term of 0; training crashed
    here ('int' object has no attribute 'float'). The same decoder is made here by taking Qwen3-MoE's recorder
    away: the plan says there is no router loss, and training runs on cross-entropy alone."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    from pipeline.model import router

    recorders = {k: v for k, v in qwen3_moe.Qwen3MoePreTrainedModel._can_record_outputs.items() if k != "router_logits"}
    monkeypatch.setattr(qwen3_moe.Qwen3MoePreTrainedModel, "_can_record_outputs", recorders)
    model = _loss_model(base).train()
    hf = model.lm.get_base_model()
    assert model.router is None
    assert router.describe(hf, train_config.MoeConfig()).startswith("router loss: none: Qwen3MoeForCausalLM in "
                                                                     "transformers")
    batch, labels = _batch(hf.config.vocab_size)
    with torch.no_grad():
        ours = model(batch) / batch.supervised
        theirs = hf(input_ids=batch.inputs["input_ids"], labels=labels, output_router_logits=False)
    assert model.take_router_sum() is None
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-6, atol=1e-6)


def test_a_family_of_experts_configured_dense_trains_on_cross_entropy_alone(tmp_path):
    """Doge defines a load-balancing loss and records router logits from its expert layers, but SmallDoge ships it
    dense (`is_moe=False`): no router exists, and asking for router logits made its own load-balancing function fail
    on the empty tuple in the first update. Dense, it trains on cross-entropy alone (the model's own loss) and the
    plan says nothing of a router."""
    import transformers

    from pipeline.config import MoeConfig
    from pipeline.demo.text import build_tokenizer
    from pipeline.model import router

    tokenizer = build_tokenizer()
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.DogeConfig(**shape)).save_pretrained(tmp_path / "dense")
    tokenizer.save_pretrained(tmp_path / "dense")
    model = _loss_model(tmp_path / "dense").train()
    hf = model.lm.get_base_model()
    assert model.router is None and not hf.config.output_router_logits
    assert router.describe(hf, MoeConfig()) is None
    batch, labels = _batch(hf.config.vocab_size)
    ours = model(batch) / batch.supervised
    ours.backward()
    assert model.take_router_sum() is None
    with torch.no_grad():
        theirs = hf(input_ids=batch.inputs["input_ids"], labels=labels)
    torch.testing.assert_close(ours.detach(), theirs.loss, rtol=1e-6, atol=1e-6)
