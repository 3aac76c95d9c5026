"""The report's landing page (overview.html): the loss plot, every stage with its updates, losses
and where its time went, the exported dirs with the merge check and the smoke test, and the
held-out samples of the last evaluation; and the samples page (samples.html) with every stage's.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from pipeline import layout
from pipeline.evaluate.pages import duration, fmt_cell, html_page, html_table
from pipeline.evaluate.skipped import skipped_in
from pipeline.evaluate.tables import sample_sets


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
                    + [html.escape(duration(r["wall_s"])) if r["wall_s"] is not None else "",
                       html.escape(duration(r["update_s"])) if r["update_s"] is not None else "",
                       html.escape(duration(r["eval_s"])) if r["eval_s"] else "",
                       html.escape(duration(r["stage_eval_s"])) if r["stage_eval_s"] is not None else "",
                       html.escape(_clock(r["finished"]))])
    walls = [r["wall_s"] for r in rows if r["wall_s"] is not None]
    if walls:
        body.append(["<b>all stages</b>", str(sum(r["updates"] for r in rows)), ""] + [""] * len(weights)
                    + [f"<b>{'&ge; ' if len(walls) < len(rows) else ''}{html.escape(duration(sum(walls)))}</b>",
                       html.escape(duration(sum(r["update_s"] or 0 for r in rows))),
                       html.escape(duration(sum(r["eval_s"] or 0 for r in rows))),
                       html.escape(duration(sum(r["stage_eval_s"] or 0 for r in rows))), ""])
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
