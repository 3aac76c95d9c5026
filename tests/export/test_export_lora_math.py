"""The pure merge math against peft, on in-memory state dicts."""

from __future__ import annotations

import json

import pytest
import torch

from export_helpers import LLAMA_TARGETS, lora_config, tiny_llama
from pipeline.errors import UserError
from pipeline.export import lora_math
from pipeline.export.merge import merge_dirs


def _peft_reference(model, config, seed=1, train=None):
    """(base state dict, adapter state dict, adapter config dict, merged state dict) from peft.

    `train(peft_model)`: changes the trained weights first (a module saved whole starts as a copy).
    """
    from peft import get_peft_model, get_peft_model_state_dict

    base = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    if train is not None:
        train(peft_model)
    adapter = {k: v.clone() for k, v in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()}
    config_dict = json.loads(json.dumps(config.to_dict(), default=sorted))  # as adapter_config.json holds it
    merged = peft_model.merge_and_unload().state_dict()
    return base, adapter, config_dict, merged


def _assert_matches(ours, expected):
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rank_pattern": {"down_proj": 2, r"layers\.1\.self_attn\.q_proj": 6},
         "alpha_pattern": {"v_proj": 3, "layers.0.mlp.up_proj": 20}},
        {"use_rslora": True, "lora_alpha": 5},
        {"use_rslora": True, "rank_pattern": {"o_proj": 2}, "alpha_pattern": {"gate_proj": 7}},
    ],
    ids=["plain", "rank-alpha-patterns", "rslora", "rslora-patterns"],
)
def test_merge_state_dict_matches_peft(overrides):
    model, _ = tiny_llama()
    base, adapter, config, expected = _peft_reference(model, lora_config(**overrides))
    ours = lora_math.merge_state_dict(base, adapter, config)
    _assert_matches(ours, expected)


def test_modules_to_save_replace_their_base_tensors_like_peft():
    """A module trained in full (a vision-language projector) is saved whole; the merge puts it in place."""
    def train(peft_model):
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "modules_to_save" in name:
                    param.add_(torch.randn_like(param))

    model, _ = tiny_llama()
    base, adapter, config, expected = _peft_reference(model, lora_config(modules_to_save=["lm_head"]), train=train)
    assert "base_model.model.lm_head.weight" in adapter
    ours = lora_math.merge_state_dict(base, adapter, config)
    _assert_matches(ours, expected)
    assert not torch.equal(ours["lm_head.weight"], base["lm_head.weight"])


def test_patterns_resolve_like_peft():
    settings = lora_math.parse_adapter_config(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4, r"layers\.1\..*": 2},
         "alpha_pattern": {"^model.layers.0.self_attn.k_proj": 1}}
    )
    assert lora_math.scaling_for(settings, "model.layers.0.self_attn.q_proj") == (4, 4.0)
    assert lora_math.scaling_for(settings, "model.layers.1.mlp.up_proj") == (2, 8.0)
    assert lora_math.scaling_for(settings, "model.layers.0.self_attn.k_proj") == (8, 1 / 8)
    assert lora_math.scaling_for(settings, "model.layers.0.self_attn.xq_proj") == (8, 2.0)  # suffix at a dot only


def test_fan_in_fan_out_conv1d_matches_peft():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    config = lora_config(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    base, adapter, config_dict, expected = _peft_reference(model, config)
    _assert_matches(lora_math.merge_state_dict(base, adapter, config_dict), expected)


def test_embedding_target_with_saved_base_layer_matches_peft(tmp_path):
    """peft saves the whole embedding when it is targeted; the merge must use it like peft does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from export_helpers import load_dir_tensors, save_adapter, save_base

    model = save_base(tmp_path / "base")
    save_adapter(model, tmp_path / "adapter", target_modules=["embed_tokens", "q_proj"])
    merge_dirs(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                          tmp_path / "adapter").merge_and_unload().state_dict()
    ours = load_dir_tensors(tmp_path / "merged")
    _assert_matches(ours, reference)
    assert not torch.equal(ours["model.embed_tokens.weight"],
                           load_dir_tensors(tmp_path / "base")["model.embed_tokens.weight"])


def test_merge_is_pure_and_repeatable():
    model, _ = tiny_llama()
    base, adapter, config, _ = _peft_reference(model, lora_config())
    base_copy = {k: v.clone() for k, v in base.items()}
    adapter_copy = {k: v.clone() for k, v in adapter.items()}
    first = lora_math.merge_state_dict(base, adapter, config)
    second = lora_math.merge_state_dict(base, adapter, config)
    for name in first:
        assert torch.equal(first[name], second[name])
    for name in base:
        assert torch.equal(base[name], base_copy[name])  # inputs never modified
    for name in adapter:
        assert torch.equal(adapter[name], adapter_copy[name])


def test_non_finite_merge_is_refused():
    target = lora_math.LoraTarget("m", "m.weight", "a", "b", "linear", 1, 1.0, False)
    weight = torch.full((2, 2), 60000.0, dtype=torch.float16)
    a, b = torch.full((1, 2), 100.0), torch.full((2, 1), 100.0)
    with pytest.raises(UserError, match="not finite in torch.float16"):
        lora_math.merge_weight(weight, a, b, target)
    with pytest.raises(UserError, match="not finite"):
        lora_math.merge_weight(torch.full((2, 2), float("nan")), a, b, target)
    assert lora_math.merge_weight(weight, a, b, target, torch.float32).dtype == torch.float32  # fp32 holds it


@pytest.mark.parametrize(
    "change, message",
    [
        ({"peft_type": "IA3"}, "only LORA"),
        ({"lora_bias": True}, "lora_bias"),
        ({"bias": "all"}, "bias"),
        ({"alora_invocation_tokens": [1, 2]}, "activated LoRA"),
        ({"init_lora_weights": "pissa_niter_4"}, "rewrites the base"),
    ],
)
def test_unsupported_adapter_configs_are_refused(change, message):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **change}
    with pytest.raises(UserError, match=message):
        lora_math.parse_adapter_config(config)


def test_every_target_module_is_mapped():
    model, _ = tiny_llama()
    base, adapter, config, _ = _peft_reference(model, lora_config())
    plan = lora_math.plan_targets({k: tuple(v.shape) for k, v in adapter.items()},
                                  {k: tuple(v.shape) for k, v in base.items()},
                                  lora_math.parse_adapter_config(config))
    assert len(plan) == 2 * len(LLAMA_TARGETS)  # 2 layers x 7 targets, each once
    assert all(key == f"{t.module}.weight" for key, t in plan.items())
