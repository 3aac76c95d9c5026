"""bench/bench_gpu.py's FLOP counts, by hand for a small shape, and its supervised count against the
labels its token cache holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_gpu  # noqa: E402

INFO = {"layers": 2, "hidden": 4, "vocab": 10, "params_layers_matmul": 100}


def test_flop_counts_by_hand():
    # Records of 3 tokens (1 of prompt) and 4 tokens (no prompt): 7 tokens; the targets are the labels
    # at positions 1.. : 2 + 3 = 5. Causal attention: 6 L d T^2 = 6 * 2 * 4 * (9 + 16) = 1200.
    counts = bench_gpu.flops_per_token(INFO, 6, [(3, 1), (4, 0)])
    six_n = 6 * (100 + 10 * 4 + 6) * 7 + 1200  # layers + head + LoRA, forward and backward
    lora = (4 * 100 + 6 * 6) * 7 + 4 * 10 * 4 * 5 + 1200  # no weight gradients of the frozen 4N
    assert counts["6n"] == pytest.approx(six_n / 7) and counts["lora_actual"] == pytest.approx(lora / 7)
    assert counts["supervised_fraction"] == pytest.approx(5 / 7) and counts["mean_length"] == 3.5


def test_supervised_count_is_the_targets_the_cache_holds(tmp_path):
    from pipeline.data.cache import IGNORE_INDEX, TokenCache

    shape = bench_gpu.build_cache(tmp_path / "c.safetensors", records=16, seq_len=64, vocab=100, mix=True)
    cache = TokenCache(tmp_path / "c.safetensors")
    targets = sum(int((cache[i][1][1:] != IGNORE_INDEX).sum()) for i in range(len(cache)))
    tokens = sum(n for n, _ in shape)
    assert bench_gpu.flops_per_token(INFO, 0, shape)["supervised_fraction"] == pytest.approx(targets / tokens)


def test_the_trainer_child_gets_the_allocator_setting_of_a_training_job(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert bench_gpu.trainer_env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_the_benchmark_process_never_creates_a_cuda_context(tmp_path, monkeypatch):
    """Its trainer child plans for the whole GPU: the parent asks for the GPUs and builds the model in
    child processes. Here CUDA looks available and creating its context fails."""
    import torch

    def no_context():
        raise AssertionError("the benchmark process created a CUDA context")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_context)
    bench_gpu.C.machine()
    info = bench_gpu.build_model_dir(tmp_path / "model", "tiny", 64)
    assert info["layers"] == bench_gpu.PRESETS["tiny"]["num_hidden_layers"] and (tmp_path / "model").is_dir()


def test_sdpa_and_eager_count_each_rows_mask_and_flash_attention_none():
    """Under SDPA / eager each of a micro-batch's rows (at most `length` wide) has a (width x width) mask in
    booleans and as a bias in the compute dtype; the estimate counts that bound, flash-attention needs none."""
    import dataclasses

    from pipeline import config as train_config
    from pipeline.model import memory

    cfg = train_config.to_typed({"model": {"path": "m"}, "tokens": {"train_cache": "t"}})
    shapes = memory.Shapes(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
                           tied=True)
    run = memory.Run(micro_batch=4, length=512, world=1, sharded=False, checkpointed=0, precision="bf16")
    flash = memory.estimate(cfg, shapes, dataclasses.replace(run, attention="flash_attention_2"))
    assert "attention mask (rows x length^2)" not in flash.parts
    for kernel in ("sdpa", "eager"):
        parts = memory.estimate(cfg, shapes, dataclasses.replace(run, attention=kernel)).parts
        assert parts["attention mask (rows x length^2)"] == 4 * 512 ** 2 * 3, kernel


def test_a_mixture_of_experts_counts_the_active_experts_per_token(tmp_path):
    """FLOPs per token (and so MFU) count top_k of the E experts' weights, as the tokens run through them."""
    preset = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "num_experts": 8, "num_experts_per_tok": 2}
    info = bench_gpu._build_model_dir(tmp_path / "m", preset, seq_len=64)
    attention = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32)  # q, k, v, o of two layers
    router = 2 * 8 * 32  # not a Linear: a token's router matmul is left out, as the norms are
    experts = 2 * 8 * 3 * 32 * 16  # gate, up and down of 8 experts in two layers
    assert info["params_layers_matmul"] == attention + experts * 2 // 8
    assert info["params_total"] > attention + experts + router
