"""Alerts (a loss spike evaluates and checkpoints; a throughput drop during a checkpoint write is not one);
the TensorBoard mirror."""

from __future__ import annotations

import json

import pytest
from kits.train import make_run

from kits.train import make_run

from pipeline.config import AlertConfig
from pipeline.train.monitor import Alerts


def _warm(tmp_path, n=20):
    alerts = Alerts(AlertConfig(tps_drop_fraction=0.5, loss_spike_sigma=6.0, window=50), tmp_path / "alerts.jsonl",
                    enabled=True, truncate_from=0)
    for step in range(1, n + 1):
        assert alerts.check(step, 2.0 + 0.01 * (step % 3), 1000.0 + step % 5) is None
    return alerts


def test_slow_update_during_a_save_is_not_a_throughput_alert(tmp_path):
    alerts = _warm(tmp_path)
    assert alerts.check(21, 2.01, 200.0, saving=True) is None
    # nor does it drag the median down: the next slow update without a save alerts
    reason = alerts.check(22, 2.01, 200.0)
    assert reason is not None and reason.startswith("throughput drop")
    assert [line for line in (tmp_path / "alerts.jsonl").read_text().splitlines()] and "\"step\": 22" in (
        tmp_path / "alerts.jsonl").read_text()


def test_loss_spike_is_still_caught_during_a_save(tmp_path):
    alerts = _warm(tmp_path)
    reason = alerts.check(21, 50.0, 1000.0, saving=True)
    assert reason is not None and reason.startswith("loss spike")


def test_tensorboard_mirror_holds_each_update_once_after_a_resume(tiny, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = make_run(tmp_path, tiny, total=6, single_stage=True, overrides=["tensorboard=true", "checkpoint.save_every=2"])
    failed = run.train("all", faults={"fail_at_step": 5}, check=False)  # dies after update 5, resumes from 4
    assert failed.returncode == 1
    run.train("all")
    events = EventAccumulator(str(run.stage_dir("all") / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    logged = [e.value for e in events.Scalars("train/loss")]
    rows = [json.loads(x) for x in (run.stage_dir("all") / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx([r["loss"] for r in rows if "loss" in r], rel=1e-6)


def test_loss_spike_triggers_alert_eval_and_checkpoint(tiny, tmp_path):
    run = make_run(tmp_path, tiny, total=16, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["checkpoint.save_every=0"])
    proc = run.train("all", faults={"loss_spike_steps": [12], "fail_at_step": 14}, check=False)
    assert proc.returncode == 1
    assert "ALERT update 13: loss spike" in proc.stderr
    assert "eval at update 13 (alert: loss spike" in proc.stderr
    alert_ckpt = run.scratch("all") / "step_000013"
    assert (alert_ckpt / "MANIFEST.json").is_file()  # with save_every=0, only the alert saved it
    alerts = [json.loads(x) for x in (run.scratch("all") / "alerts.jsonl").read_text().splitlines()]
    # (a throughput alert may follow: the alert's own save shares the CPU with the next update)
    assert [a["step"] for a in alerts if a["alert"].startswith("loss spike")] == [13]
