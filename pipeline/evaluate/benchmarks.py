"""`python -m pipeline benchmark`: score one set of weights on one lm-eval task.

    python -m pipeline benchmark --weights results/<run>/export/merged --name merged --task mmlu \
        --cache-dir results/<run>/eval/bench/cache --out results/<run>/eval/bench/merged/mmlu.json \
        [--base DIR] [--tokenizer DIR] [--num-fewshot N] [--limit L] [--batch-size 8|auto] [--no-chat-template]

`--weights` is an export dir (merged/, or an adapter dir, loaded on `--base` or the base it
names, grown to the run's vocabulary: `pipeline.model.exported`) or, for the base model,
the base dir with `--tokenizer` the run's tokenizer. lm-eval's Python API scores it:
`simple_evaluate` on an `HFLM` wrapped around the loaded model and the run's tokenizer,
with its chat template applied to the prompts (unless `--no-chat-template`, or the
tokenizer has none) and few-shot examples as turns of the chat. `--task` is an lm-eval
task, group or tag name, or the path of a task YAML.

Offline: the job sets `HF_DATASETS_OFFLINE=1` and friends before anything reads them; a
task whose data is not cached fails with one line saying how to fetch it (the workflow
checks that when it loads: `pipeline.planning.benchmarks.data_problems`).

Cached by content: the key is the sha256 of the files the weights load from (the export,
its base, the tokenizer), the task (its YAML, includes, code and local data), the lm-eval
version, the few-shot count, limit and chat-template choice. A result with that key in
`--cache-dir` is copied (`"cached": true`) instead of scoring again: Snakemake reruns the
job when its weights dir is newer, and a retraining that reproduces the same weights
costs a hash, not a benchmark.

The output JSON: the scores of the task (or of each of its tasks, for a tag) with their
standard errors as lm-eval reports them, and each document's per-document score
(`docs`, by task and metric), from which the report pairs base and final on the same
documents for the standard error of their difference (`pipeline.evaluate.bench_report`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from pipeline.errors import UserError
from pipeline.planning.benchmarks import (OFFLINE_ENV, BenchTask, content_key, lm_eval_version, read_task_yaml,
                                          task_name)

log = logging.getLogger(__name__)

BOOTSTRAP_ITERS = 1000  # resamples for the standard error of a metric that is not a mean (means: exact)


def metric_label(metric: str, filter_name: str) -> str:
    """`acc` for lm-eval's "acc,none"; `exact_match/strict-match` for "exact_match,strict-match"."""
    return metric if filter_name == "none" else f"{metric}/{filter_name}"


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else None


def scores(results: dict, name: str) -> list[dict]:
    """The metrics of `name` in lm-eval's results (a task, or a group's aggregate); of each of its
    tasks when it has none of its own (a tag, a group without an aggregate)."""
    table = results["results"]
    rows = _entry_scores(name, table.get(name, {}))
    if rows:
        return rows
    return [row for leaf in sorted(results.get("samples", {})) for row in _entry_scores(leaf, table.get(leaf, {}))]


def _entry_scores(task: str, entry: dict) -> list[dict]:
    rows = []
    for key, value in entry.items():
        if "," not in key or "_stderr," in key or _number(value) is None:
            continue
        metric, filter_name = key.split(",", 1)
        rows.append({"task": task, "metric": metric, "filter": filter_name, "label": metric_label(metric, filter_name),
                     "value": float(value), "stderr": _number(entry.get(f"{metric}_stderr,{filter_name}"))})
    return rows


def leaves(results: dict, name: str) -> list[str]:
    """The tasks (not groups) under `name` that lm-eval scored documents of."""
    groups = results.get("group_subtasks", {})
    scored = set(results.get("samples", {}))
    if name in scored:
        return [name]
    out, todo = [], list(groups.get(name, [])) or sorted(scored)
    while todo:
        child = todo.pop(0)
        if child in scored:
            out.append(child)
        todo += groups.get(child, [])
    return sorted(set(out))


def document_scores(results: dict) -> dict[str, dict[str, dict[str, float]]]:
    """{task: {metric label: {doc id: score}}} for every scalar per-document score lm-eval logged."""
    out: dict = {}
    for task, samples in results.get("samples", {}).items():
        for sample in samples:
            label_of = lambda m: metric_label(m, sample.get("filter", "none"))  # noqa: E731
            for metric in sample.get("metrics", []):
                value = _number(sample.get(metric))
                if value is not None:
                    out.setdefault(task, {}).setdefault(label_of(metric), {})[str(sample["doc_id"])] = value
    return out


