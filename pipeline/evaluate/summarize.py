"""Tables, plots and report views across the run's stages.

    python -m pipeline summarize --eval eval/base.json eval/pilot.json ... \
        --metrics stages/pilot ... [--smoke export/smoke_test.json] \
        [--plan plan.json] [--gate pilot_report.json] \
        --out-csv eval/summary.csv --out-loss-plot eval/loss.png --out-eval-plot eval/val_loss.png \
        [--out-summary-html report/summary.html] [--out-plan-html report/plan.html] \
        [--out-gate-html report/pilot_gate.html]

summary.csv has one row per (stage, weight set): the base model, then each
stage's raw weights and every EMA rate, and the merged export when a smoke
test result is given. loss.png: training loss and learning rate over updates,
stage windows shaded, validation loss of every weight set at each stage end;
val_loss.png: validation loss and held-out exact match after each stage, raw
vs each EMA. The HTML files are the same table, the plan and the pilot gate as
pages that `snakemake --report` shows inline (it only offers JSON and CSV as
downloads).
"""

from __future__ import annotations

import argparse
import html
import json
import math
from pathlib import Path

import pandas as pd

from pipeline import layout
from pipeline.evaluate import bench_table
from pipeline.evaluate.skipped import GATE_BASIS, NO_TEST, NO_VAL, skipped_in

COLUMNS = ["stage", "step", "weights", "loss", "perplexity", "exact_match", "n_test"]

# One look per weight set across both plots: raw solid, EMA dashed, base black.
BASE_STYLE = dict(color="black", marker="*", ms=11, ls="none")
EMA_COLORS = ["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"]


def weights_style(weights: str, order: list[str]) -> dict:
    if weights == "raw":
        return dict(color="tab:orange", marker="o", ls="-")
    emas = [w for w in order if w.startswith("ema")]
    i = emas.index(weights) if weights in emas else len(emas)
    return dict(color=EMA_COLORS[i % len(EMA_COLORS)], marker="s", ls="--")


def skipped(gate: Path | dict | None, smoke: Path | dict | None) -> list[str]:
    """What the run skipped (`pipeline.evaluate.skipped` phrases), from pilot_report.json and smoke_test.json."""
    def read(report):
        if report is None or isinstance(report, dict):
            return report
        return json.loads(Path(report).read_text()) if Path(report).exists() else None

    return skipped_in(read(gate), read(smoke))


def _skipped_note(phrases: list[str], *which: str) -> str:
    """The note that stands where a skipped measurement would be ('' when none of `which` was skipped)."""
    shown = [p for p in phrases if p in which]
    return "".join(f"<p class=\"note skipped\">{html.escape(p)}</p>" for p in shown)


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


def _shade_stages(ax, bounds, label: bool) -> None:
    if not bounds:
        return
    span = max(end for _, _, end in bounds) - min(start for _, start, _ in bounds) or 1
    for i, (stage, start, end) in enumerate(bounds):
        if i % 2:
            ax.axvspan(start, end, color="0.93", lw=0, zorder=0)
        ax.axvline(end, color="0.55", ls=":", lw=0.9, zorder=1)
        if label:
            # A stage narrower than ~4% of the run is labelled at its right edge, rotated.
            wide = (end - start) / span > 0.04
            ax.text((start + end) / 2 if wide else end, 0.985, stage, transform=ax.get_xaxis_transform(),
                    ha="center" if wide else "right", va="top", rotation=0 if wide else 90,
                    fontsize=8, color="0.35")


