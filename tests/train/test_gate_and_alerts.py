"""The pilot gate stops a pilot that does not learn; a loss spike triggers an alert checkpoint."""

from __future__ import annotations

import json

from trainkit import make_run

from pipeline import layout
from pipeline.errors import UserError
from pipeline.evaluate import gate


def test_pilot_with_zero_lr_fails_the_gate(tiny, tmp_path, capsys):
    run = make_run(tmp_path, tiny, total=20, fraction=0.3, chunks=2, overrides=["optim.lr=0.0"])
    run.train("pilot")
    out = tmp_path / "pilot_report.json"
    args = ["--pilot", str(run.stage_dir("pilot")), "--plan", str(run.plan), "--out", str(out)]
    try:
        gate.main(args)
        raise AssertionError("the gate passed a pilot with lr=0")
    except UserError as err:
        assert err.exit_code == layout.EXIT_GATE
        assert "grads_flowing" in str(err) and "chunks will not start" in str(err)
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["checks"]["grads_flowing"]["ok"] is False
    # the documented override lets the run continue, and still records the failure
    assert gate.main(args + ["--override"]) == 0
    assert json.loads(out.read_text())["override"] is True


def test_healthy_pilot_passes_the_gate(tiny, tmp_path):
    run = make_run(tmp_path, tiny, total=20, fraction=0.3, chunks=2, overrides=["optim.lr=3e-3"])
    run.train("pilot")
    out = tmp_path / "pilot_report.json"
    assert gate.main(["--pilot", str(run.stage_dir("pilot")), "--plan", str(run.plan), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["eta_seconds"] > 0


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
