"""HTML pages of the run for `snakemake --report`, which shows them inline (it only offers JSON
and CSV as downloads): the summary table, the plan and the pilot gate; and the small HTML kit
(`html_page`, `html_table`, `fmt_cell`) the other pages and the sweep comparison build on.
"""

from __future__ import annotations

import html
import math

import pandas as pd

from pipeline.evaluate.skipped import GATE_BASIS, NO_TEST, NO_VAL, skipped_in
from pipeline.evaluate.tables import COLUMNS


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


def _skipped_note(phrases: list[str], *which: str) -> str:
    """The note that stands where a skipped measurement would be ('' when none of `which` was skipped)."""
    shown = [p for p in phrases if p in which]
    return "".join(f"<p class=\"note skipped\">{html.escape(p)}</p>" for p in shown)


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
                       f"{duration(eta)}" if eta is not None else "") + ".</p>")
    return html_page(f"Plan{' of run ' + run if run else ''}", "\n".join(body))


def duration(seconds) -> str:
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
    facts = [["median time per update", duration(gate.get("median_step_s"))],
             ["updates after the pilot", fmt_cell(gate.get("remaining_updates"))],
             ["estimated time for them", duration(gate.get("eta_seconds"))],
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
