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

This module is the command; what it writes comes from `tables` (the data),
`plots` (the two PNGs), `pages` (summary, plan and gate pages) and `overview`
(the landing and samples pages).
"""

from __future__ import annotations

import argparse
import html
import json
from pathlib import Path

import pandas as pd

from pipeline.evaluate import bench_table
from pipeline.evaluate.overview import export_html, overview_html, samples_html
from pipeline.evaluate.pages import gate_html, plan_html, summary_html
from pipeline.evaluate.plots import plot_eval, plot_loss
from pipeline.evaluate.tables import (in_stage_evals, plan_bounds, sample_sets, skipped, stage_rows, summary_table,
                                     training_curve)


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
