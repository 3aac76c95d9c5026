"""Standard benchmarks in the DAG (evaluate.benchmarks): the embedded default scores its base and merged
models on the demo's multiple-choice task (the session's default run, `done`); adding a task schedules
its jobs alone; a task whose data is not cached stops snakemake before any job. Retraining reschedules
the trained weights' benchmarks: tests/workflow/test_pipeline.py (the chunk deleted and retrained)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from kits.run import copy_workflow, jobs_with_wildcards

pytestmark = pytest.mark.workflow
RUN = "results/demo"
TASK = "repeat_choice"


def test_the_default_run_scores_base_and_merged_and_reports_both_with_stderr(done):
    base = json.loads((done / RUN / "eval/bench/base" / f"{TASK}.json").read_text())
    merged = json.loads((done / RUN / "eval/bench/merged" / f"{TASK}.json").read_text())
    assert (base["weights"], merged["weights"]) == ("base", "merged") and not base["cached"] and not merged["cached"]
    for weights in ("base", "merged"):  # one job each
        assert (done / "logs/benchmark/demo" / weights / f"{TASK}.log").is_file()
    assert base["chat_template_applied"] and base["scores"][0]["n"] == 64
    # The table: the fine-tune's gain on the demo's skill, far beyond its (paired) standard error.
    (row,) = pd.read_csv(done / RUN / "eval/benchmarks.csv").itertuples()
    assert (row.task, row.metric, row.weights, row.stderr_kind) == (TASK, "acc", "merged", "paired")
    assert row.base <= 0.5 and row.final >= 0.9 and row.delta > 4 * row.delta_stderr > 0, row
    assert row.base_stderr > 0 and row.final_stderr >= 0
    # summary.csv: both scores, each with its standard error, the merged one with the difference.
    summary = pd.read_csv(done / RUN / "eval/summary.csv")
    rows = summary[summary["stage"] == "benchmark"].set_index("weights")
    assert list(rows.index) == ["base", "merged"] and (rows["task"] == TASK).all() and (rows["metric"] == "acc").all()
    assert rows.loc["base", "score"] == pytest.approx(row.base) and rows.loc["merged", "score"] == pytest.approx(row.final)
    assert rows.loc["base", "stderr"] == pytest.approx(row.base_stderr) and rows["stderr"].notna().all()
    assert rows.loc["merged", "delta_stderr"] == pytest.approx(row.delta_stderr)
    # The report's pages: the benchmark page and the summary's table, both with the standard errors.
    for page in ("report/benchmarks.html", "report/summary.html"):
        text = (done / RUN / page).read_text()
        assert f"{row.base:.4f} <small>± {row.base_stderr:.4f}</small>" in text, page
        assert f"{row.final:.4f} <small>± {row.final_stderr:.4f}</small>" in text, page
    assert (done / RUN / "eval/benchmarks.png").read_bytes()[:4] == b"\x89PNG"
    card = (done / RUN / "export/merged/README.md").read_text()
    assert "## Benchmarks" in card and f"| {TASK} | acc | 64 |" in card
    assert card.index("## Benchmarks") < card.index("## How to use")


def test_adding_a_task_to_the_finished_run_schedules_only_its_jobs(done, run_snakemake, tmp_path):
    """Its two benchmark jobs (base, merged) and the tables that show it; no other task is scored again,
    nothing is trained or evaluated."""
    docs = tmp_path / "rot.jsonl"
    docs.write_text("".join(json.dumps({"word": w, "choices": [w, w[::-1]], "answer": 0}) + "\n" for w in ("abc", "xyz")))
    task = tmp_path / "rot.yaml"
    task.write_text(f"task: rot_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: 'repeat: {{word}}'\n"
                    "doc_to_choice: choices\ndoc_to_target: answer\n")
    tasks = json.dumps({"benchmarks": {"tasks": ["embedded", str(task)]}})
    dry = run_snakemake(done, "-n", "--cores", "all", "--config", f"evaluate={tasks}")
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = jobs_with_wildcards(dry.stdout + dry.stderr)
    scored = {(rule, wc.get("weights", "base"), wc["task"]) for rule, wc in jobs if rule.startswith("benchmark") and
              "task" in wc}
    assert scored == {("benchmark_base", "base", "rot_choice"), ("benchmark", "merged", "rot_choice")}, jobs
    assert {rule for rule, _ in jobs} == {"benchmark_base", "benchmark", "benchmark_report", "benchmark_card", "summarize"}


def test_a_task_whose_data_is_not_cached_stops_before_any_job(tmp_path, run_snakemake):
    workdir = copy_workflow(tmp_path / "wf")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}
    tasks = json.dumps({"benchmarks": {"tasks": ["embedded", "arc_easy"]}})
    proc = run_snakemake(workdir, "-n", "--cores", "1", "--config", f"evaluate={tasks}", env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and jobs_with_wildcards(output) == [], output[-3000:]
    lines = [line for line in output.splitlines() if "arc_easy" in line]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("evaluate.benchmarks: task arc_easy: its data is not in the local Hugging Face "
                               "datasets cache") and lines[0].endswith("python -m pipeline fetch-benchmarks arc_easy")
