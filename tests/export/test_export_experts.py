"""LoRA on fused expert weights (peft ParamWrapper): the merge's per-expert delta is peft's own, and the
streaming merge into the base's stored layout equals peft's merge_and_unload saved by transformers."""

from __future__ import annotations

import json

import pytest
import torch
from kits.moe import save_family

from pipeline.errors import UserError
from pipeline.export import expert_math, lora_math


def _adapted(base, r=4, seed=1, router=False):
    """Base + a peft adapter on the experts' fused weights and the attention (and the routers' weights:
    2-D ParamWrappers, `moe.train_router`), B randomized (not the zero init)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=["q_proj", "o_proj"],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj", *(["gate.weight"] * router)])
    peft = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return peft


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # (E, out, in) experts, and transposed (E, in, out)
def test_expert_delta_is_what_pefts_param_wrapper_adds(family, tmp_path):
    from peft.tuners.lora.layer import ParamWrapper

    save_family(family, tmp_path / "base")
    peft = _adapted(tmp_path / "base")
    wrappers = [m for m in peft.modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 4  # two fused weights in each of two layers
    for wrapper in wrappers:
        expected = wrapper.get_delta_weight("default")  # (E, ...) as the weight is laid out
        # (E, out, in) as transformers stores all but GPT-OSS's; peft before 0.19 reads every one as (E, in, out)
        layout = "out_in" if getattr(wrapper, "_did_swap_in_out_features", False) else "in_out"
        assert layout == "in_out" or family != "gpt_oss"
        a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        for e in range(wrapper.num_experts):
            ours = expert_math.expert_delta(a, b, experts=wrapper.num_experts, expert=e,
                                            scaling=wrapper.scaling["default"], layout=layout)
            torch.testing.assert_close(ours, expected[e].float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_streaming_merge_equals_pefts_merge_and_unload_saved_by_transformers(family, tmp_path):
    """transformers' save of peft's merged model writes the base's layout (per-expert tensors, Mixtral's
    w1/w2/w3 under block_sparse_moe, GPT-OSS fused): every tensor must be what the streaming merge wrote."""
    from safetensors.torch import load_file

    from pipeline.export.merge import merge_dirs

    save_family(family, tmp_path / "base")
    peft = _adapted(tmp_path / "base", router=family != "gpt_oss")  # (GPT-OSS's router module is `router`)
    peft.save_pretrained(tmp_path / "adapter")
    merge_dirs(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    peft.merge_and_unload().save_pretrained(tmp_path / "reference")
    ours, theirs = load_file(tmp_path / "merged/model.safetensors"), load_file(tmp_path / "reference/model.safetensors")
    base = load_file(tmp_path / "base/model.safetensors")
    assert set(ours) == set(theirs) == set(base)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)
    changed = [k for k in ours if not torch.equal(ours[k], base[k])]
    assert any("experts" in k for k in changed) and any("q_proj" in k for k in changed), changed
    assert family == "gpt_oss" or any(k.endswith("gate.weight") for k in changed), changed  # the routers too


def test_a_fused_adapter_that_does_not_fit_the_base_is_refused_before_writing(tmp_path):
    from safetensors.torch import load_file, save_file

    from pipeline.export.merge import merge_dirs

    save_family("qwen3_moe", tmp_path / "base")
    peft = _adapted(tmp_path / "base")
    peft.save_pretrained(tmp_path / "adapter")
    tensors = load_file(tmp_path / "adapter/adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    tensors[key] = tensors[key][:-1]  # one row short: no longer rank x experts rows
    save_file(tensors, tmp_path / "adapter/adapter_model.safetensors")
    # (the A and B widths depend on how the peft at hand reads the weight: (E, out, in) or (E, in, out))
    with pytest.raises(UserError, match=r"lora_A \(15, \d+\) / lora_B \(\d+, 16\) do not fit "
                                        r"model.layers.0.mlp.experts.down_proj"):
        merge_dirs(tmp_path / "base", tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    # A merge over plain state dicts has no architecture to place fused weights with: refused, saying so.
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    with pytest.raises(UserError, match="target_parameters .* needs the base's architecture"):
        lora_math.merge_state_dict(load_file(tmp_path / "base/model.safetensors"), tensors, config)
