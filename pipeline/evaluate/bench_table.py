"""The benchmark table: base vs each trained weight set per lm-eval task and metric, with the
standard error of their difference.

Read from the benchmark jobs' records (`pipeline.evaluate.benchmarks`): one row per (task, metric,
trained weights) with the base model's score (`base`), the trained weights' (`final`), their
difference (`delta`), each with its standard error. Both models answered the same documents, so
where the metric is a mean over documents the difference's standard error is the paired one,
sd(final_i - base_i) / sqrt(n) (`stderr_kind` paired): much tighter than treating the two scores
as independent, sqrt(se_base^2 + se_final^2), which is what a metric that is not such a mean gets
(`independent`). Also the task's few-shot count, limit, chat-template use and lm-eval version.

`benchmark-report` writes it as eval/benchmarks.csv (pipeline.evaluate.bench_report); `summarize`
adds its scores to summary.csv (`summary_rows`) and its table to summary.html (`into_page`).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import pandas as pd

from pipeline import layout

COLUMNS = ["task", "metric", "weights", "n", "base", "base_stderr", "final", "final_stderr", "delta", "delta_stderr",
           "stderr_kind", "higher_is_better", "num_fewshot", "limit", "chat_template", "lm_eval"]
BENCH_STAGE = "benchmark"  # the `stage` of the benchmark rows in summary.csv


def load(paths: list[Path]) -> dict[tuple[str, str], dict]:
    """(weights, task) -> a benchmark job's record."""
    out = {}
    for path in paths:
        record = json.loads(Path(path).read_text())
        out[(record["weights"], record["task"])] = record
    return out


def _docs(record: dict, row: dict) -> dict[str, float]:
    """The per-document scores of a score row ("task/doc id" -> score) over the tasks it aggregates."""
    out = {}
    for leaf in record.get("leaves", {}).get(row["task"], []):
        for doc, value in record.get("docs", {}).get(leaf, {}).get(row["label"], {}).items():
            out[f"{leaf}/{doc}"] = value
    return out


def _is_mean_of(value: float, docs: dict[str, float]) -> bool:
    return bool(docs) and math.isclose(value, sum(docs.values()) / len(docs), rel_tol=1e-9, abs_tol=1e-12)


def difference(base: dict, base_row: dict, final: dict, final_row: dict) -> tuple[float, float | None, str]:
    """(final - base, its standard error, "paired" | "independent") for one score row of each."""
    delta = final_row["value"] - base_row["value"]
    b, f = _docs(base, base_row), _docs(final, final_row)
    if b and b.keys() == f.keys() and _is_mean_of(base_row["value"], b) and _is_mean_of(final_row["value"], f):
        d = [f[k] - b[k] for k in b]
        n = len(d)
        mean = sum(d) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else float("nan")
        return delta, sd / math.sqrt(n), "paired"
    if base_row["stderr"] is None or final_row["stderr"] is None:
        return delta, None, "independent"
    return delta, math.hypot(base_row["stderr"], final_row["stderr"]), "independent"


def table(records: dict[tuple[str, str], dict], weights: list[str]) -> pd.DataFrame:
    """The benchmarks.csv rows: every (task, metric) of every task, for each trained weight set in
    `weights` order (one row without a trained set when only the base was scored)."""
    tasks = list(dict.fromkeys(task for _, task in records))
    trained = [w for w in weights if w != layout.BENCH_BASE]
    rows = []
    for task in tasks:
        base = records.get((layout.BENCH_BASE, task))
        finals = [(w, records[(w, task)]) for w in trained if (w, task) in records]
        any_record = base or finals[0][1]
        for score in any_record["scores"]:
            key = (score["task"], score["label"])
            base_row = _row(base, key)
            common = {"task": score["task"], "metric": score["label"], "n": score.get("n"),
                      "higher_is_better": score.get("higher_is_better"),
                      **{k: any_record.get(k) for k in ("num_fewshot", "limit", "lm_eval")},
                      "chat_template": any_record.get("chat_template_applied"),
                      "base": base_row["value"] if base_row else None, "base_stderr": base_row["stderr"] if base_row else None}
            if not finals:
                rows.append({**common, "weights": None})
            for name, record in finals:
                final_row = _row(record, key)
                row = {**common, "weights": name, "final": final_row["value"] if final_row else None,
                       "final_stderr": final_row["stderr"] if final_row else None}
                if base_row and final_row:
                    row["delta"], row["delta_stderr"], row["stderr_kind"] = difference(base, base_row, record, final_row)
                rows.append(row)
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def _row(record: dict | None, key: tuple[str, str]) -> dict | None:
    if record is None:
        return None
    return next((r for r in record["scores"] if (r["task"], r["label"]) == key), None)


