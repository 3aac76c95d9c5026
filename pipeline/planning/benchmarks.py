"""`evaluate.benchmarks` as the workflow reads it when it loads: the lm-eval tasks, their cache keys,
the weights to score, and the offline data check. Torch-free and lm-eval-free (the Snakefile imports
it); the jobs run `python -m pipeline benchmark` (pipeline.evaluate.benchmarks).

A task is an lm-eval task, group or tag by name (its config ships with lm-eval), the path of a task
YAML of the user's own, or `embedded` (the demo's multiple-choice task, written by `demo_benchmark`
from the held-out split `prepare_base` builds).

Caching. Snakemake reruns a job when an input is newer than its output or a param changed. So a
task's key (`fingerprint`) is a param: its name, the lm-eval version, the few-shot count, limit and
chat-template choice, and, for a task YAML, the content of the YAML, of the YAMLs it includes, of
the Python files its `!function` tags name and of the local data files it reads. A comment in a
task YAML (parsed content, not text), a touched file or a batch-size change reruns nothing; an
edited document, an lm-eval upgrade or another few-shot count reruns that task's jobs. The
weights are inputs (an export dir is newer after a retraining); the job itself then keys its
scores on the weights' content (`weights_files`), so a rerun on byte-identical weights copies its
scores from `eval/bench/cache/` instead of scoring again.

Offline. Every job runs with `OFFLINE_ENV`. A task whose data is not in the local Hugging Face
datasets cache stops `snakemake` before any job (`data_problems`), one line per task naming it
and the command that fetches it where there is network (`python -m pipeline fetch-benchmarks`).
A local task (a packaged `datasets` builder such as `json` over local `data_files`) needs no
network and no check beyond its files existing.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline import layout

SECTION = "benchmarks"  # the workflow config's evaluate.benchmarks
EMBEDDED = "embedded"  # evaluate.benchmarks.tasks: the embedded demo's own task
# What every benchmark job (and the data check) runs under: datasets, hub files, transformers and
# evaluate metrics from the local caches only, never the network.
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_EVALUATE_OFFLINE": "1"}
# `datasets` builders that read local files (`data_files`) and need no hub.
LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "arrow", "text", "pandas"})
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a task name that is also a file name
FETCH = "python -m pipeline fetch-benchmarks"


@dataclass(frozen=True)
class BenchTask:
    """One task of `evaluate.benchmarks.tasks`, with the settings it is scored with."""

    name: str  # lm-eval's name of the task (or group): eval/bench/<weights>/<name>.json
    file: str | None  # its YAML (the user's, or the demo's); None: a task lm-eval ships
    num_fewshot: int | None  # None: the task's own default
    limit: float | None  # documents per task (a fraction when < 1); None: all
    chat_template: bool  # render the prompts with the run tokenizer's chat template
    embedded: bool = False  # the demo's task, written by a job (its files are the jobs' inputs)
    local: bool = False  # reads only local data files: nothing to fetch

    def settings(self) -> dict:
        return {"num_fewshot": self.num_fewshot, "limit": self.limit, "chat_template": self.chat_template}

    def spec(self) -> str:
        """How the job and `fetch-benchmarks` name it: the YAML's path, or lm-eval's name."""
        return self.file or self.name


class _TolerantLoader(yaml.SafeLoader):
    """lm-eval's YAML with its tags (`!function utils.process_docs`) kept as text."""


_TolerantLoader.add_multi_constructor("!", lambda loader, tag, node: f"!{tag} {loader.construct_scalar(node)}")


