"""A run without a validation or a test set says what it skipped, in the same phrases everywhere.

The phrases (`pipeline.evaluate.skipped`) stand where a measurement would be: the pilot gate's
report (tests/evaluate/test_evaluate_gate.py), the smoke test's JSON and line, and the summary,
gate and overview pages, never a blank table, a NaN or a score of an unreferenced answer.
"""

from __future__ import annotations

import json

from pipeline.evaluate import smoke, summarize
from pipeline.evaluate.skipped import GATE_BASIS, NO_TEST, NO_VAL, skipped_in


def test_smoke_test_without_a_test_set_generates_but_scores_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "export" / "smoke_test.json"
    assert smoke.main(["--model", str(tiny["model"]), "--max-new-tokens", "3", "--out", str(out),
                       "--min-exact-match", "0.9"]) == 0  # nothing to apply the threshold to: not a failure
    result = json.loads(out.read_text())
    assert (result["exact_match"], result["n"], result["skipped"]) == (None, 0, [NO_TEST])
    assert len(result["samples"]) == 1  # the probe prompt was answered: the model loads and generates
    printed = capsys.readouterr().out
    assert f"smoke test: {NO_TEST}" in printed and "--min-exact-match 0.9 not applied" in printed


def test_smoke_line_with_a_test_set_is_the_measurement():
    assert smoke.report_line({"exact_match": 0.5, "n": 4}) == "merged model exact match on 4 held-out prompts: 0.500"
    assert skipped_in(smoke.skipped_result({"exact_match": 0.0, "n": 1, "samples": []})) == [NO_TEST]


def _run(root, with_val: bool, with_test: bool):
    """The files summarize reads, as a run with / without val and test writes them."""
    stage = root / "stages" / "pilot"
    (stage / "checkpoint").mkdir(parents=True)
    (stage / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "lr": 1e-3,
                                                             "step_time_s": 0.1}) + "\n" for s in range(1, 5)))
    (stage / "checkpoint" / "MANIFEST.json").write_text(json.dumps({"created": 0, "step": 4}))
    row = {"weights": "raw", **({"loss": 0.7, "perplexity": 2.0} if with_val else {}),
           **({"exact_match": 0.5, "n_test": 2, "samples": []} if with_test else {})}
    evals = root / "eval" / "pilot.json"
    evals.parent.mkdir(parents=True)
    evals.write_text(json.dumps({"stage": "pilot", "step": 4, "rows": [row], "seconds": 1.0}))
    gate = root / "pilot_report.json"
    gate.write_text(json.dumps({"passed": True, "checks": {}, "judged_on": "training loss",
                                "skipped": [] if with_val else [NO_VAL]}))
    smoke_json = root / "export" / "smoke_test.json"
    smoke_json.parent.mkdir()
    smoke_json.write_text(json.dumps({"exact_match": 0.5, "n": 2, "samples": []} if with_test else
                                     smoke.skipped_result({"exact_match": 0.0, "n": 1, "samples": []})))
    return stage, evals, gate, smoke_json


def _summarize(root, stage, evals, gate, smoke_json) -> dict[str, str]:
    out = root / "report"
    summarize.main(["--eval", str(evals), "--metrics", str(stage), "--smoke", str(smoke_json), "--gate", str(gate),
                    "--export-dir", str(root / "export"), "--out-csv", str(out / "summary.csv"),
                    "--out-loss-plot", str(out / "loss.png"), "--out-eval-plot", str(out / "val_loss.png"),
                    "--out-summary-html", str(out / "summary.html"), "--out-gate-html", str(out / "gate.html"),
                    "--out-overview-html", str(out / "overview.html")])
    return {name: (out / f"{name}.html").read_text() for name in ("summary", "gate", "overview")}


def test_both_skipped_the_pages_say_so(tmp_path, capsys):
    pages = _summarize(tmp_path, *_run(tmp_path, with_val=False, with_test=False))
    assert NO_VAL in pages["summary"] and NO_TEST in pages["summary"] and "not measured" not in pages["summary"]
    assert f"{NO_VAL}; {GATE_BASIS}." in pages["gate"] and "training loss" in pages["gate"]
    assert f"Skipped: {NO_VAL}." in pages["overview"] and f"Skipped: {NO_TEST}." in pages["overview"]
    assert "% of 1 prompts" not in pages["overview"]  # the probe answer is no measurement
    printed = capsys.readouterr().out
    assert f"summary: {NO_VAL}" in printed and f"summary: {NO_TEST}" in printed


def test_each_skipped_alone_and_none_skipped(tmp_path):
    no_val = _summarize(tmp_path / "a", *_run(tmp_path / "a", with_val=False, with_test=True))
    assert NO_VAL in no_val["summary"] and NO_TEST not in no_val["summary"] and "50.0%" in no_val["summary"]
    no_test = _summarize(tmp_path / "b", *_run(tmp_path / "b", with_val=True, with_test=False))
    assert NO_TEST in no_test["summary"] and NO_VAL not in no_test["summary"] and "0.7" in no_test["summary"]
    both = _summarize(tmp_path / "c", *_run(tmp_path / "c", with_val=True, with_test=True))
    assert all(NO_VAL not in page and NO_TEST not in page for page in both.values())
    assert "Skipped:" not in both["overview"]