def summary_rows(bench_csv: Path, last_update: int | None = None) -> pd.DataFrame:
    """summary.csv's benchmark rows: one per (task, metric, weights), the base model's first, each
    with its score and standard error; a trained set's with its difference from the base too."""
    bench = pd.read_csv(bench_csv)
    rows = []
    for (task, metric), group in bench.groupby(["task", "metric"], sort=False):
        first = group.iloc[0]
        if pd.notna(first["base"]):
            rows.append({"stage": BENCH_STAGE, "step": 0, "weights": layout.BENCH_BASE, "task": task, "metric": metric,
                         "score": first["base"], "stderr": first["base_stderr"], "n_test": first["n"]})
        for r in group[group["weights"].notna()].itertuples():
            rows.append({"stage": BENCH_STAGE, "step": last_update, "weights": r.weights, "task": task, "metric": metric,
                         "score": r.final, "stderr": r.final_stderr, "delta": r.delta, "delta_stderr": r.delta_stderr,
                         "n_test": r.n})
    return pd.DataFrame(rows)


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}"


def _pm(value, stderr) -> str:
    text = _fmt(value)
    return f"{text} <small>± {_fmt(stderr)}</small>" if text and _fmt(stderr) else text


def _verdict(r) -> str:
    """better / worse when the difference is beyond two standard errors, in the metric's direction
    (higher is better unless lm-eval says otherwise)."""
    if pd.isna(r.delta) or pd.isna(r.delta_stderr) or abs(r.delta) <= 2 * r.delta_stderr:
        return ""
    lower_is_better = r.higher_is_better is False or str(r.higher_is_better) == "False"
    return ' class="pass"' if (r.delta > 0) != lower_is_better else ' class="fail"'


def table_html(bench: pd.DataFrame) -> str:
    """The benchmark table: task, metric, n, base, each trained set, difference (± standard errors)."""
    head = ["task", "metric", "n", "base model", "weights", "score", "difference (paired s.e.)"]
    body = []
    for r in bench.itertuples():
        kind = "" if pd.isna(r.stderr_kind) or r.stderr_kind == "paired" else " <small>(independent)</small>"
        body.append(f"<tr><td class=\"l\">{html.escape(str(r.task))}</td><td class=\"l\">{html.escape(str(r.metric))}</td>"
                    f"<td>{'' if pd.isna(r.n) else int(r.n)}</td><td>{_pm(r.base, r.base_stderr)}</td>"
                    f"<td class=\"l\">{'' if pd.isna(r.weights) else html.escape(str(r.weights))}</td>"
                    f"<td>{_pm(r.final, r.final_stderr)}</td><td{_verdict(r)}>{_pm(r.delta, r.delta_stderr)}{kind}</td></tr>")
    left = ' class="l"'
    cells = "".join(f"<th{left if h in ('task', 'metric', 'weights') else ''}>{h}</th>" for h in head)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table>"


def note(bench: pd.DataFrame) -> str:
    """How the scores were made: lm-eval version, few-shot, limit, chat template (per task when they differ)."""
    parts = []
    for task, group in bench.groupby("task", sort=False):
        r = group.iloc[0]
        shots = "the task's default few-shot" if pd.isna(r.num_fewshot) else f"{int(r.num_fewshot)}-shot"
        limit = "" if pd.isna(r.limit) else f", first {r.limit:g} documents" if r.limit >= 1 else f", {100 * r.limit:g}% of the documents"
        chat = "the run's chat template" if r.chat_template is True or r.chat_template == "True" else "no chat template"
        parts.append(f"{task}: {shots}{limit}, {chat}")
    version = bench["lm_eval"].dropna()
    return (f"Scored with lm-evaluation-harness {version.iloc[0] if not version.empty else '?'} "
            f"({'; '.join(parts)}). ± the standard error; the difference's is paired over the same documents "
            "where the metric is a mean over documents.")


def into_page(page: str, bench_csv: Path | None) -> str:
    """`page` (summary.html) with the benchmark table before its end, when there is one."""
    if bench_csv is None:
        return page
    bench = pd.read_csv(bench_csv)
    section = (f"<h2>Benchmarks (lm-eval: base model vs trained weights)</h2>\n<p class=\"note\">{html.escape(note(bench))}"
               f"</p>\n{table_html(bench)}\n")
    return page.replace("</body>", section + "</body>", 1)
