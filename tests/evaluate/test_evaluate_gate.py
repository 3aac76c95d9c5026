"""The pilot gate stops a pilot that does not learn, and lets a healthy one through."""

from __future__ import annotations

import json

from kits.train import make_run

from pipeline import layout
from pipeline.errors import UserError
from pipeline.evaluate import gate
from pipeline.evaluate.skipped import GATE_BASIS, NO_VAL


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
    assert report["judged_on"] == "training loss" and report["skipped"] == []


def test_pilot_without_validation_set_is_gated_on_training_loss_and_says_so(tiny, tmp_path, capsys):
    """data.val: null -> tokens.val_cache null: the same checks pass, and the report names what was skipped."""
    run = make_run(tmp_path, tiny, total=20, fraction=0.3, chunks=2,
                   overrides=["optim.lr=3e-3", "tokens.val_cache=null"])
    run.train("pilot")
    out = tmp_path / "pilot_report.json"
    assert gate.main(["--pilot", str(run.stage_dir("pilot")), "--plan", str(run.plan), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["judged_on"] == "training loss" and report["skipped"] == [NO_VAL]
    assert f"pilot gate: {NO_VAL}; {GATE_BASIS}" in capsys.readouterr().out
