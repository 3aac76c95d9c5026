"""The run's evaluations and stage metrics as tables: what `summarize` plots and pages show.

Reads eval/<stage>.json (one row per weight set: loss, perplexity, exact match),
each stage's metrics.jsonl (per-update loss and learning rate, in-stage
evaluations, timings), plan.json (stage windows) and Snakemake's per-job
benchmark TSVs; no plotting, no HTML.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from pipeline import layout
from pipeline.evaluate.skipped import skipped_in


COLUMNS = ["stage", "step", "weights", "loss", "perplexity", "exact_match", "n_test"]


def skipped(gate: Path | dict | None, smoke: Path | dict | None) -> list[str]:
    """What the run skipped (`pipeline.evaluate.skipped` phrases), from pilot_report.json and smoke_test.json."""
    def read(report):
        if report is None or isinstance(report, dict):
            return report
        return json.loads(Path(report).read_text()) if Path(report).exists() else None

    return skipped_in(read(gate), read(smoke))


def summary_table(eval_files: list[Path], smoke: Path | None) -> pd.DataFrame:
    rows = []
    for path in eval_files:
        result = json.loads(Path(path).read_text())
        for row in result["rows"]:
            rows.append({"stage": result["stage"], "step": result.get("step", 0),
                         **{k: v for k, v in row.items() if k in COLUMNS and k != "stage"}})
    if smoke is not None:
        s = json.loads(Path(smoke).read_text())
        rows.append({"stage": "export", "step": rows[-1]["step"] if rows else None, "weights": "merged",
                     "exact_match": s["exact_match"], "n_test": s["n"]})
    frame = pd.DataFrame(rows)
    return frame.reindex(columns=COLUMNS)


def training_curve(metrics_files: list[Path]) -> tuple[pd.DataFrame, list[tuple[str, int, int]]]:
    """Per-update metrics of all stages, and each stage's (name, first update, last update)."""
    frames, bounds = [], []
    for path in map(Path, metrics_files):
        if path.is_dir():  # a stage dir: its metrics.jsonl
            path = path / layout.STAGE_METRICS
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        steps = pd.DataFrame([r for r in lines if "loss" in r])
        if steps.empty:
            continue
        stage = Path(path).parent.name
        steps["stage"] = stage
        frames.append(steps)
        bounds.append((stage, int(steps["step"].min()) - 1, int(steps["step"].max())))
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), bounds


def _metrics_path(path: Path) -> Path:
    path = Path(path)
    return path / layout.STAGE_METRICS if path.is_dir() else path


def _records(path: Path) -> list[dict]:
    path = _metrics_path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def in_stage_evals(metrics_files: list[Path]) -> pd.DataFrame:
    """The full evaluations inside the stages (every `validation.every` updates): one row per
    (step, weights) with its validation loss; a step a resumed attempt evaluated again keeps the last."""
    rows = {}
    for path in metrics_files:
        for r in _records(path):
            if r.get("event") != "eval" or r.get("kind", "full") != "full":
                continue
            for key, value in r.items():
                if key.startswith("val_") and isinstance(value, (int, float)):
                    rows[(int(r["step"]), key[4:])] = float(value)
    frame = pd.DataFrame([{"step": st, "weights": w, "loss": v} for (st, w), v in rows.items()],
                         columns=["step", "weights", "loss"])
    return frame.sort_values(["weights", "step"], kind="stable").reset_index(drop=True)


def plan_bounds(plan: Path) -> list[tuple[str, int, int]]:
    """(name, start, end) of every planned stage: updates start+1 .. end."""
    return [(s["name"], int(s["start"]), int(s["end"])) for s in json.loads(Path(plan).read_text())["stages"]]


def _benchmark_seconds(path: Path) -> float | None:
    """Wall-clock seconds of the job that made the stage (Snakemake's benchmark TSV: column `s`)."""
    try:
        frame = pd.read_csv(path, sep="\t")
        return float(frame["s"].iloc[-1])
    except (OSError, KeyError, IndexError, ValueError, pd.errors.ParserError):
        return None


def stage_rows(metrics_files: list[Path], eval_files: list[Path], bounds, benchmarks: Path | None = None) -> list[dict]:
    """One row per stage: its updates, the train loss of its last updates, the validation loss of
    each weight set at its end, and where its time went.

    wall_s: the stage job's wall clock (Snakemake's benchmark of the successful attempt, so a
    resumed stage counts its last attempt); update_s / eval_s: the seconds spent in updates and
    in-stage evaluations, summed over every attempt's lines of metrics.jsonl; stage_eval_s: the
    evaluate_stage job's model time; finished: when the stage's checkpoint was written (MANIFEST)."""
    evals = {}
    for path in eval_files:
        result = json.loads(Path(path).read_text())
        evals[result["stage"]] = result
    windows = {name: (start, end) for name, start, end in bounds}
    rows = []
    for path in metrics_files:
        path = Path(path)
        stage = (path if path.is_dir() else path.parent).name
        records = _records(path)
        steps = [r for r in records if "loss" in r and "event" not in r]
        start, end = windows.get(stage, (min((r["step"] for r in steps), default=1) - 1,
                                         max((r["step"] for r in steps), default=0)))
        tail = [r["loss"] for r in steps][-10:]
        manifest = (path if path.is_dir() else path.parent) / layout.STAGE_CHECKPOINT / layout.MANIFEST_FILE
        finished = json.loads(manifest.read_text()).get("created") if manifest.exists() else None
        result = evals.get(stage, {})
        rows.append({
            "stage": stage, "first": start + 1, "last": end, "updates": end - start,
            "train_loss": sum(tail) / len(tail) if tail else None,
            "val": {r["weights"]: r.get("loss") for r in result.get("rows", [])},
            "exact_match": {r["weights"]: r.get("exact_match") for r in result.get("rows", [])},
            "wall_s": _benchmark_seconds(Path(benchmarks) / f"{stage}{layout.BENCHMARK_SUFFIX}") if benchmarks else None,
            "update_s": sum(float(r.get("step_time_s") or 0) for r in steps) if steps else None,
            "eval_s": sum(float(r.get("seconds") or 0) for r in records if r.get("event") == "eval"),
            "stage_eval_s": result.get("seconds"),
            "finished": finished,
        })
    return rows


def sample_sets(eval_files: list[Path]) -> list[tuple[str, int | None, dict[str, list[dict]]]]:
    """(stage, update, {weights: samples}) of every evaluation that kept samples, in order."""
    out = []
    for path in eval_files:
        result = json.loads(Path(path).read_text())
        sets = {r["weights"]: r["samples"] for r in result.get("rows", []) if r.get("samples")}
        if sets:
            out.append((result["stage"], result.get("step"), sets))
    return out
