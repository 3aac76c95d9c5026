"""On a CUDA GPU: bf16 autocast, fp16 with a GradScaler, and a chunked run bitwise equal to one run
with deterministic kernels. Skipped without CUDA (the CPU versions are in test_half_precision.py)."""

from __future__ import annotations

import json

import pytest
from kits.train import checkpoint_digests, make_run, stage_names, step_losses

from pipeline import layout

# Skipped without a CUDA GPU by tests/conftest.py (which hides the GPUs from every other test).
pytestmark = pytest.mark.gpu


def _rows(stage_dir):
    rows = [json.loads(x) for x in (stage_dir / layout.STAGE_METRICS).read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _chunked_equals_one_run(tiny, tmp_path, overrides):
    chunked = make_run(tmp_path / "chunked", tiny, total=8, fraction=0.25, chunks=2, overrides=overrides)
    names = stage_names(chunked)
    chunked.chain(names)
    one = make_run(tmp_path / "one", tiny, total=8, fraction=0.25, chunks=2, overrides=overrides, single_stage=True)
    one.train("all")
    final = one.stage_dir("all") / layout.STAGE_CHECKPOINT
    assert checkpoint_digests(chunked.stage_dir(names[-1]) / layout.STAGE_CHECKPOINT) == checkpoint_digests(final)
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    scaler = final / layout.TRAINING_STATE_DIR / layout.SCALER_FILE
    assert (chunked.stage_dir(names[-1]) / layout.STAGE_CHECKPOINT / layout.TRAINING_STATE_DIR
            / layout.SCALER_FILE).read_text() == scaler.read_text()
    return one


def test_bf16_autocast_trains_on_the_gpu(tiny, tmp_path):
    run = make_run(tmp_path, tiny, total=6, single_stage=True, overrides=["precision.mode=bf16"])
    proc = run.train("all")
    assert "precision bf16" in proc.stdout
    rows = _rows(run.stage_dir("all"))
    assert not any(r["skipped"] for r in rows) and all(r["mem_mb"] > 0 for r in rows)


def test_fp16_grad_scaler_chunked_equals_one_run_on_the_gpu(tiny, tmp_path):
    one = _chunked_equals_one_run(tiny, tmp_path, ["precision.mode=fp16", "precision.init_scale=2.5e6",
                                                   "deterministic=true"])
    rows = _rows(one.stage_dir("all"))
    assert "loss_scale" in rows[0]


def test_bf16_lora_chunked_equals_one_run_with_deterministic_kernels(tiny, tmp_path):
    _chunked_equals_one_run(tiny, tmp_path, ["precision.mode=bf16", "deterministic=true",
                                             "model.activation_checkpointing=on"])


def test_compiled_decoder_layers_train_like_the_eager_ones(tiny, tmp_path):
    # (On a CPU this works too, but compiling takes minutes there: a GPU test.)
    losses = {}
    for compiled in (False, True):
        run = make_run(tmp_path / str(compiled), tiny, total=4, single_stage=True,
                       overrides=["precision.mode=bf16", f"model.compile={str(compiled).lower()}"])
        run.train("all", timeout=900)
        losses[compiled] = [r["loss"] for r in _rows(run.stage_dir("all"))]
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
