"""Nothing trained is lost without the user asking (pipeline/planning/guard.py in the workflow).

A changed trainer config on a finished run stops `snakemake` while the workflow
loads, naming the key, and leaves every file of the run as it was; with
`on_config_change: archive` a dry run still changes nothing, and a real run moves
the old stages aside (readable there) before the new plan is written. Each test
takes a copy of the session's finished default run (`done`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kits.run import copy_run, jobs_in_log, sha256

pytestmark = pytest.mark.workflow

RUN = "results/demo"
STAGES = ["pilot", "chunk01", "chunk02", "tail"]


def _files(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under root: its sha256 and mtime."""
    return {p.relative_to(root).as_posix(): (sha256(p), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _change_lr(run: Path) -> None:
    config = run / "config/config.yaml"
    text = config.read_text()
    assert "optim.lr=2e-3" in text
    config.write_text(text.replace("optim.lr=2e-3", "optim.lr=1e-3"))


def test_a_changed_lr_stops_at_load_naming_the_key_and_changes_nothing(done, run_snakemake, tmp_path):
    run = copy_run(done, tmp_path / "run")
    before = _files(run / RUN)
    _change_lr(run)
    proc = run_snakemake(run, "--cores", "all")
    shown = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for text in ("run demo in results/demo, trained pilot, chunk01, chunk02, tail", "optim.lr: 0.002 -> 0.001",
                 "new `run:` name", "on_config_change: archive"):
        assert text in shown, shown[-4000:]
    assert jobs_in_log(shown) == []
    assert _files(run / RUN) == before

    # A dry run with the archive setting says what it would do and moves nothing.
    dry = run_snakemake(run, "-n", "--cores", "all", "--config", "on_config_change=archive")
    shown = dry.stdout + dry.stderr
    assert dry.returncode == 0, shown[-4000:]
    assert sorted(stage for rule, stage in jobs_in_log(shown) if rule == "train_stage") == sorted(STAGES)
    assert "when the run starts (not on a dry run)" in shown
    assert not (run / RUN / "archive").exists() and _files(run / RUN) == before


def test_archive_moves_the_old_stages_aside_readable_and_writes_the_new_plan(done, run_snakemake, tmp_path):
    from pipeline import config as train_config
    from pipeline.checkpoint.reader import open_checkpoint

    run = copy_run(done, tmp_path / "run")
    shared = {rel: sha256(run / RUN / rel) for rel in ("data/train/train/train.safetensors", "tokenizer/tokenizer.json",
                                                       "eval/base.json", "eval/bench/base/repeat_choice.json")}
    old_tail = sha256(run / RUN / "stages/tail/checkpoint/adapter/adapter_model.safetensors")
    _change_lr(run)
    proc = run_snakemake(run, f"{RUN}/plan.json", "--cores", "1", "--config", "on_config_change=archive")
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 0, shown[-4000:]
    assert jobs_in_log(shown) == [("plan", None)]

    (archive,) = (run / RUN / "archive").iterdir()
    for stage in STAGES:
        checkpoint = archive / "stages" / stage / "checkpoint"
        assert (checkpoint / "MANIFEST.json").is_file()
        open_checkpoint(checkpoint, verify=True)  # every file matches its sha256
        metrics = [json.loads(line) for line in (archive / "stages" / stage / "metrics.jsonl").read_text().splitlines()]
        assert any("loss" in m for m in metrics)
    assert sha256(archive / "stages/tail/checkpoint/adapter/adapter_model.safetensors") == old_tail
    assert (archive / "export/adapter_final").is_dir() and (archive / "eval/tail.json").is_file()
    assert (archive / "eval/bench/merged/repeat_choice.json").is_file()  # the trained weights' scores go with them
    assert train_config.load(archive / "train_config.yaml").optim.lr == 0.002
    assert train_config.load(run / RUN / "train_config.yaml").optim.lr == 0.001
    assert (run / RUN / "plan.json").is_file() and not (run / RUN / "stages").exists()
    assert {rel: sha256(run / RUN / rel) for rel in shared} == shared  # the shared work stayed
