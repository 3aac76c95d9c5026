"""The benchmark table (pipeline/evaluate/bench_table.py), its page and plot, summary.csv's rows, the model
cards' section and the tracker's metrics (each once), from benchmark job records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from pipeline.evaluate import bench_report, bench_table
from pipeline.export import card


def record(weights: str, task: str, docs: list[float], *, key: str = "k" * 64, group_value: float | None = None,
           stderr: float | None = None) -> dict:
    """A benchmark job's record of one task scored on `docs` (acc per document), as benchmarks.py writes it."""
    mean = sum(docs) / len(docs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in docs) / (len(docs) - 1))
    return {"task": task, "weights": weights, "key": key, "lm_eval": "0.4.13", "num_fewshot": None, "limit": None,
            "chat_template_applied": True,
            "scores": [{"task": task, "metric": "acc", "filter": "none", "label": "acc",
                        "value": mean if group_value is None else group_value,
                        "stderr": sd / math.sqrt(len(docs)) if stderr is None else stderr, "n": len(docs),
                        "higher_is_better": True}],
            "leaves": {task: [task]}, "docs": {task: {"acc": {str(i): v for i, v in enumerate(docs)}}}}


BASE = [0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 1]
FINAL = [1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1]


def write(root: Path, *records: dict) -> list[Path]:
    paths = []
    for r in records:
        path = root / r["weights"] / f"{r['task']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
        paths.append(path)
    return paths


def test_the_difference_is_paired_over_the_same_documents(tmp_path):
    """sd(final_i - base_i) / sqrt(n), not the independent sqrt(se_b^2 + se_f^2), where the score is the
    mean of the documents'; the independent one where it is not (a metric aggregated otherwise)."""
    records = bench_table.load(write(tmp_path, record("base", "t", BASE), record("merged", "t", FINAL)))
    row = bench_table.table(records, ["base", "merged"]).iloc[0]
    d = [f - b for f, b in zip(FINAL, BASE)]
    mean = sum(d) / len(d)
    paired = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) / math.sqrt(len(d))
    assert (row.weights, row.stderr_kind) == ("merged", "paired")
    assert row.delta == pytest.approx(sum(FINAL) / 12 - sum(BASE) / 12) and row.delta_stderr == pytest.approx(paired)
    independent = math.hypot(row.base_stderr, row.final_stderr)
    assert row.delta_stderr < independent  # the same questions: most of the noise cancels
    other = bench_table.table({("base", "t"): record("base", "t", BASE, group_value=0.5, stderr=0.1),
                               ("merged", "t"): record("merged", "t", FINAL)}, ["base", "merged"]).iloc[0]
    assert other.stderr_kind == "independent"
    assert other.delta_stderr == pytest.approx(math.hypot(0.1, other.final_stderr))


def test_csv_summary_rows_page_and_plot(tmp_path):
    paths = write(tmp_path / "bench", record("base", "t", BASE), record("merged", "t", FINAL),
                  record("adapter_ema", "t", FINAL))
    out = tmp_path / "run"
    assert bench_report.main(["--results", *map(str, paths), "--weights", "base", "merged", "adapter_ema",
                              "--run", "demo", "--out-csv", str(out / "eval/benchmarks.csv"),
                              "--out-plot", str(out / "eval/benchmarks.png"),
                              "--out-html", str(out / "report/benchmarks.html")]) == 0
    bench = pd.read_csv(out / "eval/benchmarks.csv")
    assert list(bench["weights"]) == ["merged", "adapter_ema"] and list(bench.columns) == bench_table.COLUMNS
    assert bench[["base_stderr", "final_stderr", "delta_stderr"]].notna().all().all()
    rows = bench_table.summary_rows(out / "eval/benchmarks.csv", last_update=300)
    assert list(rows["weights"]) == ["base", "merged", "adapter_ema"] and list(rows["step"]) == [0, 300, 300]
    assert rows["stderr"].notna().all() and rows.loc[0, "score"] == pytest.approx(sum(BASE) / 12)
    assert pd.isna(rows.loc[0, "delta"]) and rows.loc[1, "delta"] == pytest.approx(bench.loc[0, "delta"])
    page = (out / "report/benchmarks.html").read_text()
    assert "lm-evaluation-harness 0.4.13" in page and 'class="pass"' in page and "data:image/png;base64," in page
    assert f"{sum(BASE) / 12:.4f} <small>± {bench.loc[0, 'base_stderr']:.4f}</small>" in page
    assert (out / "eval/benchmarks.png").read_bytes()[:4] == b"\x89PNG"
    summary = bench_table.into_page("<html><body><h1>Evaluation</h1></body></html>", out / "eval/benchmarks.csv")
    assert summary.index("<h1>Evaluation</h1>") < summary.index("Benchmarks (lm-eval") < summary.index("</body>")


