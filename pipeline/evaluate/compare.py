"""A sweep's decisions and its comparison: which variants go on at a prune point, which one is best.

    python -m pipeline sweep-prune --stage pilot --keep 2 --variant NAME=results/<run>/variants/NAME/eval/pilot.json ... \\
        --out results/<run>/sweep/prune/pilot.json
    python -m pipeline sweep-compare --run results/<run> --variant NAME=results/<run>/variants/NAME ... \\
        --overrides 'NAME=["optim.lr=0.001"]' ... --prune results/<run>/sweep/prune/pilot.json ... \\
        --out-csv comparison.csv --out-plot loss.png --out-html comparison.html --out-best best.json

A variant's score at a stage is the lowest validation loss among the weight
sets evaluated at that stage's end (raw and every EMA rate): what the run would
export if it stopped there. Ties go to the variant listed first.

The comparison table has a row per variant: its overrides, where it stopped
(the end, or the prune point that stopped it and why), the validation loss of
the raw weights and of each EMA rate at its last stage, the best full
evaluation of the run (the trainer's in-stage tracking), and the held-out
exact match (the merged export's when it finished, else its last stage's raw
weights'). The best variant is the finished one with the lowest best validation
loss; `best.json` names it and `<run>/sweep/best` links to its directory
(`<run>/variants/<name>`), so its exports are at a fixed path. The plot shows every variant's training loss.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
from pathlib import Path

import pandas as pd

from pipeline import layout
from pipeline.errors import UserError
from pipeline.planning.sweep import prune
from pipeline.evaluate.pages import fmt_cell, html_page, html_table
from pipeline.storage.publish import write_json, write_text

def _stopped_at(name: str, stages: list[str], decisions: list[dict]) -> tuple[list[str], str | None]:
    """(the stages a variant trained, why it stopped early or None): the first prune point in stage
    order that did not keep it. Outputs of later stages left from an earlier, larger `keep` are not
    counted: the comparison describes the sweep as now configured."""
    for decision in sorted(decisions, key=lambda d: stages.index(d["stage"])):
        if name in decision["stopped"]:
            return stages[:stages.index(decision["stage"]) + 1], decision["stopped"][name]
    return stages, None


def _variant_row(name: str, root: Path, overrides: list[str], reached: list[str],
                 stopped: str | None) -> tuple[dict, pd.DataFrame]:
    """One row of the comparison, and the variant's per-update training loss."""
    tree = layout.RunTree(root)
    evals = {stage: json.loads(tree.evaluation(stage).read_text()) for stage in reached}
    last = evals[reached[-1]]
    row: dict = {"variant": name, "overrides": " ".join(overrides),
                 "stopped": stopped or "finished", "last_stage": reached[-1]}
    for r in last.get("rows", []):
        row[f"val_{r['weights']}"] = r.get("loss")
    curve, best = [], {}
    for stage in reached:
        for r in evals[stage].get("rows", []):
            if isinstance(r.get("loss"), (int, float)):
                key = f"val_{r['weights']}"
                best[key] = min(best.get(key, math.inf), r["loss"])
        metrics = tree.stage(stage) / layout.STAGE_METRICS
        for line in metrics.read_text().splitlines() if metrics.is_file() else []:
            record = json.loads(line)
            if "loss" in record and "step" in record and "event" not in record:
                curve.append({"variant": name, "step": record["step"], "loss": record["loss"]})
            if record.get("event") == "eval" and record.get("kind") == "full":
                for key, value in record.items():
                    if key.startswith("val_") and isinstance(value, (int, float)):
                        best[key] = min(best.get(key, math.inf), value)
    for key, value in best.items():
        row[f"best_{key}"] = value
    row["best_val"] = min(best.values()) if best else row.get("val_raw")
    smoke = tree.smoke_test
    if stopped is None and smoke.is_file():
        row["exact_match"], row["exact_match_of"] = json.loads(smoke.read_text())["exact_match"], "merged export"
    else:
        raw = next((r for r in last.get("rows", []) if r["weights"] == "raw"), {})
        row["exact_match"], row["exact_match_of"] = raw.get("exact_match"), f"{reached[-1]} raw"
    return row, pd.DataFrame(curve)


def compare(variants: dict[str, Path], overrides: dict[str, list[str]], stages: list[str],
            decisions: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame, str | None]:
    """The comparison table, every variant's training loss curve, and the best finished variant."""
    rows, curves = [], []
    for name, root in variants.items():
        reached, stopped = _stopped_at(name, stages, decisions)
        row, curve = _variant_row(name, Path(root), overrides.get(name, []), reached, stopped)
        rows.append(row)
        curves.append(curve)
    table = pd.DataFrame(rows)
    finished = table[table["stopped"] == "finished"]
    best = None
    if not finished.empty and finished["best_val"].notna().any():
        best = str(finished.loc[finished["best_val"].idxmin(), "variant"])
    return table, pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(), best


