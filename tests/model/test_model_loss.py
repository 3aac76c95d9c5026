"""The chunked loss equals the full-vocabulary loss it replaced, gradients included; packing and
activation checkpointing change nothing the model computes."""

from __future__ import annotations

import pytest
import torch

from pipeline import config as train_config
from pipeline.data.cache import TokenCache
from pipeline.model import loading, memory
from pipeline.model.loss import TokenLoss, collate, token_loss_sum
from pipeline.model.precision import choose

CONF = "config/train"


def _cfg(tiny, *overrides):
    from kits.train import REPO

    return train_config.resolve(REPO / CONF, "config", [f"model.path={tiny['model']}",
                                                       f"tokens.train_cache={tiny['train']}", *overrides])


def _model(tiny, *overrides, checkpointing=False):
    cfg = _cfg(tiny, *overrides)
    torch.manual_seed(0)
    model = loading.build(cfg, choose("fp32", torch.device("cpu")), torch.device("cpu"),
                           checkpointed=memory.EVERY_LAYER if checkpointing else 0)
    with torch.no_grad():  # a trained-looking adapter: lora_B is zero at init, which would hide its gradient path
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _old_loss(model, cache, indices, pad_id):
    """The loss as the trainer computed it before: full logits, fp32 cross-entropy over every position."""
    items = [cache[i] for i in indices]
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id)
    labels = torch.full((len(items), width), -100)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for r, (i, lab) in enumerate(items):
        ids[r, :len(i)], labels[r, :len(lab)], mask[r, :len(i)] = i, lab, 1
    return token_loss_sum(model(input_ids=ids, attention_mask=mask).logits, labels)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(a: dict, b: dict, rel: float = 1e-6):
    assert a.keys() == b.keys() and a
    for k in a:
        scale = max(float(a[k].abs().max()), 1e-12)
        assert float((a[k] - b[k]).abs().max()) <= rel * scale, k


@pytest.mark.parametrize("lora", ["default", "full"])
def test_chunked_loss_and_gradients_equal_the_full_vocabulary_loss(tiny, lora):
    model = _model(tiny, f"lora={lora}")
    model.eval()  # no dropout: both forwards must see the same network
    cache, pad = TokenCache(tiny["train"]), loading.pad_token_id(tiny["model"])
    idx = [0, 5, 17, 33, 2, 60]  # different lengths: padding in the batch
    old = _old_loss(model, cache, idx, pad)
    old_grads = _grads(model, old)
    batch = collate(cache, idx, pad)
    assert "attention_mask" in batch.inputs
    new = TokenLoss(model, chunk=6)(batch)  # several chunks, the last one partial
    assert batch.supervised > 6 and batch.supervised % 6
    assert abs(new.item() - old.item()) <= 1e-6 * abs(float(old))
    _assert_close(_grads(model, new), old_grads)


def test_packed_batch_equals_the_padded_batch(tiny):
    # SDPA keeps packed sequences apart through a block-diagonal mask from the position ids:
    # slow, but it checks the packing arithmetic (positions, targets) on a CPU.
    model = _model(tiny).eval()
    cache, pad = TokenCache(tiny["train"]), loading.pad_token_id(tiny["model"])
    idx = [3, 9, 40, 41]
    loss = TokenLoss(model)
    padded, packed = collate(cache, idx, pad), collate(cache, idx, pad, packed=True)
    assert packed.inputs["input_ids"].shape[0] == 1 and "attention_mask" not in packed.inputs
    assert torch.equal(padded.targets, packed.targets) and packed.tokens == padded.tokens
    a, b = loss(padded), loss(packed)
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(a))
    _assert_close(_grads(model, a), _grads(model, b), rel=1e-5)


def test_activation_checkpointing_gives_the_same_gradients(tiny):
    cache, pad = TokenCache(tiny["train"]), loading.pad_token_id(tiny["model"])
    batch = collate(cache, [1, 2, 3, 4], pad)
    grads = {}
    for on in (False, True):
        model = _model(tiny, "lora.dropout=0.1", checkpointing=on).train()  # dropout on: the recompute must replay it
        torch.manual_seed(123)
        grads[on] = _grads(model, TokenLoss(model)(batch))
        assert all(getattr(m, "gradient_checkpointing", on) == on for m in loading.decoder_layers(model))
    assert grads[False].keys() == grads[True].keys()
    for k in grads[False]:
        assert torch.equal(grads[False][k], grads[True][k]), k


def test_a_batch_with_nothing_supervised_still_reaches_every_trained_weight(tiny):
    model = _model(tiny)
    cache, pad = TokenCache(tiny["train"]), loading.pad_token_id(tiny["model"])
    batch = collate(cache, [0], pad)
    empty = type(batch)(batch.inputs, batch.loss_index[:0], batch.targets[:0], batch.tokens)
    loss = TokenLoss(model)(empty)
    assert float(loss) == 0.0
    grads = _grads(model, loss)  # DDP needs a gradient for every trained parameter, even a zero one
    assert grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}


