"""The settings that trade memory or speed change nothing a run computes: activation checkpointing and
deterministic kernels not a bit (on the CPU: CUDA's default kernels are not deterministic, so there a
deterministic run differs from a default one in the last bits; tests/train/test_gpu.py compares
deterministic runs only); length grouping only the order of sums (packing: tests/train/test_packing.py)."""

from __future__ import annotations

import pytest
from kits.train import checkpoint_digests, make_run, step_losses

from pipeline import layout


def _run(tiny, root, overrides, total=4):
    run = make_run(root, tiny, total=total, single_stage=True, overrides=overrides)
    proc = run.train("all")
    return run, proc


def _final(run):
    return checkpoint_digests(run.stage_dir("all") / layout.STAGE_CHECKPOINT)


def test_activation_checkpointing_and_deterministic_kernels_change_no_bit_on_the_cpu(tiny, tmp_path):
    # LoRA dropout is on (make_run sets it): the recompute must replay the same masks, and leave the RNG
    # stream where it was, or every later update would differ.
    plain, plain_proc = _run(tiny, tmp_path / "plain", [])
    # A GPU size (it changes nothing here: checkpointing is on) gives the stage a budget, and so the line that
    # says one micro-batch of 8 fits (make_run: 8 records per update in micro-batches of 4).
    ckpt, proc = _run(tiny, tmp_path / "ckpt", ["model.activation_checkpointing=on", "deterministic=true",
                                                "model.gpu_memory_gb=80"])
    assert "activation checkpointing 2 of 2 layers" in proc.stdout
    assert "[all] memory: optim.micro_batch=8 fits too (" in proc.stdout
    assert "memory: optim.micro_batch" not in plain_proc.stdout  # a CPU, no GPU size: no budget
    # The claim holds for the CPU's kernels: both ran there (precision auto is fp32 on a CPU only;
    # tests/conftest.py hides any GPU from an unmarked test).
    assert "precision fp32" in plain_proc.stdout and "precision fp32" in proc.stdout
    assert _final(ckpt) == _final(plain)
    assert step_losses([ckpt.stage_dir("all")]) == step_losses([plain.stage_dir("all")])


def test_grouping_only_reorders_the_sums(tiny, tmp_path):
    # Grouping cuts padded micro-batches: packing (tests/train/test_packing.py) is off here.
    base = ["lora.dropout=0.0", "tokens.packing=off"]  # dropout masks are drawn per micro-batch layout
    setting = ["tokens.group_by_length=false"]
    ref, _ = _run(tiny, tmp_path / "ref", base)
    other, _ = _run(tiny, tmp_path / "other", [*base, *setting])
    a, b = step_losses([ref.stage_dir("all")]), step_losses([other.stage_dir("all")])
    assert [s for s, _ in a] == [s for s, _ in b]
    assert [x for _, x in b] == pytest.approx([x for _, x in a], rel=1e-5)
