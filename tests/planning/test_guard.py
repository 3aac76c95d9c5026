"""A changed config meets a finished run (pipeline/planning/guard.py): what counts as a change, what
the stop message names, and what `archive` moves and keeps. The workflow's use of it:
tests/workflow/test_config_guard.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import config as train_config
from pipeline.planning import guard
from pipeline.planning.schedule import plan_stages

CONF = Path(__file__).resolve().parents[2] / "config" / "train"
BASE = ["model.path=results/embedded/model", "tokens.train_cache=results/demo/data/train.safetensors",
        "ema.rates=[0.9,0.98]", "optim.lr=2e-3"]
STAGES = plan_stages(300, 0.05, 2)


def _cfg(*overrides: str) -> train_config.TrainConfig:
    return train_config.resolve(CONF, "config", [*BASE, *overrides])


def _trained_run(root: Path, cfg, stages=STAGES, done=("pilot", "chunk01")) -> Path:
    """results/demo as a plan and finished stages leave it, with shared work beside them."""
    run = root / "results/demo"
    run.mkdir(parents=True)
    for name in done:
        (run / "stages" / name / "checkpoint").mkdir(parents=True)
        (run / "stages" / name / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "train_config.yaml").write_text(train_config.to_yaml(cfg))
    (run / "plan.json").write_text(json.dumps({"total_updates": stages[-1].end,
                                               "stages": [vars(s) for s in stages]}))
    for rel in ("data/train.safetensors", "tokenizer/tokenizer.json", "model.json", "eval/base.json",
                "eval/pilot.json", "report/labels.html", "report/summary.html", "export/adapter_final/x",
                "pilot_report.json", "variants/a/plan.json", "sweep/best.json", "tracker/run.json",
                "eval/bench/base/mmlu.json", "eval/bench/cache/k.json", "eval/bench/merged/mmlu.json",
                "eval/benchmarks.csv"):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(rel)
    return run


def test_values_not_text_a_comment_or_equal_value_is_no_change():
    cfg = _cfg()
    text = train_config.to_yaml(cfg)
    assert guard.config_changes(text, _cfg("optim.lr=0.002")) == []
    changes = guard.config_changes(text, _cfg("optim.lr=1e-3", "lora.r=8"))
    assert [str(c) for c in changes] == ["lora.r: 16 -> 8", "optim.lr: 0.002 -> 0.001"]


def test_a_key_one_side_lacks_and_a_reordered_text_are_changes():
    cfg = _cfg()
    text = train_config.to_yaml(cfg)
    assert [str(c) for c in guard.config_changes(text.replace("seed: 0\n", ""), cfg)] == ["seed: (not set) -> 0"]
    reordered = text.replace("seed: 0\n", "") + "seed: 0\n"  # same values: Snakemake would still re-plan
    assert [c.key for c in guard.config_changes(reordered, cfg)] == ["(layout)"]


def test_a_run_with_nothing_trained_is_never_stopped(tmp_path):
    run = _trained_run(tmp_path, _cfg(), done=())
    assert guard.check("demo", "run demo", _cfg("optim.lr=1e-3"), STAGES, results=tmp_path / "results",
                       work=tmp_path / "work") is None
    assert run.is_dir()


def test_changed_config_and_schedule_are_named_with_what_was_trained(tmp_path):
    _trained_run(tmp_path, _cfg())
    (tmp_path / "work/demo/chunk02/step_000050").mkdir(parents=True)  # a stage that died halfway
    kw = dict(results=tmp_path / "results", work=tmp_path / "work")
    assert guard.check("demo", "run demo", _cfg(), STAGES, **kw) is None
    changed = guard.check("demo", "run demo", _cfg("optim.lr=1e-3"), plan_stages(40, 0.05, 2), **kw)
    assert changed.trained == ["pilot", "chunk01", "chunk02 (in progress)"]  # plan order, not sorted
    assert [str(c) for c in changed.changes] == [
        "optim.lr: 0.002 -> 0.001",
        "schedule: pilot:15 + chunk01:142 + chunk02:142 + tail:1 = 300 updates -> "
        "pilot:2 + chunk01:19 + chunk02:19 = 40 updates"]
    message = guard.stop_message([changed])
    for text in ("run demo in results/demo, trained pilot, chunk01, chunk02 (in progress)", "optim.lr: 0.002 -> 0.001", "run:", "on_config_change: archive",
                 "results/<run>/archive/"):
        assert text in message, message


def test_archive_moves_what_the_old_config_made_and_keeps_the_shared_work(tmp_path):
    run = _trained_run(tmp_path, _cfg())
    (tmp_path / "work/demo/chunk02/step_000050").mkdir(parents=True)
    changed = guard.check("demo", "run demo", _cfg("optim.lr=1e-3"), STAGES, results=tmp_path / "results",
                          work=tmp_path / "work")
    name = guard.archive_name(changed, now=0)
    assert name == f"19700101T000000Z-{changed.old_id[:8]}"
    dest = guard.archive(changed, name, results=tmp_path / "results", work=tmp_path / "work")
    assert dest == run / "archive" / name
    kept = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file() and "archive" not in p.parts)
    assert kept == ["data/train.safetensors", "eval/base.json", "eval/bench/base/mmlu.json", "eval/bench/cache/k.json",
                    "model.json", "report/labels.html", "sweep/best.json", "tokenizer/tokenizer.json",
                    "variants/a/plan.json"]
    moved = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert moved == ["ARCHIVED.json", "eval/bench/merged/mmlu.json", "eval/benchmarks.csv", "eval/pilot.json",
                     "export/adapter_final/x", "pilot_report.json", "plan.json", "report/summary.html",
                     "stages/chunk01/metrics.jsonl", "stages/pilot/metrics.jsonl", "tracker/run.json",
                     "train_config.yaml"]
    assert (dest / "work/chunk02/step_000050").is_dir() and not (tmp_path / "work/demo/chunk02").exists()
    record = json.loads((dest / "ARCHIVED.json").read_text())
    assert record["changes"] == [{"key": "optim.lr", "old": "0.002", "new": "0.001"}]
    # Nothing trained is left in the run: the guard has nothing more to stop.
    assert guard.check("demo", "run demo", _cfg("optim.lr=1e-3"), STAGES, results=tmp_path / "results",
                       work=tmp_path / "work") is None
    with pytest.raises(FileExistsError):  # an archive is never overwritten
        guard.archive(changed, name, results=tmp_path / "results", work=tmp_path / "work")