def test_a_model_that_post_processes_its_logits_is_refused(tiny):
    model = _model(tiny)
    hf = model.get_base_model()
    forward = hf.forward

    def scaled(*args, **kwargs):  # as Cohere's logit_scale does after its head: the chunked loss would skip it
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    hf.forward = scaled
    with pytest.raises(ValueError, match="not the LM head applied to the last hidden states"):
        TokenLoss(model)


def test_dora_on_a_weight_with_rows_of_zeros_is_named_where_the_first_logits_are_nan():
    """DoRA divides by the norm of each row of an adapted weight; xLSTM starts its gate projections at 0,
    so DoRA there makes the first logits NaN: the head probe names those layers and the settings, where it
    said the logits were not the head's (max difference nan)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = tf.xLSTMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=4, pad_token_id=0)
    targets = ["fgate_preact", "proj_down"]  # zero rows at init; none
    dora = get_peft_model(tf.AutoModelForCausalLM.from_config(config), LoraConfig(r=2, target_modules=targets,
                                                                                   use_dora=True))
    with pytest.raises(ValueError, match=r"not finite: DoRA \(lora.use_dora\) divides .* "
                                         r"backbone.blocks.0.mlstm_layer.fgate_preact have rows of zeros; leave"):
        TokenLoss(dora)
    torch.manual_seed(0)
    TokenLoss(get_peft_model(tf.AutoModelForCausalLM.from_config(config), LoraConfig(r=2, target_modules=targets)))


def test_the_chunk_loss_is_compiled_on_cuda_only():
    """The selection (no GPU here to run the compiled one): eager `_chunk_loss` itself on a CPU, so the CPU
    path is the one every other test checks; one `torch.compile` of it for every CUDA device."""
    from pipeline.model.loss import _chunk_loss, chunk_loss_for

    assert chunk_loss_for(torch.device("cpu")) is _chunk_loss
    compiled = chunk_loss_for(torch.device("cuda", 0))
    assert compiled is chunk_loss_for(torch.device("cuda", 1))
    assert compiled is not _chunk_loss and compiled._torchdynamo_orig_callable is _chunk_loss


def test_the_compiled_chunk_loss_compiles_one_graph_whatever_the_micro_batch(monkeypatch):
    """The CUDA path's compiled chunk function, compiled here on the CPU with a backend that counts
    graphs: supervised row counts that change with every micro-batch (the last chunk's remainder) give
    one graph, because every chunk is padded to the chunk's row count; loss and gradients are the eager
    path's. Without the padding the same function compiles again for new remainders."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from pipeline.model import loss as loss_module

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(loss_module, "COMPILE_BACKEND", counter)
    loss_module._compiled_chunk_loss.cache_clear()
    try:
        g = torch.Generator().manual_seed(0)
        head = torch.nn.Linear(16, 50, bias=False)
        for rows in (37, 100, 129, 5, 0, 64):  # chunk 64: remainders 37, 36, 1, 5, 0 (one empty chunk), 0
            hidden = torch.randn(rows, 16, generator=g, requires_grad=True)
            targets = torch.randint(0, 50, (rows,), generator=g)
            got = loss_module.linear_cross_entropy_sum(hidden, head, targets, 64, compiled=True)
            got_grads = torch.autograd.grad(got, [hidden, head.weight])
            want = loss_module.linear_cross_entropy_sum(hidden, head, targets, 64, compiled=False)
            want_grads = torch.autograd.grad(want, [hidden, head.weight])
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), rows
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got_grads, want_grads)), rows
        assert counter.frame_count == 1
        # The control: the compiled function on the raw remainders (no padding) compiles again.
        compiled = loss_module._compiled_chunk_loss()
        for rows in (37, 36):
            compiled(head, torch.randn(rows, 16), torch.randint(0, 50, (rows,)))
        assert counter.frame_count > 1
    finally:
        loss_module._compiled_chunk_loss.cache_clear()
        torch._dynamo.reset()


