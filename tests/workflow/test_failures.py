"""When something goes wrong, the terminal says why: one snakemake run per kind of failure.

Each case takes a copy of the session's default run, breaks one thing, runs
`snakemake --cores all` as a user would, and checks what the terminal shows:
the cause and the key, file or record it names, before any Python traceback.
Snakemake prints errors found while loading the workflow (config problems) on
stdout and a failed job's output on stderr; both are the user's terminal, and
the job-time cases check stderr alone.
"""

from __future__ import annotations

import csv
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from kits.run import copy_run, jobs_in_log

pytestmark = pytest.mark.workflow


@dataclass
class Case:
    name: str
    config: dict = field(default_factory=dict)  # merged into config/config.yaml
    expect: list[str] = field(default_factory=list)  # on the terminal, in this order of appearance
    at_load: bool = False  # refused while the workflow loads: no job runs
    env: dict | None = None
    prepare: object = None  # fn(workdir) -> None: what else to break


def _not_a_model(run: Path) -> None:
    (run / "not_a_model").mkdir()
    (run / "not_a_model" / "weights.txt").write_text("no config.json here\n")


def _malformed_dataset(run: Path) -> None:
    lines = [
        '{"id": "a", "conversations": [{"from": "human", "value": "repeat: alpha"}, {"from": "gpt", "value": "alpha"}]}',
        '{"id": "b", "conversations": [{"from": "human", "value": "repeat: bravo"}, {"from": "gpt", "value": ""}]}',
        '{"id": "c", "conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "hi"}]}',
    ]
    (run / "bad.jsonl").write_text("\n".join(lines) + "\n")


def _tail_crashes(run: Path) -> None:
    shutil.rmtree(run / "results/demo/stages/tail")


def _corrupt_final_checkpoint(run: Path) -> None:
    weights = run / "results/demo/stages/tail/checkpoint/adapter/adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    shutil.rmtree(run / "results/demo/export/adapter_final")  # consolidate runs again and reads it


CASES = [
    Case("unknown config key", {"trian": {"nproc": 2}}, ["trian: unknown key"], at_load=True),
    Case("wrong value type", {"schedule": {"total_updates": "many"}},
         ["schedule.total_updates: 'many' is not of type 'integer'"], at_load=True),
    Case("missing data file", {"data": {"train": "data/missing.jsonl"}},
         ["data.train: data/missing.jsonl does not exist"], at_load=True),
    Case("model path that is not a model", {"model": "not_a_model"},
         ["model: not_a_model is a directory but not a Hugging Face model (no config.json)"], at_load=True,
         prepare=_not_a_model),
    Case("export.ema_rate not in ema.rates", {"export": {"ema_rate": 0.5}},
         ["export.ema_rate=0.5 is not one of the trainer's ema.rates=[0.9, 0.98]"], at_load=True),
    Case("unknown trainer key", {"train": {"overrides": ["optim.lrr=1"]}}, ["optim.lrr"], at_load=True),
    # A malformed dataset: test_a_failed_validation_leaves_the_report_it_names (one run, its terminal and report).
    # A failed pilot gate: tests/workflow/test_gate.py (its one run checks the terminal too).
    Case("training stage that crashes", env={"SFT_FAULTS": '{"stage": "tail", "fail_at_step": 299}'},
         expect=["pipeline: train failed (exit 1)", "injected failure at update 299"], prepare=_tail_crashes),
    Case("corrupt stage checkpoint at consolidate", expect=[
        "pipeline: consolidate failed (exit 2)", "stages/tail/checkpoint/adapter/adapter_model.safetensors",
        "does not match its sha256"], prepare=_corrupt_final_checkpoint),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_terminal_says_why(case, done, run_snakemake, tmp_path):
    run = copy_run(done, tmp_path / "run")
    if case.prepare:
        case.prepare(run)
    (run / "variant.yaml").write_text(yaml.safe_dump(case.config))
    proc = run_snakemake(run, "--cores", "all", "--configfile", "variant.yaml", env=case.env)
    shown = proc.stdout + proc.stderr if case.at_load else proc.stderr
    assert proc.returncode != 0
    where = [shown.find(text) for text in case.expect]
    assert all(i >= 0 for i in where), f"missing {[t for t, i in zip(case.expect, where) if i < 0]}:\n{shown[-4000:]}"
    assert "Traceback" not in shown[:min(where)], shown[:min(where) + 500]  # the cause comes first
    if case.at_load:
        assert jobs_in_log(proc.stdout + proc.stderr) == []  # refused before any job


def test_a_failed_validation_leaves_the_report_it_names(done, run_snakemake, tmp_path):
    run = copy_run(done, tmp_path / "run")
    _malformed_dataset(run)
    (run / "variant.yaml").write_text(yaml.safe_dump({"data": {"train": "bad.jsonl"}}))
    proc = run_snakemake(run, "--cores", "all", "--configfile", "variant.yaml")
    assert proc.returncode != 0
    expect = ["pipeline: validate failed (exit 3)", "bad.jsonl (JSON Lines) record 1 (line 2, id 'b')", "empty_text",
              "bad.jsonl (JSON Lines) record 2 (line 3, id 'c')", "unknown_role", "full report:"]
    where = [proc.stderr.find(text) for text in expect]
    assert all(i >= 0 for i in where), proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr[:min(where)]
    json_path, csv_path = re.search(r"full report: (\S+) and (\S+)", proc.stderr).groups()
    assert not (run / "results/demo/data/train/train/validation.csv").exists()  # snakemake removed the job's outputs
    with open(run / csv_path) as f:
        rows = list(csv.DictReader(f))
    assert {(r["index"], r["reason"]) for r in rows} == {("1", "empty_text"), ("2", "unknown_role")}
    assert (run / json_path).is_file()
