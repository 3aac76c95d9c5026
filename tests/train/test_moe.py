"""A mixture of experts trains with the guarantees of a dense model: chunked == one run bitwise, with
the router's load-balancing loss on and packed micro-batches, in one process (a stage that crashes resumes from its in-stage
checkpoint) and on 2 DDP ranks; the EMA shadows and the checkpoints hold the experts' adapters."""

from __future__ import annotations

import json

import pytest
from kits.moe import save_family
from safetensors import safe_open
from kits.train import final_digests, make_run, stage_names, step_losses

MOE = ["lora.dropout=0"]  # peft's ParamWrapper (the experts' fused weights) takes no dropout


@pytest.fixture(scope="module")
def qwen3_moe(tiny_mixed, tmp_path_factory) -> dict:
    """A tiny Qwen3-MoE on records of mixed lengths, which pack several to a row (packing is on for it)."""
    root = tmp_path_factory.mktemp("qwen3_moe")
    save_family("qwen3_moe", root / "model")
    return {**tiny_mixed, "model": root / "model"}


def _router_losses(run, stages: list[str]) -> list[tuple[int, float]]:
    rows = [json.loads(line) for s in stages for line in (run.stage_dir(s) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["router_loss"]) for r in rows if "router_loss" in r]


def _chunked_equals_one(tmp_path, data, *, nproc: int | None = None, crash: bool = False) -> None:
    total = 6
    chunked = make_run(tmp_path / "chunked", data, total=total, fraction=0.34, chunks=1, overrides=MOE)
    names = stage_names(chunked)
    assert names == ["pilot", "chunk01"]  # updates 1-2, 3-6
    packing = json.loads(chunked.plan.read_text())["packing"]
    assert packing["layout"] == {"cpu": "rows", "gpu": "rows"}, packing  # several records a row, then padding
    for i, name in enumerate(names):
        init = names[i - 1] if i else None
        if crash and name == "chunk01":  # dies after its in-stage checkpoint of update 4; the retry resumes there
            assert chunked.train(name, init, faults={"fail_at_step": 4}, check=False, nproc=nproc).returncode == 1
            assert (chunked.scratch(name) / "step_000004" / "MANIFEST.json").is_file()
        proc = chunked.train(name, init, nproc=nproc)
        if crash and name == "chunk01":
            assert "start from " + str(chunked.scratch(name) / "step_000004") in proc.stdout
    one = make_run(tmp_path / "one", data, total=total, fraction=0.34, chunks=1, overrides=MOE, single_stage=True)
    one.train("all", nproc=nproc)
    digests = final_digests(one)
    assert {"adapter/adapter_model.safetensors", "ema/0.9/adapter_model.safetensors",
            "ema/0.99/adapter_model.safetensors", "training_state/optimizer.safetensors"} <= set(digests)
    assert final_digests(chunked, names[-1]) == digests
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    routed = _router_losses(one, ["all"])
    assert [s for s, _ in routed] == list(range(1, total + 1)) and all(v > 0 for _, v in routed)
    assert _router_losses(chunked, names) == routed
    # The adapter and every EMA shadow hold the experts' fused-weight adapters (two nested ParamWrappers).
    ckpt = one.stage_dir("all") / "checkpoint"
    expert = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"
    for path in [ckpt / "adapter", ckpt / "ema" / "0.9", ckpt / "ema" / "0.99"]:
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            assert expert in f.keys() and f.get_tensor(expert).abs().sum() > 0, path


def test_moe_chunked_run_with_a_crash_equals_one_run(qwen3_moe, tmp_path):
    _chunked_equals_one(tmp_path, qwen3_moe, crash=True)


@pytest.mark.distributed
def test_moe_ddp_two_ranks_chunked_equals_one_run(qwen3_moe, tmp_path):
    _chunked_equals_one(tmp_path, qwen3_moe, nproc=2)