def _post_processing_model(family: str):
    """A tiny random model of a family whose causal LM changes its head's logits, built from the stock
    class with that step set large enough to matter at random init (the shipped values: Gemma 2 caps at
    30, Command R7B scales by 0.0625, Granite 3.3 divides by 16, Falcon-H1-1.5B multiplies by ~0.04)."""
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    configs = {
        "gemma2": lambda: tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.05),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**common, head_dim=8, final_logit_softcapping=0.05),
        "cohere2": lambda: tf.Cohere2Config(**common, logit_scale=8.0),
        "granite": lambda: tf.GraniteConfig(**common, logits_scaling=0.125),
        "falcon_h1": lambda: tf.FalconH1Config(**common, lm_head_multiplier=8.0, mamba_d_ssm=32, mamba_n_heads=4,
                                               mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_expand=1,
                                               mamba_chunk_size=16),
        "vaultgemma": lambda: tf.VaultGemmaConfig(**common, head_dim=8, final_logit_softcapping=0.05),
        "recurrent_gemma": lambda: tf.RecurrentGemmaConfig(
            **{k: v for k, v in common.items() if k != "max_position_embeddings"}, lru_width=32,
            attention_window_size=16, logits_soft_cap=0.05, block_types=["recurrent", "attention"]),
        "xlstm": lambda: tf.xLSTMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4,
                                        pad_token_id=0, output_logit_soft_cap=0.05),
        # hidden states / (hidden_size / dim_model_base) = x 8 before the head
        "minicpm3": lambda: tf.MiniCPM3Config(**common, dim_model_base=256, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                              v_head_dim=8, kv_lora_rank=16, q_lora_rank=16),
        # its defaults are the shipped sizes (256 experts of 3072, heads of 128: 154M parameters at width 32)
        "inkling_text": lambda: tf.InklingTextConfig(
            **common, logits_mup_width_multiplier=0.125, head_dim=8, swa_num_attention_heads=4,
            swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=16, rel_extent=16,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    }
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(configs[family]()).float().eval()


def _as_the_stock_loss(model, loss: TokenLoss, ids: torch.Tensor) -> torch.Tensor:
    """Assert that `loss` (a TokenLoss over `model`) on every next token of `ids` equals the stock model's own
    loss with labels, and its gradients the stock loss's (left in `model`'s .grad); return the stock loss."""
    from pipeline.model.batch import Batch

    rows, width = ids.shape
    flat = ids.flatten()
    index = torch.tensor([r * width + i for r in range(rows) for i in range(width - 1)])
    ours = loss(Batch({"input_ids": ids}, index, flat[index + 1], tokens=ids.numel())) / len(index)
    model.zero_grad()
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    theirs = model(input_ids=ids, labels=ids, use_cache=False).loss
    theirs.backward()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-6)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(ours_grads[name], p.grad, rtol=1e-4, atol=1e-6), name
    return theirs


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "cohere2", "granite", "falcon_h1", "vaultgemma",
                                    "recurrent_gemma", "xlstm", "minicpm3", "inkling_text"])
def test_the_loss_takes_the_step_a_family_takes_after_its_head(family):
    """Soft-capping (Gemma 2, Gemma 3 where set, VaultGemma, RecurrentGemma, xLSTM) and logit scaling (Cohere, Granite,
    Falcon-H1; MiniCPM3 and Inkling scale the hidden states before the head) are the model's: the chunked loss
    equals the stock model's own loss with labels, and so do its gradients."""
    from pipeline.errors import UserError

    model = _post_processing_model(family)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = TokenLoss(model)  # its head probe passes: the logits are the head's, then the family's step
    assert loss.logits, loss.logits
    theirs = _as_the_stock_loss(model, loss, ids)
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state  # xLSTM: no recurrent state kept
    plain = torch.nn.functional.cross_entropy(  # what the loss would be without the step: not the same
        model.get_output_embeddings()(hidden)[:, :-1].flatten(0, 1),
        ids[:, 1:].flatten())
    assert abs(float(plain) - float(theirs)) > 1e-3, (float(plain), float(theirs))
    with pytest.raises(UserError, match="model.fused_loss=liger: .* after the head"):
        TokenLoss(model, fused_loss="liger")


def test_the_loss_takes_the_head_a_family_applies_before_its_output_embedding():
    """ModernBERT-decoder's logits are its output embedding (`decoder`) over its prediction head (`lm_head`: dense,
    activation, norm) over the last hidden states: the head probe passes, and the chunked loss and its gradients
    (the prediction head's among them) equal the stock model's own loss with labels. Refused in the pilot before
    ("not the LM head applied to the last hidden states")."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.ModernBertDecoderConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
        max_position_embeddings=64, pad_token_id=0, local_attention=16)).float().eval()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    _as_the_stock_loss(model, TokenLoss(model), ids)
    assert all(p.grad is not None for p in model.lm_head.parameters())


def test_a_family_not_listed_that_names_a_soft_cap_is_capped():
    """At random init the logits are far below a cap of 30, where the head probe cannot see it: a config of a
    family `logit_map` does not list that sets `final_logit_softcapping` is capped all the same."""
    from transformers import PretrainedConfig

    from pipeline.model.loss import logit_map

    assert logit_map(PretrainedConfig(final_logit_softcapping=30.0)).cap == 30.0
    assert not logit_map(PretrainedConfig())
