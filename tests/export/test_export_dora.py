"""The DoRA merge (W' = m / ||W + s*B@A|| * (W + s*B@A), per output feature) against peft's
`merge_and_unload`, in memory and through the streaming merge, and verify-merge on it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from export_helpers import lora_config, load_dir_tensors, save_base, tiny_llama
from pipeline import cli
from pipeline.errors import UserError
from pipeline.export import lora_math
from pipeline.export.merge import merge_dirs

MAGNITUDE = ".lora_magnitude_vector"


def _train_magnitudes(peft_model) -> None:
    """Move every magnitude off its initial value, ||W + s*B@A|| (where the DoRA factor is 1 and
    a merge that ignored it would pass)."""
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(torch.empty_like(param).uniform_(0.5, 1.5))


def _dora_reference(model, config):
    """(base, adapter, adapter config dict, peft's merged state dict) for a DoRA adapter."""
    from peft import get_peft_model, get_peft_model_state_dict

    base = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config)
    _train_magnitudes(peft_model)
    adapter = {k: v.clone() for k, v in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()}
    config_dict = json.loads(json.dumps(config.to_dict(), default=sorted))
    return base, adapter, config_dict, peft_model.merge_and_unload().state_dict()


def _max_diff(ours: dict, expected: dict) -> float:
    assert set(ours) == set(expected)
    return max(float((ours[k].double() - expected[k].double()).abs().max()) for k in ours)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))


@pytest.mark.parametrize("case", ["linear", "rslora-patterns", "conv1d-fan-in-fan-out", "embedding"])
def test_dora_merge_equals_peft_merge_and_unload(case):
    """fp32 throughout. Measured (torch 2.13, peft 0.21.2): max |ours - peft| over every tensor is
    0.0 in all four cases; the bound, 1e-6, leaves room for another order of the fp32 operations."""
    if case == "conv1d-fan-in-fan-out":
        model = _gpt2()
        config = lora_config(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, use_dora=True)
    else:
        model, _ = tiny_llama()
        extra = {"linear": {},
                 "rslora-patterns": {"use_rslora": True, "rank_pattern": {"o_proj": 2}, "alpha_pattern": {"up_proj": 3}},
                 "embedding": {"target_modules": ["embed_tokens", "q_proj", "down_proj"]}}[case]
        config = lora_config(use_dora=True, **extra)
    base, adapter, config_dict, expected = _dora_reference(model, config)
    magnitudes = [k for k in adapter if k.endswith(MAGNITUDE)]
    assert magnitudes and config_dict["use_dora"] is True
    ours = lora_math.merge_state_dict(base, adapter, config_dict)
    assert _max_diff(ours, expected) <= 1e-6
    # The rescaling matters: plain W + s*B@A is far from peft's result.
    plain = lora_math.merge_state_dict(base, {k: v for k, v in adapter.items() if not k.endswith(MAGNITUDE)},
                                       {**config_dict, "use_dora": False})
    assert _max_diff(plain, expected) > 1e-2


def test_streaming_merge_of_a_saved_dora_adapter_equals_peft_and_verifies(tmp_path):
    """The saved adapter (its magnitude keys as peft writes them), merged shard by shard, equals
    PeftModel.from_pretrained(...).merge_and_unload(); verify-merge passes on it."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    model = save_base(tmp_path / "base", shard="20KB")
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora_config(use_dora=True))
    _train_magnitudes(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector" in saved

    merge_dirs(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                          tmp_path / "adapter").merge_and_unload().state_dict()
    ours = load_dir_tensors(tmp_path / "merged")
    assert _max_diff(ours, {k: v for k, v in reference.items() if k in ours}) <= 1e-6
    out = tmp_path / "verification.json"
    assert cli.main(["verify-merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
                     "--merged", str(tmp_path / "merged"), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["passed"] is True


def _plan(adapter: dict, base: dict, config: dict):
    return lora_math.plan_targets({k: tuple(v.shape) for k, v in adapter.items()},
                                  {k: tuple(v.shape) for k, v in base.items()},
                                  lora_math.parse_adapter_config(config))


@pytest.mark.parametrize("edit, message", [
    ("no_magnitude", "sets use_dora, but module model.layers.0.self_attn.q_proj has no lora_magnitude_vector"),
    ("not_dora", "but its config does not set use_dora"),
    ("wrong_shape", "(32,) expected"),
    ("orphan", "DoRA magnitudes of modules without a LoRA pair: model.layers.0.self_attn.qq_proj"),
])
def test_inconsistent_dora_adapters_are_refused_by_key(edit, message):
    model, _ = tiny_llama()
    base, adapter, config, _ = _dora_reference(model, lora_config(use_dora=True, target_modules=["q_proj"]))
    key = f"base_model.model.model.layers.0.self_attn.q_proj{MAGNITUDE}"
    if edit == "no_magnitude":
        adapter.pop(key)
    elif edit == "not_dora":
        config["use_dora"] = False
    elif edit == "wrong_shape":
        adapter[key] = torch.ones(31)
    else:
        adapter[key.replace("q_proj", "qq_proj")] = adapter[key]
    with pytest.raises(UserError, match=__import__("re").escape(message)):
        _plan(adapter, base, config)