def _log_axis(ax) -> None:
    """Log scale with plain tick labels at 1, 2, 5 x 10^k (not 2 x 10^-1)."""
    from matplotlib import ticker

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(ticker.LogLocator(subs=(3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def plot_loss(curve: pd.DataFrame, bounds, table: pd.DataFrame, out: Path, title: str = "",
              in_stage: pd.DataFrame | None = None) -> None:
    """Training loss per update; the validation loss of the raw weights and each EMA rate as one
    line each through the in-stage evaluations (small dots) and the stage-end evaluations (large
    markers); the base model as a star; the learning rate below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_lr = not curve.empty and "lr" in curve
    fig, axes = plt.subplots(2 if has_lr else 1, 1, figsize=(10, 6.2 if has_lr else 4.8), dpi=110, sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3.2, 1] if has_lr else [1]})
    ax = axes[0][0]
    _shade_stages(ax, bounds, label=True)
    if not curve.empty:
        ax.plot(curve["step"], curve["loss"], lw=0.7, alpha=0.35, color="tab:blue", label="train loss (per update)")
        smooth = curve["loss"].rolling(max(1, len(curve) // 40), min_periods=1, center=True).mean()
        ax.plot(curve["step"], smooth, lw=1.8, color="tab:blue", label="train loss (smoothed)")
    evals = table[table["loss"].notna() & (table["stage"] != "export")]
    order = list(dict.fromkeys(evals["weights"]))
    base = evals[evals["weights"] == "base"]
    if not base.empty:
        ax.plot(base["step"], base["loss"], **BASE_STYLE, label="val loss, base model")
    in_stage = in_stage if in_stage is not None else pd.DataFrame(columns=["step", "weights", "loss"])
    order += [w for w in dict.fromkeys(in_stage["weights"]) if w not in order]
    for weights in [w for w in order if w != "base"]:
        style = weights_style(weights, order)
        ends = evals[evals["weights"] == weights][["step", "loss"]]
        inside = in_stage[in_stage["weights"] == weights][["step", "loss"]]
        line = pd.concat([inside, ends]).drop_duplicates("step", keep="last").sort_values("step")
        ax.plot(line["step"], line["loss"], lw=1.3, color=style["color"], ls=style["ls"],
                label=f"val loss, {weights} weights")
        if not inside.empty:
            ax.plot(inside["step"], inside["loss"], ls="none", marker=".", ms=6, color=style["color"])
        if not ends.empty:
            ax.plot(ends["step"], ends["loss"], ls="none", marker=style["marker"], ms=6, mfc="white",
                    mew=1.5, color=style["color"])
    if not in_stage.empty:
        ax.plot([], [], ls="none", marker=".", ms=6, color="0.3", label="in-stage evaluation (every validation.every)")
        ax.plot([], [], ls="none", marker="o", ms=6, mfc="white", color="0.3", label="stage-end evaluation (raw o, EMA squares)")
    ax.set_ylabel("loss (nats / supervised token, log)")
    _log_axis(ax)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.set_title(title or "Training and validation loss across stages")
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.92), framealpha=0.9)
    if has_lr:
        lax = axes[1][0]
        _shade_stages(lax, bounds, label=False)
        lax.plot(curve["step"], curve["lr"], color="0.25", lw=1.2)
        lax.set_ylabel("learning rate")
        lax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        lax.grid(True, axis="y", alpha=0.3)
    axes[-1][0].set_xlabel("update (global, across stages)")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_eval(table: pd.DataFrame, out: Path, title: str = "", skipped: list[str] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = table["loss"].notna() | table["exact_match"].notna()
    evals = table[measured & ~table["weights"].isin(["base", "merged"])]
    order = list(dict.fromkeys(evals["weights"]))
    stages = list(dict.fromkeys(evals["stage"]))
    steps = evals.drop_duplicates("stage").set_index("stage")["step"]
    x = {stage: i for i, stage in enumerate(stages)}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    for weights, group in evals.groupby("weights", sort=False):
        style = dict(weights_style(weights, order), lw=1.3, ms=5, label=f"{weights} weights")
        for ax, col in zip(axes, ("loss", "exact_match")):
            points = group[group[col].notna()]
            if not points.empty:
                ax.plot([x[s] for s in points["stage"]], points[col], **style)
    base = table[table["weights"] == "base"]
    for ax, col in zip(axes, ("loss", "exact_match")):
        if not base.empty and base[col].notna().any():
            ax.axhline(float(base[col].iloc[0]), color="black", ls=":", lw=1.2, label="base model")
    merged = table[table["weights"] == "merged"]
    if not merged.empty and merged["exact_match"].notna().any() and stages:
        axes[1].plot([x[stages[-1]]], [float(merged["exact_match"].iloc[0])], marker="D", ms=8, ls="none",
                     mfc="none", color="black", label="merged export")
    axes[0].set_title("validation loss after each stage")
    axes[0].set_ylabel("loss (nats / supervised token, log)")
    _log_axis(axes[0])
    axes[1].set_title("held-out exact match after each stage")
    axes[1].set_ylabel("exact match (fraction of test prompts)")
    axes[1].set_ylim(-0.03, 1.03)
    for ax, phrase in zip(axes, (NO_VAL, NO_TEST)):
        ax.set_xticks(range(len(stages)), [f"{s}\n(update {int(steps[s])})" for s in stages], fontsize=8)
        ax.set_xlabel("stage")
        ax.grid(True, axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, phrase if phrase in skipped else "not measured", transform=ax.transAxes,
                    ha="center", color="0.5")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# ----------------------------------------------------------------- HTML views for the report

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.2em 1.6em; color: #1f2933; }
h1 { font-size: 1.35em; margin-bottom: .2em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
p.note { color: #52606d; font-size: .9em; max-width: 60em; }
table { border-collapse: collapse; font-size: .92em; margin: .6em 0; }
th, td { border-bottom: 1px solid #d9e2ec; padding: .35em .8em; text-align: right; }
th { background: #f0f4f8; } td.l, th.l { text-align: left; }
td.best { font-weight: 700; color: #0b6e4f; }
.pass { color: #0b6e4f; font-weight: 700; } .fail { color: #b42318; font-weight: 700; }
.banner { display: inline-block; padding: .4em .9em; border-radius: .3em; font-weight: 700; }
.banner.pass { background: #e3f9ee; } .banner.fail { background: #fde8e8; }
.bar { position: relative; height: 1.6em; background: #f0f4f8; width: 46em; margin: .8em 0; }
.bar div { position: absolute; top: 0; bottom: 0; border-right: 2px solid #fff; background: #9fb3c8;
           font-size: .75em; line-height: 2.1em; text-align: center; overflow: hidden; color: #102a43; }
.bar div.alt { background: #bcccdc; }
"""


def html_page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def fmt_cell(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return html.escape(str(value))


def html_table(header: list[str] | None, rows: list[list[str]], left: int = 1) -> str:
    """An HTML table of already-escaped cells (header cells may hold markup); the first `left`
    columns are left-aligned. A cell that is already a <td ...> element is kept as it is."""
    def cls(i):
        return ' class="l"' if i < left else ""
    head = ("<thead><tr>" + "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(header)) + "</tr></thead>"
            if header else "")
    body = "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td{cls(i)}>{c}</td>" for i, c in enumerate(r))
                   + "</tr>\n" for r in rows)
    return f"<table>{head}<tbody>\n{body}</tbody></table>"


def _pivot(table: pd.DataFrame, column: str, best, fmt) -> str:
    """weights x stage for one metric; the best trained weight set after each stage in bold."""
    data = table[table[column].notna()]
    if data.empty:
        return "<p class=\"note\">not measured</p>"
    stages = list(dict.fromkeys(data["stage"]))
    weights = list(dict.fromkeys(data["weights"]))
    steps = data.drop_duplicates("stage").set_index("stage")["step"]
    cell = {(r.weights, r.stage): getattr(r, column) for r in data.itertuples()}
    names = {"base": "before training", "export": "merged export"}
    header = ["weights"] + [f"{html.escape(names.get(s, s))}<br><small>update {int(steps[s])}</small>"
                            if pd.notna(steps[s]) else html.escape(s) for s in stages]
    rows = []
    for w in weights:
        row = [html.escape(w)]
        for s in stages:
            v = cell.get((w, s))
            trained = [x for (ww, st), x in cell.items() if st == s and ww not in ("base", "merged")]
            top = v is not None and w not in ("base", "merged") and len(set(trained)) > 1 and v == best(trained)
            mark = ' class="best"' if top else ""
            row.append(f"<td{mark}>{'' if v is None else fmt(v)}</td>")
        rows.append(row)
    return html_table(header, rows)


def summary_html(table: pd.DataFrame, run: str = "", skipped: list[str] = ()) -> str:
    """The evaluation page; `skipped` (`skipped` phrases) replaces a table the run could not measure."""
    n_test = table["n_test"].dropna()
    body = [
        "<p class=\"note\">One row of <code>summary.csv</code> per stage and weight set. <b>base</b>: the "
        "model before fine-tuning; <b>raw</b>: the trained weights; <b>ema_&lt;rate&gt;</b>: the exponential "
        "moving average of the weights at that rate; <b>merged</b>: the exported model with the adapter merged "
        "in (smoke test). Bold: the best weight set after that stage.</p>",
        "<h2>Validation loss (nats per supervised token, lower is better)</h2>",
        _skipped_note(skipped, NO_VAL) or _pivot(table, "loss", min, lambda v: f"{v:.4g}"),
        f"<h2>Held-out exact match (greedy answer equals the reference; "
        f"{int(n_test.max()) if not n_test.empty else 0} test prompts)</h2>",
        _skipped_note(skipped, NO_TEST) or _pivot(table, "exact_match", max, lambda v: f"{100 * v:.1f}%"),
        "<h2>All rows (summary.csv)</h2>",
        html_table([html.escape(c) for c in COLUMNS], [[fmt_cell(v) for v in r] for r in table[COLUMNS].itertuples(index=False)], left=1),
    ]
    return html_page(f"Evaluation{' of run ' + run if run else ''}", "\n".join(body))


def plan_html(plan: dict, gate: dict | None = None, run: str = "") -> str:
    total = int(plan.get("total_updates") or max(s["end"] for s in plan["stages"]))
    bars = []
    for i, s in enumerate(plan["stages"]):
        left, width = 100 * s["start"] / total, 100 * (s["end"] - s["start"]) / total
        bars.append(f"<div class=\"{'alt' if i % 2 else ''}\" style=\"left:{left:.3f}%;width:{width:.3f}%\" "
                    f"title=\"{html.escape(s['name'])}: updates {s['start'] + 1}-{s['end']}\">"
                    f"{html.escape(s['name'])}</div>")
    rows = [[html.escape(s["name"]), str(s["start"] + 1), str(s["end"]), str(s["end"] - s["start"]),
             f"{100 * (s['end'] - s['start']) / total:.1f}%"] for s in plan["stages"]]
    body = [
        f"<p>{total} optimizer updates in {len(plan['stages'])} stages. Each stage is a window of global update "
        "indices; the learning-rate schedule, the EMA and the data order span the whole run, so the chained stages "
        "compute exactly what one long run computes. The pilot runs first and is checked by the pilot gate "
        "before any chunk starts.</p>",
        f"<div class=\"bar\">{''.join(bars)}</div>",
        html_table(["stage", "first update", "last update", "updates", "share of the run"], rows),
    ]
    if plan.get("mix"):  # several training datasets: what each gives to the run (pipeline/data/mix.py)
        body += ["<h2>Training datasets mixed</h2>",
                 html_table(["dataset", "records", "weight", "records asked", "per mixed epoch", "drawn in the run"],
                            [[html.escape(m["name"]), *(fmt_cell(m[k]) for k in
                              ("records", "weight", "records_asked", "per_epoch", "drawn"))] for m in plan["mix"]])]
    if gate is not None:
        eta = gate.get("eta_seconds")
        status = "pass" if gate.get("passed") else "fail"
        body.append(f"<p>Pilot gate: <span class=\"{status}\">{'passed' if gate.get('passed') else 'FAILED'}</span>"
                    + (f"; estimated time for the remaining {gate.get('remaining_updates')} updates: "
                       f"{_duration(eta)}" if eta is not None else "") + ".</p>")
    return html_page(f"Plan{' of run ' + run if run else ''}", "\n".join(body))


def _duration(seconds) -> str:
    if seconds is None:
        return "unknown"
    seconds = float(seconds)
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def gate_html(gate: dict, run: str = "") -> str:
    passed = bool(gate.get("passed"))
    rows = []
    for name, check in gate.get("checks", {}).items():
        ok = bool(check.get("ok"))
        rows.append([html.escape(name), f"<td class=\"l {'pass' if ok else 'fail'}\">{'pass' if ok else 'FAIL'}</td>",
                     html.escape(str(check.get("detail", "")))])
    verdict = ("PASSED: the chunks may start" if passed else
               "FAILED" + (": overridden by gate.override, the chunks ran anyway" if gate.get("override")
                           else ": no chunk starts until the cause is fixed (or gate.override is set)"))
    facts = [["median time per update", _duration(gate.get("median_step_s"))],
             ["updates after the pilot", fmt_cell(gate.get("remaining_updates"))],
             ["estimated time for them", _duration(gate.get("eta_seconds"))],
             ["override set", "yes" if gate.get("override") else "no"]]
    facts.insert(0, ["judged on", gate.get("judged_on", "training loss")])
    body = [
        f"<p><span class=\"banner {'pass' if passed else 'fail'}\">{html.escape(verdict)}</span></p>",
        "<p class=\"note\">Sanity checks on the pilot stage before the rest of the run is spent.</p>",
        *(f"<p class=\"note skipped\">{html.escape(p)}; {GATE_BASIS}.</p>" for p in skipped_in(gate)),
        html_table(["check", "result", "detail"], rows, left=3),
        html_table(None, [[html.escape(a), html.escape(b)] for a, b in facts], left=1),
    ]
    return html_page(f"Pilot gate{' of run ' + run if run else ''}", "\n".join(body))


# ------------------------------------------------------- landing page: durations, exports, samples


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


def _clock(ts) -> str:
    import datetime

    if ts is None:
        return ""
    return datetime.datetime.fromtimestamp(float(ts), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def stage_table_html(rows: list[dict]) -> str:
    weights = list(dict.fromkeys(w for r in rows for w in r["val"]))
    header = (["stage", "updates", "train loss<br><small>last 10 updates</small>"]
              + [f"val loss<br><small>{html.escape(w)}</small>" for w in weights]
              + ["wall clock<br><small>stage job</small>", "in updates", "in-stage evals",
                 "stage-end eval", "finished (UTC)"])
    body = []
    for r in rows:
        body.append([html.escape(r["stage"]), f"{r['first']}&ndash;{r['last']} ({r['updates']})",
                     fmt_cell(r["train_loss"])]
                    + [fmt_cell(r["val"].get(w)) for w in weights]
                    + [html.escape(_duration(r["wall_s"])) if r["wall_s"] is not None else "",
                       html.escape(_duration(r["update_s"])) if r["update_s"] is not None else "",
                       html.escape(_duration(r["eval_s"])) if r["eval_s"] else "",
                       html.escape(_duration(r["stage_eval_s"])) if r["stage_eval_s"] is not None else "",
                       html.escape(_clock(r["finished"]))])
    walls = [r["wall_s"] for r in rows if r["wall_s"] is not None]
    if walls:
        body.append(["<b>all stages</b>", str(sum(r["updates"] for r in rows)), ""] + [""] * len(weights)
                    + [f"<b>{'&ge; ' if len(walls) < len(rows) else ''}{html.escape(_duration(sum(walls)))}</b>",
                       html.escape(_duration(sum(r["update_s"] or 0 for r in rows))),
                       html.escape(_duration(sum(r["eval_s"] or 0 for r in rows))),
                       html.escape(_duration(sum(r["stage_eval_s"] or 0 for r in rows))), ""])
    return html_table(header, body, left=1)


EXPORTS = [(layout.ADAPTER_FINAL, "the raw adapter after the last update"),
           (layout.ADAPTER_EMA, "the EMA adapter (export.ema_rate)"),
           (layout.ADAPTER_BEST, "the raw adapter at its lowest in-stage validation loss"),
           (layout.ADAPTER_BEST_EMA, "the EMA adapter at its lowest in-stage validation loss"),
           (layout.MERGED, "base + adapter merged into one model (from_pretrained)")]


def export_html(export_dir: Path | None, smoke: Path | None, verification: Path | None) -> str:
    rows = []
    if export_dir is not None:
        for name, what in EXPORTS:
            there = (Path(export_dir) / name).is_dir()
            rows.append([f"<code>{html.escape(name)}/</code>", html.escape(what),
                         f"<td class=\"{'pass' if there else 'fail'}\">{'written' if there else 'absent'}</td>"])
    facts = []
    if verification is not None and Path(verification).exists():
        v = json.loads(Path(verification).read_text())
        ok = bool(v.get("passed"))
        facts.append(["merge verified against the unmerged model",
                      f"<span class=\"{'pass' if ok else 'fail'}\">{'passed' if ok else 'FAILED'}</span>: "
                      f"max |logit difference| {fmt_cell(v.get('max_abs_diff'))} "
                      f"(tolerance {fmt_cell(v.get('tolerance'))}, {fmt_cell(v.get('probes'))} probes)"])
    if smoke is not None and Path(smoke).exists():
        sm = json.loads(Path(smoke).read_text())
        facts.append(["merged model, held-out exact match (smoke test)",
                      html.escape("; ".join(skipped_in(sm))) if sm.get("exact_match") is None
                      else f"{100 * sm['exact_match']:.1f}% of {sm['n']} prompts"])
    out = []
    if rows:
        out.append(html_table(["export", "what", ""], rows, left=3))
    if facts:
        out.append(html_table(None, [[html.escape(a), b] for a, b in facts], left=2))
    return "\n".join(out) or "<p class=\"note\">no exports yet</p>"


def sample_sets(eval_files: list[Path]) -> list[tuple[str, int | None, dict[str, list[dict]]]]:
    """(stage, update, {weights: samples}) of every evaluation that kept samples, in order."""
    out = []
    for path in eval_files:
        result = json.loads(Path(path).read_text())
        sets = {r["weights"]: r["samples"] for r in result.get("rows", []) if r.get("samples")}
        if sets:
            out.append((result["stage"], result.get("step"), sets))
    return out


def samples_table_html(sets: dict[str, list[dict]]) -> str:
    """Prompt, reference, then every weight set's answer (green: exact match, red: not)."""
    weights = list(sets)
    n = max(len(v) for v in sets.values())
    first = next(iter(sets.values()))
    rows = []
    for i in range(n):
        ref = next((sets[w][i] for w in weights if i < len(sets[w])), first[0])
        row = [f"<td class=\"l\"><code>{html.escape(str(ref['prompt']))}</code></td>",
               f"<td class=\"l\"><code>{html.escape(str(ref['reference']))}</code></td>"]
        for w in weights:
            if i >= len(sets[w]):
                row.append("<td></td>")
                continue
            sample = sets[w][i]
            cls = "pass" if sample.get("match") else "fail"
            row.append(f"<td class=\"l {cls}\" title=\"{'exact match' if sample.get('match') else 'no match'}\">"
                       f"<code>{html.escape(str(sample['answer']))}</code></td>")
        rows.append(row)
    header = ["prompt", "reference"] + [f"{html.escape(w)} answer" for w in weights]
    return html_table(header, rows, left=2 + len(weights))


def samples_html(eval_files: list[Path], run: str = "") -> str:
    sets = sample_sets(eval_files)
    body = ["<p class=\"note\">What the model answers: at each stage end, the raw weights and every EMA "
            "rate answer the same first held-out prompts (greedy decoding), next to the reference. Green: "
            "the answer equals the reference (exact match), red: it does not.</p>"]
    if not sets:
        body.append("<p class=\"note\">no held-out prompts (the run has no test split)</p>")
    for stage, step, by_weights in sets:
        title = "before training (base model)" if stage == "base" else f"after {stage}"
        body.append(f"<h2>{html.escape(title)}" + (f" <small>(update {int(step)})</small>" if step else "") + "</h2>")
        body.append(samples_table_html(by_weights))
    return html_page(f"Samples{' of run ' + run if run else ''}", "\n".join(body))


# The landing page sits inside Snakemake's report (its workflow description, inserted by
# workflow/report/workflow.rst). Its styles are scoped to #sft-overview; the last rules widen
# the report's description column and put the rule graph below it (they only match the
# report's landing page: in an iframe or on its own they match nothing).
_OVERVIEW_CSS = """
#sft-overview { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2933; max-width: 78em; }
#sft-overview h2 { font-size: 1.1em; margin: 1.2em 0 .3em; }
#sft-overview p.note { color: #52606d; font-size: .9em; margin: .2em 0; }
#sft-overview img.loss { width: 100%; max-width: 1100px; height: auto; display: block; margin: 0; }
#sft-overview table { border-collapse: collapse; font-size: .88em; margin: .4em 0; width: auto; }
#sft-overview th, #sft-overview td { border-bottom: 1px solid #d9e2ec; padding: .3em .7em; text-align: right; }
#sft-overview th { background: #f0f4f8; } #sft-overview td.l, #sft-overview th.l { text-align: left; }
#sft-overview code::before, #sft-overview code::after { content: none; }
#sft-overview .pass { color: #0b6e4f; font-weight: 600; } #sft-overview .fail { color: #b42318; font-weight: 600; }
div.overflow-auto:has(#sft-overview) { align-items: flex-start; justify-content: flex-start; }
div.items-start:has(#sft-overview) { flex-direction: column; }
.prose:has(#sft-overview) { max-width: none; }
"""


def overview_html(loss_png: Path, stages: list[dict], exports: str, samples: list, run: str = "",
                  skipped: list[str] = ()) -> str:
    """The report's landing page: what the run skipped (`skipped` phrases), the loss curves, the stages
    with their durations, the exports and the last stage's samples. The plot is embedded (a data URI),
    so the page stands alone."""
    import base64

    uri = "data:image/png;base64," + base64.b64encode(Path(loss_png).read_bytes()).decode()
    title = f"Run {run}" if run else "Run overview"
    body = [f"<div id=\"sft-overview\">",
            *(f"<p class=\"note skipped\">Skipped: {html.escape(p)}.</p>" for p in skipped),
            f"<h2>{html.escape(title)}: loss curves</h2>",
            f"<img class=\"loss\" alt=\"training and validation loss\" src=\"{uri}\">",
            "<p class=\"note\">Training loss per update (light) and smoothed; validation loss of the raw weights "
            "and each EMA rate through the in-stage evaluations (dots, every <code>validation.every</code> updates) "
            "and the stage-end evaluations (open markers); the base model before training (star); stages shaded.</p>",
            "<h2>Stages</h2>", stage_table_html(stages),
            "<p class=\"note\">Wall clock: the stage job (Snakemake benchmark of its successful attempt); in updates "
            "and in-stage evals: seconds summed over every attempt's <code>metrics.jsonl</code>; stage-end eval: "
            "the evaluate_stage job (raw + every EMA).</p>",
            "<h2>Exports</h2>", exports]
    if samples:
        stage, step, sets = samples[-1]
        body += [f"<h2>Samples after {html.escape(stage)}" + (f" (update {int(step)})" if step else "") + "</h2>",
                 samples_table_html(sets),
                 "<p class=\"note\">Every stage's answers: <code>samples.html</code> (Evaluation).</p>"]
    body.append("</div>")
    return (f"<!DOCTYPE html>\n<meta charset=\"utf-8\">\n<title>{html.escape(title)}</title>\n"
            f"<style>{_OVERVIEW_CSS}</style>\n" + "\n".join(body) + "\n")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline summarize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", type=Path, nargs="+", required=True)
    ap.add_argument("--metrics", type=Path, nargs="+", required=True,
                    help="each stage's metrics.jsonl, or the stage dirs that hold them")
    ap.add_argument("--smoke", type=Path, default=None)
    ap.add_argument("--plan", type=Path, default=None, help="plan.json: stage windows for the plots, plan page")
    ap.add_argument("--gate", type=Path, default=None, help="pilot_report.json: the pilot gate page")
    ap.add_argument("--run", default="", help="run name for titles")
    ap.add_argument("--out-csv", type=Path, required=True)
    ap.add_argument("--out-loss-plot", type=Path, required=True)
    ap.add_argument("--out-eval-plot", type=Path, required=True)
    ap.add_argument("--out-summary-html", type=Path, default=None)
    ap.add_argument("--out-plan-html", type=Path, default=None)
    ap.add_argument("--out-gate-html", type=Path, default=None)
    ap.add_argument("--verification", type=Path, default=None, help="export/verification.json (the merge check)")
    ap.add_argument("--export-dir", type=Path, default=None, help="export/: which exported dirs exist")
    ap.add_argument("--benchmarks", type=Path, default=None,
                    help="benchmarks/train_stage/<run>/: each stage job's wall clock (<stage>.tsv)")
    ap.add_argument("--out-samples-html", type=Path, default=None)
    ap.add_argument("--out-overview-html", type=Path, default=None,
                    help="the report's landing page: loss curves, stages with durations, exports, samples")
    ap.add_argument("--bench-csv", type=Path, default=None,
                    help="eval/benchmarks.csv (benchmark-report): its scores as summary.csv rows and a summary.html table")
    args = ap.parse_args(argv)
    if args.out_plan_html is not None and args.plan is None:
        ap.error("--out-plan-html needs --plan")
    if args.out_gate_html is not None and args.gate is None:
        ap.error("--out-gate-html needs --gate")

    table = summary_table(args.eval, args.smoke)
    args.out_csv.parent.mkdir(parents=True, exist_ok=True)
    bench_rows = bench_table.summary_rows(args.bench_csv, int(table["step"].max())) if args.bench_csv else None
    pd.concat([table, bench_rows], ignore_index=True).to_csv(args.out_csv, index=False)
    curve, bounds = training_curve(args.metrics)
    if args.plan is not None:
        bounds = plan_bounds(args.plan)
    run = f"run {args.run}: " if args.run else ""
    n_updates = max((end for _, _, end in bounds), default=0)
    plot_loss(curve, bounds, table, args.out_loss_plot,
              title=f"{run}training and validation loss, {n_updates} updates in {len(bounds)} stages",
              in_stage=in_stage_evals(args.metrics))
    plan = json.loads(args.plan.read_text()) if args.plan is not None else None
    gate = json.loads(args.gate.read_text()) if args.gate is not None else None
    phrases = skipped(gate, args.smoke)
    plot_eval(table, args.out_eval_plot, title=f"{run}evaluation after each stage" if run else "", skipped=phrases)

    pages = [(args.out_summary_html, lambda: bench_table.into_page(summary_html(table, args.run, phrases), args.bench_csv)),
             (args.out_plan_html, lambda: plan_html(plan, gate, args.run)),
             (args.out_gate_html, lambda: gate_html(gate, args.run)),
             (args.out_samples_html, lambda: samples_html(args.eval, args.run)),
             (args.out_overview_html, lambda: overview_html(
                 args.out_loss_plot, stage_rows(args.metrics, args.eval, bounds, args.benchmarks),
                 export_html(args.export_dir, args.smoke, args.verification), sample_sets(args.eval), args.run,
                 phrases))]
    for out, page in pages:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(page())
    _tracker(args, plan)
    with pd.option_context("display.width", 120, "display.max_columns", 10):
        print(table.to_string(index=False))
    for phrase in phrases:
        print(f"summary: {phrase}")
    return 0


def _tracker(args, plan: dict | None) -> None:
    """Catch up the run's tracker, upload the plots and the table, and name any tracker failure."""
    import sys

    from pipeline import tracker as tr

    run_dir = args.out_csv.parent.parent
    t = tr.Tracker(run_dir, job="summarize")
    t.sync_stages((plan or {}).get("stages", []))
    failures = tr.errors(run_dir)
    if failures and args.out_summary_html is not None and args.out_summary_html.is_file():
        last = failures[-1]
        note = (f'<p class="tracker-failure"><b>Experiment tracker failed</b> ({len(failures)} time(s)): '
                f'{html.escape(last["kind"])} at {html.escape(last["uri"] or "default")}, {html.escape(last["job"])}: '
                f'{html.escape(last["error"])}. The metrics are in each stage\'s metrics.jsonl (unsent ones are '
                f'sent by the next job that reaches the tracker).</p>')
        page = args.out_summary_html.read_text()
        args.out_summary_html.write_text(page.replace("</body>", note + "</body>", 1) if "</body>" in page
                                         else page + note)
    t.log_artifacts([args.out_loss_plot, args.out_eval_plot, args.out_csv, args.out_summary_html])
    t.close()
    for f in failures:
        print(f"WARNING: tracker {f['kind']} failed in {f['job']}: {f['error']}", file=sys.stderr)
