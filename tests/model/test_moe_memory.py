"""The memory estimate and the parameter counts of a mixture of experts (pipeline.model.memory)."""

from __future__ import annotations

import pytest
import torch
from kits.moe import save_family

from pipeline import config as train_config
from pipeline.model import loading, memory
from pipeline.model.loss import Batch, TokenLoss
from pipeline.model.precision import Precision


def _cfg(base, *overrides):
    from kits.train import REPO

    return train_config.resolve(REPO / "config" / "train", "config",
                                [f"model.path={base}", "tokens.train_cache=/t", "lora.dropout=0", "lora.r=4",
                                 "moe.router_aux_loss=false", *overrides])


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h"])
def test_counts_are_the_models_every_expert_in_memory_top_k_active(family, tmp_path):
    save_family(family, tmp_path / family)
    cfg = _cfg(tmp_path / family)
    shapes = memory.model_shapes(cfg)
    lm = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    frozen = sum(p.numel() for _, p in lm.named_parameters() if not p.requires_grad)  # the whole base, under LoRA
    assert shapes.params == frozen  # every expert counts toward the weights held in memory
    assert memory._lora_params(cfg, shapes) == sum(p.numel() for _, p in loading.trainable(lm))
    experts = shapes.counts.experts
    assert experts == sum(p.numel() for n, p in lm.named_parameters() if ".experts." in n and not p.requires_grad)
    # a token runs through top_k of E experts: what throughput and MFU count
    assert shapes.active_params == shapes.params - experts * (4 - 2) // 4
    run = memory.Run(micro_batch=2, length=16, world=1, sharded=False, checkpointed=0, precision="fp32")
    assert memory.estimate(cfg, shapes, run).parts["weights (fp32)"] == 4 * shapes.params


def test_estimate_counts_the_expert_weights_pefts_param_wrapper_keeps_for_the_backward(tmp_path):
    """LoRA on fused experts: peft computes W + delta of a layer's experts in the forward, and autograd
    keeps it for the layer's backward; LoRA on the attention alone keeps no such copy."""
    save_family("qwen3_moe", tmp_path / "m")
    saved = {}
    for targets in ("[all-linear]", "[q_proj,k_proj,v_proj,o_proj]"):
        cfg = _cfg(tmp_path / "m", f"lora.target_modules={targets}")
        model = TokenLoss(loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))).train()
        ids = torch.randint(3, 40, (2, 16), generator=torch.Generator().manual_seed(0))
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(Batch({"input_ids": ids}, torch.arange(31), ids.flatten()[1:], 32))
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved[targets] = sum(b for ptr, b in kept.items() if ptr not in weights)
        run = memory.Run(micro_batch=2, length=16, world=1, sharded=False, checkpointed=0, precision="fp32")
        part = memory.estimate(cfg, memory.model_shapes(cfg), run).parts.get(
            "expert weights + LoRA delta (ParamWrapper)")
        if targets == "[all-linear]":
            copies = part
        else:
            assert part is None
    shapes = memory.model_shapes(_cfg(tmp_path / "m"))
    assert copies == shapes.counts.moe_layers * shapes.counts.expert_layer * 4
    assert saved["[all-linear]"] - saved["[q_proj,k_proj,v_proj,o_proj]"] >= copies
