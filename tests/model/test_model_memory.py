"""The memory estimate: parameter counts from config.json, activations against what autograd keeps,
and the activation-checkpointing decision it drives."""

from __future__ import annotations

import pytest
import torch

from pipeline import config as train_config
from pipeline.model import loading, memory
from pipeline.model.loss import Batch
from pipeline.model.precision import Precision

SMALL = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=688, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)


def _save(tmp_path, tied: bool, dtype=torch.float32, **shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, **shape}, tie_word_embeddings=tied)).to(dtype)
    model.save_pretrained(tmp_path / "model")
    return model


def _cfg(tmp_path, *overrides):
    from trainkit import REPO

    return train_config.resolve(REPO / "config" / "train", "config",
                                [f"model.path={tmp_path / 'model'}", "tokens.train_cache=/t", *overrides])


@pytest.mark.parametrize("tied", [False, True])
def test_shapes_from_config_json_count_every_parameter(tmp_path, tied):
    model = _save(tmp_path, tied)
    shapes = memory.read_shapes(str(tmp_path / "model"))
    assert shapes.params == sum(p.numel() for p in model.parameters())


def test_lora_parameter_count_is_what_peft_trains(tmp_path):
    _save(tmp_path, tied=False)
    cfg = _cfg(tmp_path, "lora.r=8", "lora.target_modules=[q_proj,v_proj,down_proj]")
    lm = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    trained = sum(p.numel() for _, p in loading.trainable(lm))
    assert memory._lora_params(cfg, memory.read_shapes(cfg.model.path)) == trained


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_activation_estimate_bounds_what_autograd_keeps(tmp_path, dropout):
    """bf16 weights under bf16 autocast, LoRA on every projection: the estimate is at least the bytes
    of the tensors autograd saves in the decoder's forward (weights excluded), and not far above."""
    _save(tmp_path, tied=False, dtype=torch.bfloat16)
    cfg = _cfg(tmp_path, f"lora.dropout={dropout}")
    lm = loading.build(cfg, Precision("bf16", "cpu"), torch.device("cpu")).train()
    rows, length = 2, 128
    ids = torch.randint(0, SMALL["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(0))
    batch = Batch({"input_ids": ids}, torch.arange(rows * length - 1), ids.flatten()[1:], rows * length)
    weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        lm.get_base_model().base_model(**batch.inputs, use_cache=False)
    run = memory.Run(micro_batch=rows, length=length, world=1, sharded=False, checkpointing=False, precision="bf16")
    estimated = memory.estimate(cfg, memory.read_shapes(cfg.model.path), run).parts["activations"]
    measured = sum(saved.values())
    assert measured <= estimated <= 1.3 * measured, (measured, estimated)


def test_activation_checkpointing_auto_follows_the_budget(tmp_path):
    _save(tmp_path, tied=False, num_hidden_layers=8)
    kw = dict(device=torch.device("cpu"), world=1, sharded=False, precision="bf16", length=2048)
    on, est = memory.for_stage(_cfg(tmp_path), **kw)
    assert (on, est) == (False, None)  # a CPU has no budget: auto is off, nothing to estimate
    on, est = memory.for_stage(_cfg(tmp_path, "model.gpu_memory_gb=1.1"), **kw)
    assert on and est.run.checkpointing  # 1.1 GiB: needs it
    assert est.total < memory.estimate(_cfg(tmp_path), memory.read_shapes(str(tmp_path / "model")),
                                       memory.Run(8, 2048, 1, False, False, "bf16")).total
    on, _ = memory.for_stage(_cfg(tmp_path, "model.gpu_memory_gb=80"), **kw)
    assert not on
    on, _ = memory.for_stage(_cfg(tmp_path, "model.gpu_memory_gb=1.1", "model.activation_checkpointing=off"), **kw)
    assert not on  # explicit off wins
