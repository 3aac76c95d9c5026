"""The memory estimate: parameter counts from config.json, activations against what autograd keeps,
and the activation-checkpointing decision it drives."""

from __future__ import annotations

import dataclasses

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
    from kits.train import REPO

    return train_config.resolve(REPO / "config" / "train", "config",
                                [f"model.path={tmp_path / 'model'}", "tokens.train_cache=/t", *overrides])


@pytest.mark.parametrize("tied", [False, True])
def test_shapes_from_config_json_count_every_parameter(tmp_path, tied):
    model = _save(tmp_path, tied)
    shapes = memory.read_shapes(str(tmp_path / "model"))
    assert shapes.params == sum(p.numel() for p in model.parameters())


def test_shapes_take_the_widest_of_a_size_set_per_layer():
    """transformers >= 5.17 writes Gemma 4's head size of its full-attention layers into `per_layer_config`:
    the memory bound takes the widest."""
    import transformers as tf

    config = tf.Gemma4TextConfig(num_hidden_layers=3, head_dim=256, global_head_dim=512).to_dict()
    assert config["head_dim"] == 256 and config["per_layer_config"] == {"2": {"head_dim": 512}}
    assert memory.Shapes.from_config(config).head_dim == 512


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
    run = memory.Run(micro_batch=rows, length=length, world=1, sharded=False, checkpointed=0, precision="bf16")
    estimated = memory.estimate(cfg, memory.read_shapes(cfg.model.path), run).parts["activations"]
    measured = sum(saved.values())
    assert measured <= estimated <= 1.3 * measured, (measured, estimated)


def test_activation_checkpointing_auto_follows_the_budget(tmp_path):
    _save(tmp_path, tied=False, num_hidden_layers=8)
    kw = dict(device=torch.device("cpu"), world=1, sharded=False, precision="bf16", length=2048)
    k, est, _ = memory.for_stage(_cfg(tmp_path), **kw)
    assert (k, est) == (0, None)  # a CPU has no budget: auto is off, nothing to estimate
    k, est, _ = memory.for_stage(_cfg(tmp_path, "model.gpu_memory_gb=2.5"), **kw)
    assert 0 < k == est.run.checkpointed < 8  # a 2.5 GiB GPU: some layers, not all
    assert est.total <= memory.budget(int(2.5 * memory.GiB), 1)
    k, _, _ = memory.for_stage(_cfg(tmp_path, "model.gpu_memory_gb=80"), **kw)
    assert k == 0
    k, _, _ = memory.for_stage(_cfg(tmp_path, "model.gpu_memory_gb=2.5", "model.activation_checkpointing=off"), **kw)
    assert k == 0  # explicit off wins
    k, _, _ = memory.for_stage(_cfg(tmp_path, "model.activation_checkpointing=on"), **kw)
    assert k == 8  # on: every layer, budget or not


def test_auto_checkpoints_the_fewest_layers_that_fit(tmp_path):
    """For each budget between two consecutive estimates, auto picks the k whose estimate fits and
    whose k - 1 does not; over every budget, none when it all fits, every layer when nothing does."""
    _save(tmp_path, tied=False, num_hidden_layers=8)
    cfg, shapes = _cfg(tmp_path), memory.read_shapes(str(tmp_path / "model"))
    run = memory.Run(micro_batch=8, length=2048, world=1, sharded=False, checkpointed=0, precision="bf16")
    totals = [memory.estimate(cfg, shapes, dataclasses.replace(run, checkpointed=k)).total for k in range(9)]
    # Each checkpointed layer keeps its input instead of its activations: the estimate falls per layer
    # until the recompute of one layer (twice its activations) is the larger part of the peak.
    assert all(a > b for a, b in zip(totals[:7], totals[1:7]))
    assert memory.checkpointed_layers(cfg, shapes, run, totals[0]) == 0
    for k in range(1, 7):
        assert memory.checkpointed_layers(cfg, shapes, run, totals[k]) == k
        assert memory.checkpointed_layers(cfg, shapes, run, totals[k - 1] - 1) == k
    assert memory.checkpointed_layers(cfg, shapes, run, min(totals) - 1) == 8  # nothing fits: all
    assert memory.checkpointed_layers(cfg, shapes, run, None) == 0


def test_budget_subtracts_the_cuda_context_nccl_and_fragmentation():
    gpu = 80 * memory.GiB
    one = memory.budget(gpu, 1)
    assert one == int(gpu * (1 - memory.FRAGMENTATION)) - memory.CUDA_CONTEXT_BYTES
    assert one == int(75 * memory.GiB)  # 80 GiB less 4 GiB (5%) less 1 GiB
    assert memory.budget(gpu, 8) == one - memory.NCCL_BYTES  # NCCL only with more than one process


def test_plan_and_stage_choose_the_same_micro_batch_and_layers(tmp_path, capsys):
    """4 ranks share 16 sequences: the derived micro-batch is 4, not optim.micro_batch=8; the plan
    and the stage both estimate that one and print the same choice. The 2.8 GiB GPU is sized for the
    default lora.dropout=0 (no dropout masks kept): some layers checkpointed, not all."""
    from pipeline.planning import plan

    _save(tmp_path, tied=False, num_hidden_layers=8)
    cfg = _cfg(tmp_path, "optim.global_batch=16", "optim.micro_batch=8", "model.gpu_memory_gb=2.8")
    assert train_config.batch_split(cfg, 4)[0] == 4
    assert plan.memory_check(cfg, world=4, max_length=2048) is None
    out = capsys.readouterr().out
    k, est, _ = memory.for_stage(cfg, device=torch.device("cpu"), world=4, sharded=False, precision="bf16",
                              length=2048)
    assert est.run.micro_batch == 4 and 0 < k < 8
    assert f"auto: {memory.checkpointing_text(k, 8)} (the fewest that fit)" in out
    assert est.table() in out


