"""`python -m pipeline fetch-benchmarks`: the data of lm-eval tasks, into the local caches.

    python -m pipeline fetch-benchmarks mmlu gsm8k ifeval      # where there is network (a login node)
    python -m pipeline fetch-benchmarks my_tasks/qa.yaml       # a task YAML of your own
    python -m pipeline fetch-benchmarks --check mmlu           # offline: is everything there?

Each task is built as lm-eval builds it before scoring: its dataset is loaded through
`datasets.load_dataset` (which downloads and prepares it into the Hugging Face datasets
cache: `HF_DATASETS_CACHE`, else `$HF_HOME/datasets`, else `~/.cache/huggingface/datasets`),
and its code is imported (IFEval's fetches nltk's `punkt_tab` into `NLTK_DATA` or
`~/nltk_data` then). On a cluster, point those at a file system the compute nodes share.

`--check` builds them with `HF_DATASETS_OFFLINE=1` and friends (the benchmark jobs' settings,
`pipeline.planning.benchmarks.OFFLINE_ENV`) and never reaches the network: nltk downloads
are recorded instead of attempted. It prints one line per task that cannot be built, naming
the task and how to fetch it, and exits 1 if there is any; the workflow runs it when it loads
(`pipeline.planning.benchmarks.data_problems`), so a missing dataset stops `snakemake` before
any job. The benchmark job (pipeline.evaluate.benchmarks) builds its task the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from pathlib import Path

from pipeline.errors import UserError
from pipeline.planning.benchmarks import FETCH, OFFLINE_ENV, read_task_yaml, self_contained, task_name


def task_manager(spec: str):
    """(lm-eval's name of the task, a TaskManager that knows it) for a task name or a task YAML path.

    A self-contained YAML (one task, no `include`) is indexed alone, which takes milliseconds; one
    that includes or groups others is indexed with lm-eval's own tasks (seconds), as are names.
    """
    from lm_eval.tasks import TaskManager

    if not spec.endswith((".yaml", ".yml")):
        return spec, _lm_eval_tasks()
    name = task_name(read_task_yaml(Path(spec)))
    return name, TaskManager(include_path=str(Path(spec).parent), include_defaults=not self_contained(Path(spec)))


@functools.lru_cache(maxsize=1)
def _lm_eval_tasks():
    """lm-eval's own task index (seconds to build: once per process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


@contextlib.contextmanager
def recorded_nltk_downloads(missing: list[str]):
    """nltk.download(...) as a task's code calls it, recorded in `missing` instead of reaching the
    network (IFEval's module asks for punkt_tab when it is imported and nltk lacks it). nltk is
    patched when something imports it (a second or so: not paid by tasks that never do)."""
    def record(info_or_id=None, *args, **kwargs):
        missing.append(str(info_or_id))
        return False

    def patch(module):
        module.__dict__.setdefault("_pipeline_download", module.download)
        module.download = record

    hook = _AfterImport("nltk", patch)
    if "nltk" in sys.modules:
        patch(sys.modules["nltk"])
    else:
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        nltk = sys.modules.get("nltk")
        if nltk is not None and "_pipeline_download" in nltk.__dict__:
            nltk.download = nltk.__dict__.pop("_pipeline_download")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once the module `name` has been imported (a meta-path finder that wraps
    its loader): a patch for a module that may never be imported costs nothing."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load, then = spec.loader.exec_module, self.then

        def exec_module(module):
            load(module)
            then(module)

        spec.loader.exec_module = exec_module
        return spec


def build(spec: str, *, fetching: bool = False) -> tuple[list[str], str, object]:
    """(the names of the tasks `spec` builds, a group's or tag's leaf tasks; lm-eval's name of it; the
    TaskManager that built them), loaded offline when the environment says so; raises UserError naming
    the task when its data or nltk resources are missing."""
    name, manager = task_manager(spec)
    missing: list[str] = []
    try:
        with recorded_nltk_downloads(missing):
            tasks = _built_tasks(manager, name)
    except KeyError:
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        raise UserError(f"evaluate.benchmarks: task {name}: lm-eval has no task, group or tag of that name"
                        + (f" (close: {', '.join(close)})" if close else "")) from None
    except Exception as err:
        # datasets' missing-data errors: OSError (ConnectionError, FileNotFoundError), ValueError (a
        # config not in the cache), and its own *NotFoundError / OfflineModeIsEnabled, known by name
        if not isinstance(err, (OSError, ValueError)) and not type(err).__name__.endswith(
                ("NotFoundError", "OfflineModeIsEnabled")):
            raise
        raise UserError(not_cached(spec, name, err, fetching=fetching)) from None
    if missing:
        raise UserError(f"evaluate.benchmarks: task {name} needs nltk data {', '.join(sorted(set(missing)))}, "
                        f"not found (NLTK_DATA or ~/nltk_data); fetch it where there is network: {FETCH} {spec}")
    return tasks, name, manager


def _built_tasks(manager, name: str) -> list[str]:
    """Build task, group or tag `name` (its data loaded) with `manager`; the names of the tasks built.

    lm-eval 0.4.13 deprecates `get_task_dict` and `TaskManager.load_task_or_group` for `TaskManager.load`
    (flat dicts: leaf tasks, groups); 0.4.10, this project's floor, has only the former (a dict nested by
    group). Both raise KeyError for a name they do not know.
    """
    if hasattr(manager, "load"):
        return sorted(manager.load([name])["tasks"])
    from lm_eval.tasks import get_task_dict

    def leaves(tasks: dict) -> list[str]:
        return [n for key, value in tasks.items()
                for n in (leaves(value) if isinstance(value, dict) else [str(key)])]

    return sorted(leaves(get_task_dict([name], manager)))


def not_cached(spec: str, name: str, err: BaseException, *, fetching: bool = False) -> str:
    """The one line that says a task's data is missing and how to fetch it (or that fetching failed)."""
    cause = " ".join(str(err).split())[:300]
    if fetching:
        return f"evaluate.benchmarks: task {name}: fetching its data failed ({cause}); is there network here?"
    return (f"evaluate.benchmarks: task {name}: its data is not in the local Hugging Face datasets cache "
            f"({cause}); fetch it where there is network: {FETCH} {spec}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline fetch-benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tasks", nargs="+", help="lm-eval task, group or tag names, or paths of task YAMLs")
    ap.add_argument("--check", action="store_true",
                    help="offline: report the tasks whose data is missing (exit 1), fetch nothing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.check:
        os.environ.update(OFFLINE_ENV)  # before datasets is imported: it reads them once
    problems = []
    for spec in args.tasks:
        try:
            tasks, _, _ = build(spec, fetching=not args.check)
        except UserError as err:
            if not args.check:
                raise
            problems.append(str(err))
            continue
        if not args.check:
            print(f"{spec}: cached ({len(tasks)} task{'s' * (len(tasks) != 1)} built)")
    for line in problems:
        print(line)
    return 1 if problems else 0
