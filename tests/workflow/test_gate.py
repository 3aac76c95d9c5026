"""A pilot that cannot learn stops the run at the gate: no chunk starts, the message names the check."""

from __future__ import annotations

import shutil

import pytest
import yaml
from kits.run import REPO, copy_workflow, jobs_in_log, snakemake

pytestmark = pytest.mark.workflow


def test_pilot_with_zero_lr_stops_the_run_before_any_chunk(done, tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    # The session run's base model, tokenizer, tokenized data, the base model's benchmark and the label page: the
    # jobs that do not read the learning rate are done. Plan, training and what reads them start over.
    for rel in ("results/embedded", "results/demo/data", "results/demo/tokenizer", "results/demo/eval/bench/base"):
        shutil.copytree(done / rel, workdir / rel)
    (workdir / "results/demo/report").mkdir()
    shutil.copy2(done / "results/demo/report/labels.html", workdir / "results/demo/report/labels.html")
    overrides = yaml.safe_load((REPO / "config/config.yaml").read_text())["train"]["overrides"]
    (workdir / "lr0.yaml").write_text(yaml.safe_dump({"train": {"overrides": [*overrides, "optim.lr=0.0"]}}))

    proc = snakemake(workdir, "--cores", "all", "--configfile", "lr0.yaml")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    trained = [stage for rule, stage in jobs_in_log(log) if rule == "train_stage"]
    assert trained == ["pilot"], trained
    assert not {"validate_dataset", "tokenize_dataset", "benchmark_base"} & {rule for rule, _ in jobs_in_log(log)}
    assert not (workdir / "results/demo/stages/chunk01").exists()
    assert not (workdir / "work/demo/chunk01").exists()
    gate_log = (workdir / "logs/pilot_gate/demo.log").read_text()
    assert "pilot gate: grads_flowing" in gate_log and "FAIL" in gate_log
    error = next(line for line in gate_log.splitlines() if line.startswith("error: pilot gate failed ("))
    assert "grads_flowing" in error.split(")")[0] and "gate.override" in error, error
    # The terminal says why, the cause before any traceback (the failed-run messages of tests/workflow/test_failures.py)
    expect = ["pipeline: pilot-gate failed (exit 77)", "grads_flowing", "gate.override"]
    where = [proc.stderr.find(text) for text in expect]
    assert all(i >= 0 for i in where), proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr[:min(where)], proc.stderr[:min(where) + 500]