def test_the_model_card_gets_its_own_weights_scores_once(tmp_path):
    merged, ema = tmp_path / "merged", tmp_path / "adapter_ema"
    for d in (merged, ema):
        d.mkdir()
        (d / card.CARD_FILE).write_text(f"# {d.name}\n\n## Evaluation\n\nrows\n\n## How to use\n\ncode\n")
    (tmp_path / "adapter_final").mkdir()  # no card: left alone
    records = {("base", "t"): record("base", "t", BASE), ("merged", "t"): record("merged", "t", FINAL),
               ("adapter_ema", "t"): record("adapter_ema", "t", BASE)}
    bench_table.table(records, ["base", "merged", "adapter_ema"]).to_csv(tmp_path / "b.csv", index=False)
    args = ["--table", str(tmp_path / "b.csv"), "--dirs", str(merged), str(ema), str(tmp_path / "adapter_final"),
            "--out", str(tmp_path / "benchmarks.md")]
    for _ in range(2):  # a second report replaces the section, it does not add one
        assert card.main_benchmarks(args) == 0
    text = (merged / card.CARD_FILE).read_text()
    assert text.count("## Benchmarks") == 1 and text.index("## Evaluation") < text.index("## Benchmarks") < \
        text.index("## How to use")
    assert f"| t | acc | 12 | default | yes | {sum(BASE) / 12:.4g} ± " in text
    assert f"| {sum(FINAL) / 12:.4g} ± " in text and f"| {sum(BASE) / 12:.4g} ± " in (ema / card.CARD_FILE).read_text()
    assert not (tmp_path / "adapter_final" / card.CARD_FILE).exists()
    assert (tmp_path / "benchmarks.md").read_text().count("## Benchmarks") == 2


def test_the_tracker_gets_each_score_once(tmp_path, monkeypatch):
    """bench/<task>/<metric>: the base model's at update 0, the final (merged) weights' at the run's last
    update; another trained set under its name. A report that runs again sends nothing twice; new scores
    (another content key) are sent."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("PIPELINE_TRACKER_KIND", "mlflow")
    monkeypatch.setenv("PIPELINE_TRACKER_URI", uri)
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"total_updates": 300}))
    (run / "train_config.yaml").write_text("seed: 0\n")
    records = {("base", "t"): record("base", "t", BASE), ("merged", "t"): record("merged", "t", FINAL),
               ("adapter_ema", "t"): record("adapter_ema", "t", FINAL)}
    for _ in range(2):
        bench_report._tracker(run, records, ["base", "merged", "adapter_ema"])
    records[("merged", "t")] = record("merged", "t", BASE, key="n" * 64)
    bench_report._tracker(run, records, ["base", "merged", "adapter_ema"])
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run_id = json.loads((run / "tracker" / "run.json").read_text())["run_id"]
    history = {name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)]
               for name in ("bench/t/acc", "bench/adapter_ema/t/acc")}
    assert sorted(history["bench/t/acc"]) == [(0, pytest.approx(sum(BASE) / 12)), (300, pytest.approx(sum(BASE) / 12)),
                                              (300, pytest.approx(sum(FINAL) / 12))]
    assert history["bench/adapter_ema/t/acc"] == [(300, pytest.approx(sum(FINAL) / 12))]
