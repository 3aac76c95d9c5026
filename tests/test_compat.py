"""pipeline/compat.py: the calls that differ between the library versions we support, each checked
here on the installed versions and on the other behaviour emulated (no GPU needed): transformers
5.17's activation checkpointing (old name only), torch 2.11's one-use DCP stager, torch < 2.9's
missing `DefaultStager`, SDPA forwards that skip transformers' mask builder, and peft wrapping models
without the deprecation it triggers in transformers 5.2x."""

from __future__ import annotations

import sys

import pytest
import torch

from pipeline import compat


def _tiny_llama(layers: int = 3, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn))


@pytest.fixture
def transformers_5_17(monkeypatch):
    """transformers as 5.17 has it: `gradient_checkpointing_enable` only (5.2x's body under the old name)."""
    from transformers import PreTrainedModel

    enable = PreTrainedModel._activation_checkpointing_enable if hasattr(
        PreTrainedModel, "_activation_checkpointing_enable") else PreTrainedModel.gradient_checkpointing_enable
    if hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable",
                        lambda self, gradient_checkpointing_kwargs=None: enable(self, gradient_checkpointing_kwargs))


@pytest.mark.parametrize("old_name_only", [False, True])
def test_activation_checkpointing_on_the_first_layers_with_either_name(request, old_name_only):
    """The loader's checkpointing (`model.activation_checkpointing`) works where transformers has only
    the old method name (5.17, the GPU machines' version: the call crashed there), with the same gradients."""
    from pipeline.model import base

    if old_name_only:
        request.getfixturevalue("transformers_5_17")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    grads = {}
    for k in (0, 2):
        model = _tiny_llama().train()
        base.for_training(model, k)
        assert [m.gradient_checkpointing for m in base.decoder_layers(model)] == [True] * k + [False] * (3 - k)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[k] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2]))


@pytest.fixture
def torch_2_11_stager(monkeypatch):
    """DCP's DefaultStager as torch 2.11 has it: `_stage` closes its own copier (pytorch#183413), so a
    second `stage` of the same instance fails."""
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        try:
            return stage(self, state_dict, **kwargs)
        finally:
            self._state_dict_stager.close()

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    compat.stager_reusable.cache_clear()
    yield
    compat.stager_reusable.cache_clear()


def _stage_twice(stagers) -> list:
    weight = torch.randn(64, 8)
    out = []
    for _ in range(2):
        stager = stagers.for_save()
        staged = stager.stage({"w": weight})
        assert torch.equal(staged["w"], weight) and staged["w"].data_ptr() != weight.data_ptr()
        out.append(stager)
        weight.add_(1.0)
    return out


def test_one_stager_serves_every_save_where_it_can():
    """Where the installed torch can reuse a stager (2.13, CI's), one serves every save; on a real torch 2.11
    (.ci/torch-floor) the probe finds it cannot, and each save gets its own."""
    compat.stager_reusable.cache_clear()
    reusable = compat.stager_reusable()
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version == (2, 11):
        assert reusable is False  # pytorch#183413
    elif version >= (2, 13):
        assert reusable is True
    first, second = _stage_twice(compat.SaveStagers(torch.device("cpu")))
    assert (first is second) is reusable


def test_each_save_gets_its_own_stager_where_one_cannot_stage_twice(torch_2_11_stager):
    assert compat.stager_reusable() is False
    first, second = _stage_twice(compat.SaveStagers(torch.device("cpu")))
    assert first is not second


def test_without_default_stager_dcp_stages_by_itself(monkeypatch):
    """torch < 2.9 (the declared floor is 2.4): no DefaultStager, and async_save has no async_stager keyword."""
    import torch.distributed.checkpoint as dcp

    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.staging", None)  # import fails
    compat.stager_reusable.cache_clear()
    try:
        stagers = compat.SaveStagers(torch.device("cpu"))
        assert stagers.for_save() is None
        calls = []
        monkeypatch.setattr(dcp, "async_save", lambda state, **kw: calls.append(kw))
        compat.async_save({}, checkpoint_id="x", process_group=None, stager=None)
        assert calls == [{"checkpoint_id": "x", "process_group": None}]
    finally:
        compat.stager_reusable.cache_clear()


def test_a_mask_free_sdpa_forward_skips_the_mask_builder_and_computes_the_same(monkeypatch):
    """transformers' causal-mask builder reads the position ids back (`if (...).all()`, a device sync on
    a GPU) in every forward; inside `skip_mask_builder` nothing is read, and the hidden states are SDPA's
    causal ones, bit for bit."""
    model = _tiny_llama(layers=2).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    want = model.model(input_ids=ids, use_cache=False).last_hidden_state
    reads = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__",
                        lambda self: (reads.append(sys._getframe(1).f_globals.get("__name__")), real(self))[1])
    model.model(input_ids=ids, use_cache=False)
    assert "transformers.masking_utils" in reads  # what the context below avoids
    reads.clear()
    with compat.skip_mask_builder(model):
        got = model.model(input_ids=ids, use_cache=False).last_hidden_state
    assert reads == [] and torch.equal(got, want)
    assert model.config._attn_implementation == "sdpa"  # restored


def test_a_sliding_window_model_keeps_its_mask_builder():
    """Mistral's sliding window is a mask SDPA's causal kernel would not apply: its forwards build it."""
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                             attn_implementation="sdpa"))
    with compat.skip_mask_builder(model):
        assert model.config._attn_implementation == "sdpa"


def test_wrapping_with_peft_leaves_its_own_deprecation_out_of_the_log_and_every_other_warning_in(tmp_path):
    """peft reads `is_gradient_checkpointing`, which transformers >= 5.2x deprecates, whenever it wraps a model:
    the trainer's wrap and a saved adapter's load give no such warning; any other warning still passes."""
    import warnings

    from pipeline import config as train_config
    from pipeline.model.adapter import attach_lora
    from pipeline.model.exported import load

    cfg = train_config.to_typed({"model": {"path": "m"}, "tokens": {"train_cache": "t"}})
    base = _tiny_llama()
    base.save_pretrained(tmp_path / "base")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = attach_lora(base, cfg)
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in seen]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with compat.peft_wrapping():
            warnings.warn("`is_gradient_checkpointing` is deprecated, but this one is a UserWarning")
    assert [(w.category, str(w.message)) for w in seen] == \
        [(UserWarning, "`is_gradient_checkpointing` is deprecated, but this one is a UserWarning")]
    model.save_pretrained(tmp_path / "adapter")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))).save_pretrained(
        tmp_path / "base")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load(tmp_path / "adapter", base=tmp_path / "base", tokenizer=tmp_path / "base")
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in seen]
