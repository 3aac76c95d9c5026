"""The report's pages from summarize: in-stage evaluations, stage durations, exports, samples."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from pipeline.evaluate import overview, plots, tables


def _stage(root: Path, name: str, steps: range, evals: dict[int, dict], created: float) -> Path:
    stage = root / "stages" / name
    (stage / "checkpoint").mkdir(parents=True)
    lines = []
    for step in steps:
        lines.append({"step": step, "loss": 1.0 / step, "lr": 1e-3, "step_time_s": 0.5})
        if step in evals:
            lines.append({"step": step, "event": "eval", "kind": "full", "seconds": 2.0,
                          **{f"val_{k}": v for k, v in evals[step].items()}})
    lines.append({"step": steps[-1], "event": "eval", "kind": "quick", "seconds": 0.1, "val_raw": 99.0})
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (stage / "checkpoint" / "MANIFEST.json").write_text(json.dumps({"created": created, "step": steps[-1]}))
    return stage


def _eval(root: Path, stage: str, step: int, answers: dict[str, list[str]]) -> Path:
    prompts = ["say <b>", "say a&b"]
    refs = ["<b>", "a&b"]
    rows = [{"weights": w, "loss": 0.5, "exact_match": sum(a == r for a, r in zip(ans, refs)) / 2, "n_test": 2,
             "samples": [{"prompt": p, "answer": a, "reference": r, "match": a == r}
                         for p, a, r in zip(prompts, ans, refs)]} for w, ans in answers.items()]
    path = root / "eval" / f"{stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stage": stage, "step": step, "rows": rows, "seconds": 3.0}))
    return path


def test_in_stage_evals_full_only_last_of_a_repeated_step(tmp_path):
    a = _stage(tmp_path, "pilot", range(1, 5), {2: {"raw": 3.0, "ema_0.9": 4.0}}, 0)
    b = _stage(tmp_path, "chunk01", range(5, 11), {6: {"raw": 2.0, "ema_0.9": 2.5}, 10: {"raw": 1.0, "ema_0.9": 1.5}}, 0)
    # a resumed attempt evaluated update 6 again: the last record counts
    with (b / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 6, "event": "eval", "kind": "full", "val_raw": 1.9, "val_ema_0.9": 2.4}) + "\n")
    frame = tables.in_stage_evals([a, b])
    got = {(r.step, r.weights): r.loss for r in frame.itertuples()}
    assert got == {(2, "raw"): 3.0, (2, "ema_0.9"): 4.0, (6, "raw"): 1.9, (6, "ema_0.9"): 2.4,
                   (10, "raw"): 1.0, (10, "ema_0.9"): 1.5}


def test_loss_plot_with_in_stage_points(tmp_path):
    a = _stage(tmp_path, "pilot", range(1, 5), {2: {"raw": 3.0, "ema_0.9": 4.0}}, 0)
    e = _eval(tmp_path, "pilot", 4, {"raw": ["<b>", "x"], "ema_0.9": ["<b>", "a&b"]})
    table = tables.summary_table([e], None)
    curve, bounds = tables.training_curve([a])
    out = tmp_path / "loss.png"
    plots.plot_loss(curve, bounds, table, out, in_stage=tables.in_stage_evals([a]))
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_stage_rows_durations_from_benchmarks_and_metrics(tmp_path):
    a = _stage(tmp_path, "pilot", range(1, 5), {2: {"raw": 3.0}}, 1_700_000_000)
    b = _stage(tmp_path, "chunk01", range(5, 11), {}, 1_700_000_100)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "pilot.tsv").write_text("s\th:m:s\tmax_rss\n12.5\t0:00:12\t500\n")  # chunk01's is missing
    evals = [_eval(tmp_path, "pilot", 4, {"raw": ["<b>", "x"]})]
    rows = tables.stage_rows([a, b], evals, [("pilot", 0, 4), ("chunk01", 4, 10)], bench)
    assert [(r["stage"], r["first"], r["last"], r["updates"]) for r in rows] == [("pilot", 1, 4, 4),
                                                                                 ("chunk01", 5, 10, 6)]
    assert rows[0]["wall_s"] == 12.5 and rows[1]["wall_s"] is None
    assert rows[0]["update_s"] == 2.0 and rows[1]["update_s"] == 3.0
    assert rows[0]["eval_s"] == 2.1 and rows[0]["stage_eval_s"] == 3.0 and rows[1]["stage_eval_s"] is None
    page = overview.stage_table_html(rows)
    assert ">12 s<" in page and "&ge; 12 s" in page and "2023-11-14 22:13:20" in page and "all stages" in page


def test_samples_page_side_by_side_and_escaped(tmp_path):
    evals = [_eval(tmp_path, "base", 0, {"base": ["", ""]}),
             _eval(tmp_path, "pilot", 4, {"raw": ["<b>", "<script>x</script>"], "ema_0.9": ["<b>", "a&b"]})]
    page = overview.samples_html(evals, "demo")
    assert "<script>x" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    assert "before training (base model)" in page and "after pilot" in page
    assert ">raw answer</th>" in page and ">ema_0.9 answer</th>" in page
    # one row per prompt: prompt, reference, then each weight set's answer, matches marked
    row = page.split("<code>say a&amp;b</code>")[-1].split("</tr>")[0]  # the pilot table's row
    assert row.index("&lt;script&gt;") < row.index('class="l pass"')
    assert 'class="l fail"' in row


def test_overview_embeds_the_plot_and_lists_exports(tmp_path):
    png = tmp_path / "loss.png"
    png.write_bytes(b"\x89PNG fake")
    export = tmp_path / "export"
    (export / "adapter_final").mkdir(parents=True)
    (export / "merged").mkdir()
    (export / "verification.json").write_text(json.dumps({"passed": True, "max_abs_diff": 1e-5, "tolerance": 1e-3,
                                                          "probes": 4}))
    (export / "smoke_test.json").write_text(json.dumps({"exact_match": 0.75, "n": 8}))
    exports = overview.export_html(export, export / "smoke_test.json", export / "verification.json")
    assert exports.count(">written</td>") == 2 and exports.count(">absent</td>") == 3
    assert "75.0% of 8 prompts" in exports and "passed" in exports
    sets = tables.sample_sets([_eval(tmp_path, "tail", 9, {"raw": ["<b>", "a&b"]})])
    page = overview.overview_html(png, [], exports, sets, "demo")
    assert f'src="data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}"' in page
    assert 'id="sft-overview"' in page and "Samples after tail" in page