def job_record(results: dict, task: BenchTask) -> dict:
    """What the job keeps of lm-eval's results (JSON-safe)."""
    rows = scores(results, task.name)
    higher = results.get("higher_is_better", {})
    for row in rows:
        row["n"] = sum(int(results.get("n-samples", {}).get(leaf, {}).get("effective", 0))
                       for leaf in leaves(results, row["task"]))
        row["higher_is_better"] = higher.get(row["task"], {}).get(row["metric"])
    return {
        "scores": rows,
        "leaves": {row["task"]: leaves(results, row["task"]) for row in rows},
        "docs": document_scores(results),
        "n_shot": results.get("n-shot", {}),
        "versions": {k: str(v) for k, v in results.get("versions", {}).items()},
    }


def _device_and_dtype():
    import torch

    if torch.cuda.is_available():
        return "cuda", "auto"  # the dtype the weights are stored in
    return "cpu", torch.float32  # CPU: fp32 (bf16 on CPUs is slow, and it is what every CPU job computes in)


def evaluate(weights: Path, task: BenchTask, *, base=None, tokenizer=None, batch_size=8) -> tuple[dict, bool]:
    """(lm-eval's results with every document logged, whether the chat template was applied) of the
    weights (`pipeline.model.exported.load`: a model dir, an adapter on its grown base, or a base with
    the run's `tokenizer`) on `task`. The task is built first: missing data fails before any model loads."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from pipeline.evaluate import bench_data
    from pipeline.model import exported

    _, name, manager = bench_data.build(task.spec())
    device, dtype = _device_and_dtype()
    model, tok = exported.load(weights, base=base, tokenizer=tokenizer, device=device, dtype=dtype)
    chat = bool(task.chat_template and tok.chat_template)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size)
    results = simple_evaluate(model=lm, tasks=[name], task_manager=manager, num_fewshot=task.num_fewshot,
                              limit=task.limit, apply_chat_template=chat, fewshot_as_multiturn=chat,
                              log_samples=True, bootstrap_iters=BOOTSTRAP_ITERS)
    return results, chat


def run(args, task: BenchTask) -> dict:
    """Score the task, return what the job records of it."""
    t0 = time.time()
    results, chat = evaluate(args.weights, task, base=args.base, tokenizer=args.tokenizer, batch_size=args.batch_size)
    return {**job_record(results, task), "chat_template_applied": chat, "device": _device_and_dtype()[0],
            "seconds": round(time.time() - t0, 2)}


def task_of(args) -> BenchTask:
    spec = args.task
    name = task_name(read_task_yaml(Path(spec))) if spec.endswith((".yaml", ".yml")) else spec
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    return BenchTask(name, spec if spec != name else None, args.num_fewshot, limit, args.chat_template)


def _batch_size(text: str):
    return text if text.startswith("auto") else int(text)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline benchmark", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=Path, required=True, help="export dir (merged or adapter), or the base model dir")
    ap.add_argument("--name", required=True, help="the weights' name in the results (base, merged, adapter_ema, ...)")
    ap.add_argument("--base", help="an adapter's base model dir (or hub model.json); default: the one it names")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: the weights dir's own); the run's for the base")
    ap.add_argument("--task", required=True, help="lm-eval task / group / tag name, or a task YAML path")
    ap.add_argument("--num-fewshot", type=int, default=None)
    ap.add_argument("--limit", type=float, default=None, help="documents per task (a fraction when < 1)")
    ap.add_argument("--batch-size", type=_batch_size, default=8, help="an integer or auto")
    ap.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                    help="render prompts with the tokenizer's chat template (when it has one)")
    ap.add_argument("--cache-dir", type=Path, required=True, help="scores by content key (undeclared, kept across reruns)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    os.environ.update(OFFLINE_ENV)  # before datasets / transformers read them
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from pipeline.model.exported import adapter_base, is_adapter, model_dir

    args.weights = model_dir(args.weights)  # a hub base's model.json: its cached snapshot
    task = task_of(args)
    version = lm_eval_version()
    if version is None:
        raise UserError("the benchmark jobs need lm-eval: pip install -e . (or: pip install 'lm-eval>=0.4.10')")
    dirs = [args.weights] + ([adapter_base(args.weights, args.base)] if is_adapter(args.weights) else [])
    dirs += [args.tokenizer] if args.tokenizer is not None else []
    key = content_key(dirs, task, version)
    cached = args.cache_dir / f"{key}.json"
    if cached.is_file():
        record = {**json.loads(cached.read_text()), "cached": True}
        log.info("%s on %s: same weights, task and settings as %s; scores copied", args.name, task.name, cached)
    else:
        record = {"task": task.name, "spec": task.spec(), "key": key, "lm_eval": version,
                  **task.settings(), **run(args, task), "cached": False}
        _write_atomic(cached, record)
    record.update(weights=args.name, weights_dir=str(args.weights))
    _write_atomic(args.out, record)
    for row in record["scores"]:
        stderr = f" +- {row['stderr']:.4f}" if row["stderr"] is not None else ""
        print(f"{args.name} {row['task']} {row['label']}: {row['value']:.4f}{stderr} (n={row['n']})")
    return 0


def _write_atomic(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
