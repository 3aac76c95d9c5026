"""Tables and plots across the run's stages.

    python -m pipeline summarize --plan plan.json --eval eval/base.json eval/pilot.json ... \
        --metrics stages/pilot/metrics.jsonl ... [--smoke export/smoke_test.json] \
        --out-csv eval/summary.csv --out-loss-plot eval/loss.png --out-eval-plot eval/val_loss.png

summary.csv has one row per (stage, weight set): the base model, then each
stage's raw weights and every EMA rate, and the merged export when a smoke
test result is given. loss.png: training loss over updates with stage
boundaries; val_loss.png: validation loss after each stage, raw vs each EMA.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

COLUMNS = ["stage", "step", "weights", "loss", "perplexity", "exact_match", "n_test"]


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


def training_curve(metrics_files: list[Path]) -> tuple[pd.DataFrame, list[tuple[str, int]]]:
    frames, bounds = [], []
    for path in metrics_files:
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        steps = pd.DataFrame([r for r in lines if "loss" in r])
        if steps.empty:
            continue
        stage = Path(path).parent.name
        steps["stage"] = stage
        frames.append(steps)
        bounds.append((stage, int(steps["step"].max())))
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), bounds


def plot_loss(curve: pd.DataFrame, bounds, table: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    if not curve.empty:
        ax.plot(curve["step"], curve["loss"], lw=0.8, alpha=0.45, color="tab:blue", label="train loss (per update)")
        smooth = curve["loss"].rolling(max(1, len(curve) // 30), min_periods=1).mean()
        ax.plot(curve["step"], smooth, lw=1.8, color="tab:blue", label="train loss (smoothed)")
    for stage, end in bounds:
        ax.axvline(end, color="grey", ls=":", lw=0.8)
        ax.text(end, 1.0, stage, rotation=90, va="top", ha="right", fontsize=7, color="grey",
                transform=ax.get_xaxis_transform())
    evals = table[table["loss"].notna() & (table["stage"] != "export")]
    for weights, group in evals.groupby("weights", sort=False):
        ax.plot(group["step"], group["loss"], marker="o", lw=1.2, label=f"val loss ({weights})")
    ax.set_xlabel("update")
    ax.set_ylabel("loss (nats / supervised token)")
    ax.set_yscale("log")
    ax.set_title("Training and validation loss across stages")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_eval(table: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = table[table["loss"].notna() & ~table["weights"].isin(["base", "merged"])]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for weights, group in evals.groupby("weights", sort=False):
        axes[0].plot(group["stage"], group["loss"], marker="o", label=weights)
        if group["exact_match"].notna().any():
            axes[1].plot(group["stage"], group["exact_match"], marker="o", label=weights)
    base = table[table["weights"] == "base"]
    if not base.empty and base["exact_match"].notna().any():
        axes[1].axhline(float(base["exact_match"].iloc[0]), color="black", ls="--", lw=1, label="base model")
    axes[0].set_title("validation loss after each stage")
    axes[1].set_title("held-out exact match after each stage")
    axes[1].set_ylim(-0.02, 1.02)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline summarize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", type=Path, nargs="+", required=True)
    ap.add_argument("--metrics", type=Path, nargs="+", required=True)
    ap.add_argument("--smoke", type=Path, default=None)
    ap.add_argument("--out-csv", type=Path, required=True)
    ap.add_argument("--out-loss-plot", type=Path, required=True)
    ap.add_argument("--out-eval-plot", type=Path, required=True)
    args = ap.parse_args(argv)

    table = summary_table(args.eval, args.smoke)
    args.out_csv.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out_csv, index=False)
    curve, bounds = training_curve(args.metrics)
    plot_loss(curve, bounds, table, args.out_loss_plot)
    plot_eval(table, args.out_eval_plot)
    with pd.option_context("display.width", 120, "display.max_columns", 10):
        print(table.to_string(index=False))
    return 0