def read_task_yaml(path: Path) -> dict:
    """A task YAML with the YAMLs it `include`s merged under it (its own keys win), as lm-eval does."""
    path = Path(path)
    cfg = yaml.load(path.read_text(), Loader=_TolerantLoader) or {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a mapping")
    merged: dict = {}
    includes = cfg.pop("include", None) or []
    for inc in includes if isinstance(includes, list) else [includes]:
        merged.update(read_task_yaml(path.parent / inc))
    return {**merged, **cfg}


def task_name(cfg: Mapping) -> str | None:
    """lm-eval's name of a task YAML's task (`task:`), or of its group (`group:`)."""
    name = cfg.get("task") if isinstance(cfg.get("task"), str) else cfg.get("group")
    return name if isinstance(name, str) else None


def self_contained(path: Path) -> bool:
    """One task, all in this YAML: no `include`, no `group` (lm-eval need not index its own tasks for it)."""
    raw = yaml.load(Path(path).read_text(), Loader=_TolerantLoader) or {}
    return isinstance(raw.get("task"), str) and "include" not in raw and "group" not in raw


def task_files(path: Path) -> list[Path]:
    """Every file a task YAML's scores depend on: itself, its includes, the Python modules of its
    `!function` tags (beside it, as lm-eval finds them) and its local `data_files` (relative to the
    directory the jobs run in, as `datasets` reads them)."""
    path = Path(path)
    files = [path]
    raw = yaml.load(path.read_text(), Loader=_TolerantLoader) or {}
    includes = raw.get("include") or []
    for inc in includes if isinstance(includes, list) else [includes]:
        files += task_files(path.parent / inc)
    for text in _strings(raw):
        if text.startswith("!function "):
            module = text.split(" ", 1)[1].strip().rsplit(".", 1)[0]
            files.append(path.parent / f"{module.replace('.', '/')}.py")
    files += data_files(read_task_yaml(path))
    return list(dict.fromkeys(files))


def _strings(tree) -> list[str]:
    if isinstance(tree, str):
        return [tree]
    if isinstance(tree, Mapping):
        return [s for v in tree.values() for s in _strings(v)]
    if isinstance(tree, list):
        return [s for v in tree for s in _strings(v)]
    return []


def data_files(cfg: Mapping) -> list[Path]:
    """The local files a task reads through a packaged builder (json, csv, ...); [] for a hub dataset."""
    if cfg.get("dataset_path") not in LOCAL_BUILDERS:
        return []
    given = (cfg.get("dataset_kwargs") or {}).get("data_files") or []
    patterns = _strings(given)
    return [Path(p) for pattern in patterns for p in (sorted(glob.glob(pattern)) or [pattern])]


def is_local(cfg: Mapping) -> bool:
    return cfg.get("dataset_path") in LOCAL_BUILDERS and bool((cfg.get("dataset_kwargs") or {}).get("data_files"))


def _entry(item) -> dict:
    return {"task": item} if isinstance(item, str) else dict(item)


def tasks_of(section: Mapping, embedded_yaml: Path) -> tuple[list[BenchTask], list[str]]:
    """The tasks of `evaluate.benchmarks` (defaults filled by the schema) and every problem with them,
    each naming its key. `embedded_yaml`: where `demo-benchmark` writes the demo's task."""
    out, problems = [], []
    for i, item in enumerate(section.get("tasks") or []):
        entry, key = _entry(item), f"evaluate.benchmarks.tasks[{i}]"
        spec = str(entry["task"])
        settings = {k: entry.get(k, section.get(k)) for k in ("num_fewshot", "limit", "chat_template")}
        if spec == EMBEDDED:
            out.append(BenchTask(layout.DEMO_BENCH_TASK, str(embedded_yaml), **settings, embedded=True, local=True))
        elif spec.endswith((".yaml", ".yml")):
            path = Path(spec).expanduser()
            if not path.is_file():
                problems.append(f"{key}: {spec} does not exist (a task YAML path, or an lm-eval task name)")
                continue
            try:
                cfg = read_task_yaml(path)
            except (OSError, ValueError, yaml.YAMLError) as err:
                problems.append(f"{key}: {spec} is not an lm-eval task YAML: {err}")
                continue
            name = task_name(cfg)
            if name is None:
                problems.append(f"{key}: {spec} names no task (a `task:` or `group:` name)")
                continue
            missing = [str(p) for p in data_files(cfg) if not p.is_file()]
            if missing:
                problems.append(f"{key}: {spec} reads {', '.join(missing)}, which does not exist (data_files are "
                                "read relative to the workflow's directory)")
            out.append(BenchTask(name, str(path), **settings, local=is_local(cfg)))
        else:
            out.append(BenchTask(spec, None, **settings))
    for task in out:
        if not NAME.match(task.name):
            problems.append(f"evaluate.benchmarks.tasks: task name {task.name!r} is not usable as a file name")
    names = [t.name for t in out]
    problems += [f"evaluate.benchmarks.tasks: {n} is listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    return out, problems


def lm_eval_version() -> str | None:
    """The installed lm-eval's version (None when it is not installed); read without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return None


def fingerprint(task: BenchTask, lm_eval: str | None, *, content: bool = True) -> str:
    """sha256 of what a task's scores depend on besides the weights (see the module doc). `content`:
    hash the task's files too (False for the demo task when the workflow loads: its job may
    not have written it yet, and its files are the jobs' inputs)."""
    files = {}
    if task.file and content:
        for path in task_files(Path(task.file)):
            files[str(path)] = _file_digest(path, parsed=path.suffix in (".yaml", ".yml"))
    record = {"task": task.name, "lm_eval": lm_eval, **task.settings(), "files": files}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _file_digest(path: Path, *, parsed: bool = False) -> str:
    """sha256 of a file; of a YAML's parsed content (comments and layout do not count)."""
    if parsed:
        cfg = yaml.load(path.read_text(), Loader=_TolerantLoader)
        return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


# Files of a model dir that do not change what it computes: its card (pipeline.export.card.CARD_FILE, which
# `benchmark-card` edits after the scores), our run records; hidden files (.snakemake_timestamp) too.
_NOT_WEIGHTS = frozenset({"README.md", layout.BEST_META, "pretrain_report.json"})
_ALTERNATE_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")  # ignored beside safetensors (from_pretrained reads those)


def weights_files(model_dir: Path) -> list[Path]:
    """The files of a model or adapter dir that `from_pretrained` reads (weights, configs, tokenizer),
    sorted: what a benchmark's scores depend on. Top level only (a hub snapshot's `original/`
    checkpoint is not read), and no .bin beside .safetensors weights."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.startswith(".")
                   and p.name not in _NOT_WEIGHTS)
    if any(p.suffix == ".safetensors" for p in files):
        files = [p for p in files if p.suffix not in _ALTERNATE_WEIGHTS]
    return files


def content_key(dirs: list[Path], task: BenchTask, lm_eval: str | None) -> str:
    """A benchmark job's cache key: the content of the model dirs it loads (export, base, tokenizer),
    the task with its files, the lm-eval version and the scoring settings."""
    digest = hashlib.sha256(fingerprint(task, lm_eval).encode())
    for directory in dirs:
        for path in weights_files(directory):
            digest.update(f"{path.name}\0{_file_digest(path)}\0".encode())
    return digest.hexdigest()


def weights_problems(weights: list[str], *, has_ema: bool, has_val: bool) -> list[str]:
    """Weights the run does not export: EMA ones without `ema.rates`, the best ones without a validation set."""
    problems = []
    if not has_ema:
        problems += [f"evaluate.benchmarks.weights: {w} needs EMA weights (the trainer's ema.rates is empty)"
                     for w in weights if w in (layout.ADAPTER_EMA, layout.ADAPTER_BEST_EMA)]
    if not has_val:
        problems += [f"evaluate.benchmarks.weights: {w} needs a validation set (data.val is null)"
                     for w in weights if w in (layout.ADAPTER_BEST, layout.ADAPTER_BEST_EMA)]
    return problems


def vision_language_problem(model_dir: Path | None, embedded_kind: str | None) -> str | None:
    """lm-eval's tasks score causal LMs: a vision-language base is refused (its config has a vision part)."""
    vision = embedded_kind == "vlm"
    if model_dir is not None and (Path(model_dir) / "config.json").is_file():
        vision = "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())
    if not vision:
        return None
    return ("evaluate.benchmarks: lm-eval's tasks score text models, and the base model is a vision-language "
            "model: set evaluate.benchmarks.tasks: []")


def data_problems(checked: list[BenchTask], timeout: float = 900) -> list[str]:
    """One line per task whose data is not in the local caches (lm-eval builds each task offline in a
    child process, where HF_DATASETS_OFFLINE=1 takes effect whatever this process imported)."""
    if not checked:
        return []
    cmd = [sys.executable, "-m", "pipeline", "fetch-benchmarks", "--check", *(t.spec() for t in checked)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **OFFLINE_ENV}, timeout=timeout)
    if proc.returncode == 0:
        return []
    lines = [line for line in proc.stdout.splitlines() if line.startswith("evaluate.benchmarks")]
    return lines or [f"evaluate.benchmarks: checking the tasks' data failed ({' '.join(cmd)}): "
                     f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}"]


class Benchmarks:
    """`evaluate.benchmarks` as the workflow's rules use it (workflow/rules/evaluate.smk): the tasks, the
    result files, each job's inputs, flags and cache key. `section`: the validated config section;
    `run`: the run's name; `variants`: the vruns of the trained runs (the run itself without a sweep);
    `demo`: the embedded demo whose task `embedded` means."""

    def __init__(self, section: Mapping, *, run: str, variants: list[str], demo: str):
        self.section, self.variants = section, list(variants)
        self.run, self.demo = layout.RunTree.of(run), layout.RunTree.of(demo)
        self.lm_eval = lm_eval_version()
        tasks, self._problems = tasks_of(section, self.demo.demo_bench_task(".yaml"))
        self.tasks = {t.name: t for t in tasks}
        self.weights = list(section.get("weights") or [])
        self.trained = [w for w in self.weights if w != layout.BENCH_BASE]
        self._keys: dict[str, str] = {}  # task -> its key: a task's files are hashed once per workflow load

    def problems(self, *, has_ema: bool, has_val: bool, model_dir: Path | None, embedded_kind: str | None) -> list[str]:
        """Every problem with the section (its tasks, lm-eval missing, weights the run does not export,
        a vision-language base), each naming its key; [] when benchmarks are off."""
        problems = list(self._problems)
        if not self.tasks:
            return problems
        if self.lm_eval is None:
            problems.append("evaluate.benchmarks: lm-eval is not installed (pip install -e . installs it)")
        problems += weights_problems(self.weights, has_ema=has_ema, has_val=has_val)
        vision = vision_language_problem(model_dir, embedded_kind)
        return problems + ([vision] if vision else [])

    def results(self, task: str, vruns: list[str] | None = None) -> list[Path]:
        """One task's result files: the base model's (once, in the run dir), each trained set's per variant."""
        base = [self.run.benchmark(layout.BENCH_BASE, task)] if layout.BENCH_BASE in self.weights else []
        return base + [layout.RunTree.of(v).benchmark(w, task) for v in (vruns or self.variants) for w in self.trained]

    def all_results(self, vrun: str) -> list[Path]:
        """Every result file a variant's report reads."""
        return [path for task in self.tasks for path in self.results(task, [vrun])]

    def unscored(self) -> list[BenchTask]:
        """The tasks that need their data checked: not local, and with a result still to make (a task
        scored everywhere is not checked again: its data was there)."""
        return [t for t in self.tasks.values() if not t.local and not all(p.exists() for p in self.results(t.name))]

    def inputs(self, task: str, weights: str, vrun: str | None, *, model, tokenizer) -> dict:
        """A job's inputs: the weights (the base model's `model` for base, else the export dir), an
        adapter's base, the run's tokenizer (for base) and the demo task's files (made by a job; a
        user's task YAML is keyed by its content instead)."""
        bench = self.tasks[task]
        inputs = {"task": [bench.file, str(self.demo.demo_bench_task(".jsonl"))] if bench.embedded else []}
        if weights == layout.BENCH_BASE:
            return {**inputs, "weights": model, "tokenizer": tokenizer}
        inputs["weights"] = layout.RunTree.of(vrun).export(weights)
        if weights != layout.MERGED:
            inputs["model"] = model  # an adapter loads on the base
        return inputs

    def flags(self, task: str) -> str:
        """The command's task and scoring settings (params: a changed one reruns the job)."""
        bench = self.tasks[task]
        flags = [f"--task {shlex.quote(bench.spec())}", "--chat-template" if bench.chat_template else "--no-chat-template"]
        flags += [f"--num-fewshot {bench.num_fewshot}"] if bench.num_fewshot is not None else []
        flags += [f"--limit {bench.limit}"] if bench.limit is not None else []
        return " ".join(flags)

    def key(self, task: str) -> str:
        """A task's cache key as a param: its content (not the demo's, whose files are inputs), lm-eval's version."""
        if task not in self._keys:
            bench = self.tasks[task]
            self._keys[task] = fingerprint(bench, self.lm_eval, content=not bench.embedded)
        return self._keys[task]

    def summary_inputs(self, vrun: str) -> list[Path]:
        """What a variant's summarize waits for when benchmarks are on: the table first (its rows go into
        summary.csv), then the page, the plot and the cards (so that they are made with the summary)."""
        if not self.tasks:
            return []
        v = layout.RunTree.of(vrun)
        return [v.benchmarks_csv, v.benchmarks_html, v.benchmarks_plot] + ([v.benchmark_cards] if self.trained else [])

    def task_pattern(self) -> str:
        """The `task` wildcard's constraint: the configured names (nothing matches when there are none)."""
        return "|".join(re.escape(name) for name in self.tasks) or "(?!)"

    def weights_pattern(self) -> str:
        return "|".join(self.trained) or "(?!)"