def test_the_largest_micro_batch_that_fits_is_named(tmp_path):
    """16 sequences per update in micro-batches of 2: of the larger micro-batches that divide 16 (4, 8, 16), the
    line names the largest whose estimate fits the budget at the same checkpointing; none when only 2 fits, or
    when one micro-batch already holds the update."""
    _save(tmp_path, tied=False, num_hidden_layers=8)
    cfg = _cfg(tmp_path, "optim.global_batch=16", "optim.micro_batch=2")
    shapes = memory.read_shapes(str(tmp_path / "model"))
    run = memory.Run(micro_batch=2, length=2048, world=1, sharded=False, checkpointed=3, precision="bf16")
    total = {m: memory.estimate(cfg, shapes, dataclasses.replace(run, micro_batch=m)).total for m in (2, 4, 8, 16)}
    assert total[2] < total[4] < total[8] < total[16]
    assert memory.larger_micro_batch(cfg, shapes, run, total[4] - 1) is None
    for m, budget in [(4, total[8] - 1), (8, total[8]), (8, total[16] - 1), (16, total[16])]:
        line = memory.larger_micro_batch(cfg, shapes, run, budget)
        assert line.startswith(f"memory: optim.micro_batch={m} fits too ({total[m] / memory.GiB:.1f} of "), (m, line)
        assert f"{memory.checkpointing_text(3, 8)}) where this run takes 8 micro-batches of 2 per update" in line
    whole = dataclasses.replace(run, micro_batch=16)
    assert memory.larger_micro_batch(cfg, shapes, whole, 10 * total[16]) is None


def test_plan_and_stage_say_a_larger_micro_batch_fits(tmp_path, capsys):
    """On an 80 GiB GPU, 16 sequences per update in micro-batches of 4 at length 1024: the plan prints that
    optim.micro_batch=16 fits, and the stage's estimate comes with the same line; a CPU (no budget) says nothing."""
    from pipeline.planning import plan

    _save(tmp_path, tied=False, num_hidden_layers=8)
    cfg = _cfg(tmp_path, "optim.global_batch=16", "optim.micro_batch=4", "model.gpu_memory_gb=80")
    assert plan.memory_check(cfg, world=1, max_length=1024) is None
    out = capsys.readouterr().out
    kw = dict(device=torch.device("cpu"), world=1, sharded=False, precision="bf16", length=1024)
    _, est, line = memory.for_stage(cfg, **kw)
    assert est.run.micro_batch == 4
    assert line.startswith("memory: optim.micro_batch=16 fits too (") and memory.MICRO_BATCH_EVIDENCE in line
    assert line in out.splitlines()
    assert memory.for_stage(_cfg(tmp_path, "optim.global_batch=16", "optim.micro_batch=4"), **kw)[2] is None


def test_checkpointing_the_first_layers_changes_no_gradient(tmp_path):
    """The first k decoder layers recompute in the backward, the others keep their activations; the
    loss and every LoRA gradient are those of a run without checkpointing, bit for bit (fp32, CPU)."""
    _save(tmp_path, tied=False, num_hidden_layers=3)
    cfg = _cfg(tmp_path, "lora.dropout=0.1")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    results = {}
    for k in (0, 2):
        torch.manual_seed(0)
        lm = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"), checkpointed=k).train()
        flags = [m.gradient_checkpointing for m in loading.decoder_layers(lm)]
        assert flags == [True] * k + [False] * (3 - k)
        torch.manual_seed(1)  # the same dropout masks
        loss = lm(input_ids=ids, labels=ids).loss
        loss.backward()
        results[k] = (loss.detach(), [p.grad.clone() for _, p in loading.trainable(lm)])
    assert torch.equal(results[0][0], results[2][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[2][1]))


def test_a_vision_language_model_checkpoints_the_first_layers_of_its_language_model(tmp_path):
    """The estimate counts the language model's layers: auto's k are its first k, not the vision
    tower's (which comes first in module order); `on` checkpoints every layer, the tower's too."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    from kits.vlm import save_llava

    save_llava(tmp_path / "model")
    for k in (1, memory.EVERY_LAYER):
        lm = loading.build(_cfg(tmp_path), Precision("fp32", "cpu"), torch.device("cpu"), checkpointed=k)
        flags = {n: m.gradient_checkpointing for n, m in lm.named_modules() if isinstance(m, GradientCheckpointingLayer)}
        language = sorted((n for n in flags if ".language_model." in n), key=lambda n: int(n.rsplit(".", 1)[1]))
        tower = [n for n in flags if n not in language]
        assert len(language) > 1 and tower
        if k == 1:
            assert [flags[n] for n in language] == [True] + [False] * (len(language) - 1)
            assert not any(flags[n] for n in tower)
        else:
            assert all(flags.values())
