"""`model.attn_implementation` resolved per model class and machine (pipeline.model.attention)."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import UserError
from pipeline.model.attention import Machine, resolve, support_of

CPU = Machine(cuda=False, flash_attn=False)
GPU_FLASH = Machine(cuda=True, flash_attn=True)
GPU = Machine(cuda=True, flash_attn=False)


def _support(name: str, family: str):
    import transformers

    return support_of(getattr(transformers, name), family)


@pytest.mark.parametrize("machine, expected", [(CPU, "sdpa"), (GPU, "sdpa"), (GPU_FLASH, "flash_attention_2")])
def test_auto_takes_the_best_kernel_a_llama_and_the_machine_have(machine, expected):
    impl, reason = resolve("auto", _support("LlamaForCausalLM", "llama"), machine)
    assert impl == expected and reason.startswith("auto:")


@pytest.mark.parametrize("machine", [CPU, GPU, GPU_FLASH])
def test_auto_runs_gpt_oss_eagerly_where_no_sink_aware_kernel_is_installed(machine):
    """GPT-OSS's attention sinks: no SDPA kernel, and its flash builds come from the kernels hub."""
    impl, reason = resolve("auto", _support("GptOssForCausalLM", "gpt_oss"), machine)
    assert impl == "eager" and "gpt_oss has no SDPA kernel (attention sinks)" in reason


@pytest.mark.parametrize("requested", ["sdpa", "flash_attention_2"])
def test_an_explicit_kernel_the_family_does_not_support_names_the_setting_and_the_supported_ones(requested):
    with pytest.raises(UserError) as err:
        resolve(requested, _support("GptOssForCausalLM", "gpt_oss"), GPU_FLASH)
    message = str(err.value)
    assert message.startswith(f"model.attn_implementation={requested}: gpt_oss does not support it")
    assert "it supports flex_attention, eager (or auto" in message


def test_gemma4_heads_of_512_keep_auto_off_flash_attn_and_an_explicit_flash_choice_is_refused(monkeypatch):
    """Gemma 4's class supports flash attention, but its full-attention layers have heads of 512 (a
    per-layer config): flash-attn's kernels take up to 256, so `auto` on a GPU with flash-attn takes SDPA,
    saying why, and flash_attention_2 asked for is refused before any load (it failed in the first forward)."""
    import transformers as tf

    from pipeline.model import attention, base

    layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    gemma4 = tf.Gemma4TextConfig(**layers, head_dim=256)  # global_head_dim: 512, the default and the shipped size
    assert attention.head_sizes(gemma4) == {256, 512}
    monkeypatch.setattr(attention.Machine, "here", classmethod(lambda cls, device=None: GPU_FLASH))
    impl, reason = base.attention_choice("auto", gemma4)
    assert impl == "sdpa" and "gemma4_text's heads of 512 are over the 256 its kernels take" in reason, reason
    with pytest.raises(UserError, match=r"flash_attention_2: gemma4_text does not support it \(heads of 512"):
        base.attention_choice("flash_attention_2", gemma4)
    fits = tf.Gemma4TextConfig(**layers, head_dim=128, global_head_dim=256)
    assert base.attention_choice("auto", fits)[0] == "flash_attention_2"
    assert base.attention_choice("auto", tf.LlamaConfig())[0] == "flash_attention_2"


def test_an_explicit_supported_kernel_is_taken_as_set_and_remote_code_is_assumed_sdpa():
    assert resolve("eager", _support("LlamaForCausalLM", "llama"), GPU_FLASH) == ("eager", "set by "
                                                                                   "model.attn_implementation")
    assert resolve("auto", support_of(None, "custom"), CPU)[0] == "sdpa"


def test_flex_attention_is_refused_for_training_off_a_gpu_where_torch_has_no_backward():
    """This torch has no flex-attention backward on a CPU (the day it has, the first half fails and the refusal
    goes); so a training stage on a CPU refuses model.attn_implementation=flex_attention before loading
    anything, naming the setting, where it used to die in the first update."""
    from types import SimpleNamespace

    from torch.nn.attention.flex_attention import flex_attention

    from pipeline.train import strategy

    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_attention(q, q, q).sum().backward()
    cfg = SimpleNamespace(distributed=SimpleNamespace(strategy="ddp"),
                          model=SimpleNamespace(attn_implementation="flex_attention"))
    with pytest.raises(UserError, match="model.attn_implementation=flex_attention trains on a CUDA GPU only"):
        strategy.choose(cfg, SimpleNamespace(device=torch.device("cpu"), enabled=False))
    cfg.model.attn_implementation = "sdpa"
    assert strategy.choose(cfg, SimpleNamespace(device=torch.device("cpu"), enabled=False)).sharded is False
