"""`python -m pipeline benchmark-report`: the lm-eval benchmarks of a run, base vs the trained weights.

    python -m pipeline benchmark-report --results eval/bench/base/*.json eval/bench/merged/*.json \
        --weights base merged --out-csv eval/benchmarks.csv --out-plot eval/benchmarks.png \
        --out-html report/benchmarks.html [--run NAME]

benchmarks.csv: one row per (task, metric, trained weights), base and final scores, their
difference, standard errors (pipeline.evaluate.bench_table says which). benchmarks.png: each
task and metric, base vs each trained weight set, with 95% intervals. benchmarks.html: the
table as a page of `snakemake --report` (Evaluation), with the plot. The scores also go to the
run's tracker, each once: `bench/<task>/<metric>` is the base model's at update 0 and the final
weights' (merged, else the first trained set scored) at the run's last update; another trained
set's is `bench/<weights>/<task>/<metric>`. `benchmark-card` puts the table into the export
dirs' model cards.
"""

from __future__ import annotations

import argparse
import html
import math
from pathlib import Path

import pandas as pd

from pipeline import layout
from pipeline.evaluate.bench_table import load, note, table, table_html

Z95 = 1.959964


def plot(bench: pd.DataFrame, out: Path, title: str = "") -> None:
    """Each (task, metric): the base model and each trained set, bars with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(zip(bench["task"], bench["metric"])))
    trained = [w for w in dict.fromkeys(bench["weights"].dropna())]
    series = [(layout.BENCH_BASE, "base", "base_stderr", "0.55")] + [
        (w, "final", "final_stderr", f"C{i}") for i, w in enumerate(trained)]
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.45 * len(keys) * len(series)), dpi=110)
    height = 0.8 / len(series)
    right = 0.0
    for j, (name, col, err, color) in enumerate(series):
        values, errors = [], []
        for task, metric in keys:
            rows = bench[(bench["task"] == task) & (bench["metric"] == metric)]
            rows = rows if name == layout.BENCH_BASE else rows[rows["weights"] == name]
            values.append(float(rows[col].iloc[0]) if not rows.empty and pd.notna(rows[col].iloc[0]) else float("nan"))
            errors.append(Z95 * float(rows[err].iloc[0]) if not rows.empty and pd.notna(rows[err].iloc[0]) else 0.0)
        y = [i + (j - (len(series) - 1) / 2) * height for i in range(len(keys))]
        ax.barh(y, values, height=height * 0.9, xerr=errors, color=color, capsize=3,
                label="base model" if name == layout.BENCH_BASE else f"{name} weights")
        for yy, v, e in zip(y, values, errors):
            if not math.isnan(v):
                ax.text(v + e, yy, f"  {v:.3f}", va="center", fontsize=8)
                right = max(right, v + e)
    ax.set_xlim(min(0.0, ax.get_xlim()[0]), right * 1.15 or 1.0)
    ax.set_yticks(range(len(keys)), [f"{t}\n{m}" for t, m in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("score (error bars: 95% interval, 1.96 standard errors)")
    ax.set_title(title or "Benchmarks: base model vs trained weights")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.4 / len(keys) / len(series)),
              ncol=len(series), frameon=False)
    fig.tight_layout()
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)


def page(bench: pd.DataFrame, plot_png: Path, run: str = "") -> str:
    import base64

    from pipeline.evaluate.pages import html_page

    uri = "data:image/png;base64," + base64.b64encode(Path(plot_png).read_bytes()).decode()
    body = [f"<p class=\"note\">{html.escape(note(bench))} Green: better than the base beyond two standard "
            "errors of the difference; red: worse.</p>", table_html(bench),
            f"<p><img alt=\"benchmark scores\" style=\"max-width:100%\" src=\"{uri}\"></p>"]
    return html_page(f"Benchmarks{' of run ' + run if run else ''}", "\n".join(body))


def tracker_points(records: dict[tuple[str, str], dict], weights: list[str], last: int):
    """(marker, points) per record: `bench/<task>/<metric>` for the base (update 0) and the final
    weights (the last update), `bench/<weights>/<task>/<metric>` for any other trained set."""
    trained = [w for w in weights if w != layout.BENCH_BASE]
    final = layout.MERGED if layout.MERGED in trained else (trained[0] if trained else None)
    for (name, task), record in records.items():
        prefix = "bench" if name in (layout.BENCH_BASE, final) else f"bench/{name}"
        step = 0 if name == layout.BENCH_BASE else last
        points = [(f"{prefix}/{r['task']}/{r['label']}", r["value"], step) for r in record["scores"]]
        yield f"bench_{name}_{task}_{record['key'][:16]}", points


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline benchmark-report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, nargs="+", required=True, help="eval/bench/<weights>/<task>.json files")
    ap.add_argument("--weights", nargs="+", required=True, help="evaluate.benchmarks.weights, in the table's order")
    ap.add_argument("--run", default="", help="run name for titles")
    ap.add_argument("--out-csv", type=Path, required=True)
    ap.add_argument("--out-plot", type=Path, required=True)
    ap.add_argument("--out-html", type=Path, required=True)
    args = ap.parse_args(argv)
    records = load(args.results)
    bench = table(records, args.weights)
    for out in (args.out_csv, args.out_plot, args.out_html):
        out.parent.mkdir(parents=True, exist_ok=True)
    bench.to_csv(args.out_csv, index=False)
    plot(bench, args.out_plot, title=f"run {args.run}: benchmarks, base model vs trained weights" if args.run else "")
    args.out_html.write_text(page(bench, args.out_plot, args.run))
    _tracker(args.out_csv.parent.parent, records, args.weights)
    with pd.option_context("display.width", 140, "display.max_columns", 12):
        print(bench[["task", "metric", "weights", "n", "base", "final", "delta", "delta_stderr", "stderr_kind"]]
              .to_string(index=False))
    return 0


def _tracker(run_dir: Path, records, weights: list[str]) -> None:
    """Each score once in the run's tracker (see the module doc)."""
    from pipeline.tracker import Tracker

    tracker = Tracker(run_dir, job="benchmark-report")
    for marker, points in tracker_points(records, weights, tracker.last_update()):
        tracker.log_once(points, marker=marker, what="benchmark scores")
    tracker.close()