def plot(curves: pd.DataFrame, best: str | None, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    for name, part in curves.groupby("variant", sort=False) if not curves.empty else []:
        part = part.sort_values("step")
        ax.plot(part["step"], part["loss"], lw=2.2 if name == best else 1.1,
                label=f"{name}{'  (best)' if name == best else ''}")
    ax.set_yscale("log")
    ax.set_xlabel("update")
    ax.set_ylabel("training loss (nats per supervised token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if not curves.empty:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def comparison_html(table: pd.DataFrame, best: str | None, run: str) -> str:
    columns = list(table.columns)
    rows = []
    for record in table.itertuples(index=False):
        cells = [fmt_cell(v) for v in record]
        if best is not None and record.variant == best:
            cells[0] = f'<td class="best">{html.escape(record.variant)} (best)</td>'
        rows.append(cells)
    stopped = table[table["stopped"] != "finished"]
    notes = "".join(f"<li><b>{html.escape(r.variant)}</b>: {html.escape(r.stopped)}</li>"
                    for r in stopped.itertuples(index=False))
    body = [
        "<p class=\"note\">Every variant of the sweep: its trainer overrides, where it stopped, validation loss "
        "at its last stage (raw weights and each EMA rate) and the best full evaluation of its run, held-out exact "
        "match. The best variant is the finished one with the lowest best validation loss; its exports are in "
        f"<code>{html.escape(str(layout.RunTree(run).best_link / layout.EXPORT_DIR))}/</code>.</p>",
        f"<p><b>Best variant:</b> {html.escape(best) if best else 'none finished'}</p>",
        f"<h2>Stopped early</h2><ul>{notes}</ul>" if notes else "<p>Every variant ran to the end.</p>",
        html_table([html.escape(c) for c in columns], rows, left=3),
    ]
    return html_page(f"Sweep of run {run}", "\n".join(body))


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"{what} {item!r}: expected NAME=VALUE")
        out[name] = value
    return out


def main_prune(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline sweep-prune", description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True)
    ap.add_argument("--keep", type=int, required=True)
    ap.add_argument("--variant", nargs="+", required=True, help="NAME=<its eval/<stage>.json>")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    decision = prune(args.stage, args.keep, {n: Path(p) for n, p in _pairs(args.variant, "--variant").items()})
    write_json(args.out, decision, sort_keys=False)
    print(f"after {args.stage}: {', '.join(decision['kept'])} go on")
    for name, reason in decision["stopped"].items():
        print(f"  {name}: {reason}")
    return 0


def main_compare(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline sweep-compare", description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="results/<run>")
    ap.add_argument("--variant", nargs="+", required=True, help="NAME=<its results dir>")
    ap.add_argument("--overrides", nargs="*", default=[], help="NAME=<JSON list of its trainer overrides>")
    ap.add_argument("--stages", nargs="+", required=True, help="the run's stages in order")
    ap.add_argument("--prune", nargs="*", default=[], help="prune decisions (sweep-prune outputs), or 'none'")
    ap.add_argument("--out-csv", type=Path, required=True)
    ap.add_argument("--out-plot", type=Path, required=True)
    ap.add_argument("--out-html", type=Path, required=True)
    ap.add_argument("--out-best", type=Path, required=True)
    args = ap.parse_args(argv)
    variants = {n: Path(p) for n, p in _pairs(args.variant, "--variant").items()}
    overrides = {n: json.loads(v) for n, v in _pairs(args.overrides, "--overrides").items()}
    decisions = [json.loads(Path(p).read_text()) for p in args.prune if p != "none"]
    table, curves, best = compare(variants, overrides, args.stages, decisions)
    write_text(args.out_csv, table.to_csv(index=False))
    plot(curves, best, args.out_plot, f"sweep of {args.run.name}: training loss of {len(variants)} variants")
    write_text(args.out_html, comparison_html(table, best, str(args.run)))
    tree = layout.RunTree(args.run)
    link = tree.best_link
    if link.is_symlink() or link.exists():
        link.unlink()
    if best is not None:
        # relative (<run>/sweep/best -> ../variants/<name>): the run dir stays movable
        os.symlink(os.path.relpath(tree.variant(best).root, link.parent), link)
    write_json(args.out_best, {"best": best, "path": str(link) if best else None,
                               "best_val": None if best is None else float(table.set_index("variant").loc[best, "best_val"])})
    with pd.option_context("display.width", 160, "display.max_columns", 12):
        print(table.to_string(index=False))
    print(f"best variant: {best} -> {link}" if best else "no variant finished")
    return 0
