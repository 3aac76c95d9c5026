"""Half precision on a CPU (asked for explicitly): bf16 autocast, fp16 with a GradScaler, its
calibration skips, and exact resume with the scaler's state, on 1 and 2 ranks (on `tiny_mixed`: packed
micro-batches)."""

from __future__ import annotations

import json

import pytest
from kits.train import checkpoint_digests, make_run, stage_names, step_losses

from pipeline import layout

FP16 = ["precision.mode=fp16"]


def _rows(stage_dir):
    rows = [json.loads(x) for x in (stage_dir / layout.STAGE_METRICS).read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _state(run, stage: str) -> dict:
    """Weights, EMA and optimizer digests plus the GradScaler's state, of a stage's final checkpoint."""
    ckpt = run.stage_dir(stage) / layout.STAGE_CHECKPOINT
    scaler = json.loads((ckpt / layout.TRAINING_STATE_DIR / layout.SCALER_FILE).read_text())
    return {**checkpoint_digests(ckpt), "scaler": scaler}


def _chunked_equals_one_run(tiny_mixed, tmp_path, overrides, nproc=None):
    chunked = make_run(tmp_path / "chunked", tiny_mixed, total=8, fraction=0.25, chunks=2, overrides=overrides)
    names = stage_names(chunked)
    chunked.chain(names, nproc=nproc)
    one = make_run(tmp_path / "one", tiny_mixed, total=8, fraction=0.25, chunks=2, overrides=overrides, single_stage=True)
    one.train("all", nproc=nproc)
    final = _state(one, "all")
    assert final["scaler"]["scale"] > 0  # fp16: the scaler is on and its state is saved
    assert _state(chunked, names[-1]) == final
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    return one


def test_fp16_with_grad_scaler_chunked_equals_one_run(tiny_mixed, tmp_path):
    # A first scale that overflows: the run goes through calibration skips and scale changes,
    # which the resumed stages must reproduce from the saved scaler state.
    one = _chunked_equals_one_run(tiny_mixed, tmp_path, [*FP16, "precision.init_scale=2.5e6"])
    rows = _rows(one.stage_dir("all"))
    assert rows[0]["scaler_skip"] and not rows[-1]["skipped"]
    assert len({r["loss_scale"] for r in rows}) > 1


@pytest.mark.distributed
def test_fp16_ddp_two_ranks_chunked_equals_one_run(tiny_mixed, tmp_path):
    _chunked_equals_one_run(tiny_mixed, tmp_path, [*FP16, "precision.init_scale=2.5e6"], nproc=2)


def test_scaler_calibration_skips_do_not_abort_the_run(tiny_mixed, tmp_path):
    run = make_run(tmp_path, tiny_mixed, total=10, single_stage=True,
                   overrides=[*FP16, "precision.init_scale=4e7", "precision.max_consecutive_nonfinite=2"])
    proc = run.train("all")
    rows = _rows(run.stage_dir("all"))
    skips = [r["step"] for r in rows if r["scaler_skip"]]
    assert len(skips) > 2, "the test needs more calibration skips in a row than max_consecutive_nonfinite"
    assert skips == list(range(1, len(skips) + 1))  # the first updates, in a row
    assert not any(r["skipped"] for r in rows[len(skips):])
    assert rows[-1]["scaler_skips_total"] == len(skips) == rows[-1]["skipped_total"]
    # each skip halved the scale
    assert [r["loss_scale"] for r in rows[:len(skips)]] == [4e7 / 2**k for k in range(len(skips))]
    assert "GradScaler calibration" in proc.stderr and "non-finite gradient" not in proc.stderr


def test_nan_loss_under_fp16_still_counts_toward_the_abort(tiny_mixed, tmp_path):
    # A NaN gradient is not the scale's fault when the scale is already <= 1.
    run = make_run(tmp_path, tiny_mixed, total=12, single_stage=True,
                   overrides=[*FP16, "precision.init_scale=1.0", "precision.max_consecutive_nonfinite=3"])
    proc = run.train("all", faults={"nan_grad_steps": [2, 3, 4, 5, 6]}, check=False)
    assert proc.returncode == 2
    assert "3 non-finite updates in a row at update 5" in proc.stderr


@pytest.mark.distributed
def test_ranks_agree_to_skip_when_only_one_sees_a_non_finite_gradient(tiny_mixed, tmp_path):
    # Rank 1 alone gets a NaN gradient at update 2; both must skip it, or the stage's final
    # cross-rank weight check fails.
    run = make_run(tmp_path, tiny_mixed, total=4, single_stage=True)
    proc = run.train("all", nproc=2, faults={"nan_grad_steps": [2], "rank": 1})
    assert [r["skipped"] for r in _rows(run.stage_dir("all"))] == [False, False, True, False]
    assert "update 2 skipped: non-finite gradient" in proc.stderr


def test_bf16_autocast_on_cpu_trains(tiny_mixed, tmp_path):
    runs = {}
    for mode in ("bf16", "fp32"):
        runs[mode] = make_run(tmp_path / mode, tiny_mixed, total=4, single_stage=True, overrides=[f"precision.mode={mode}"])
        proc = runs[mode].train("all")
        assert f"precision {mode}" in proc.stdout
    bf16, fp32 = (_rows(runs[m].stage_dir("all")) for m in ("bf16", "fp32"))
    assert not any(r["skipped"] for r in bf16) and "loss_scale" not in bf16[0]  # no GradScaler under bf16
    # the same computation, rounded to bf16 inside: close to fp32, not equal
    assert [r["loss"] for r in bf16] == pytest.approx([r["loss"] for r in fp32], rel=1e-2)
    assert [r["loss"] for r in bf16] != [r["loss"] for r in fp32]
    # The evaluate rule reads the bf16 run's checkpoint: validation loss and greedy decoding under autocast.
    from pipeline import cli

    out = tmp_path / "eval.json"
    assert cli.main(["evaluate", "--checkpoint", str(runs["bf16"].stage_dir("all") / layout.STAGE_CHECKPOINT),
                     "--stage", "all", "--test", str(tiny_mixed["test"]), "--max-test", "2", "--max-new-tokens", "16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["n_test"] == 2 and all(0 < r["loss"] < 20 for r in rows)
