"""Nothing trained is lost without the user asking: a changed config meets a finished run.

A run's plan is keyed on its resolved trainer config (and its schedule), so
changing `optim.lr` and running `snakemake` again re-plans the run and retrains
every stage in place: Snakemake deletes each finished stage just before its new
attempt. When the workflow loads, this module compares what each run (each
sweep variant) would train now with what its results were trained with:

- the trainer config: `results/<vrun>/train_config.yaml` (written by `plan`,
  `pipeline.config.to_yaml`) against the config resolved now, value by value,
  so every changed key is named with its old and new value;
- the schedule: `results/<vrun>/plan.json`'s stages against the stages now.

When they differ and the run has trained anything (a finished stage in
`results/<vrun>/stages/`, or an intra-stage checkpoint in `work/<vrun>/<stage>/`),
the workflow config's `on_config_change` decides: `stop` (the default) refuses
to run, naming every change and the two ways on; `archive` moves what was
derived from the old config (plan, train_config.yaml, stages, evaluations,
exports, reports, tracker state, scratch checkpoints) into
`results/<vrun>/archive/<when>-<old config id>/` before any job runs, and the
run retrains. Shared work stays in place: the validated and tokenized data, the
run's tokenizer, the base model's evaluation and benchmark scores (and the
benchmark scores by content key), a hub model's pin, the label page, a sweep's
variants and comparison, earlier archives.

Torch-free: the Snakefile imports it at every start.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import config as train_config
from pipeline import layout
from pipeline.planning.schedule import Stage

MODES = ("stop", "archive")
# Under results/<vrun>/: made from the data and the base model, not from the trainer config (or
# holding other runs: a sweep's variants and its comparison, earlier archives). Never archived.
SHARED = {layout.DATA_DIR, layout.TOKENIZER_DIR, layout.HUB_MODEL_FILE, layout.ARCHIVE_DIR, layout.VARIANTS_DIR,
          layout.SWEEP_DIR}
# Deeper down (paths of files or dirs): the base model's evaluation and benchmark scores, and the
# benchmark scores by content key (pipeline/evaluate/benchmarks.py: valid for whatever config scored them).
_HERE = layout.RunTree("")  # paths relative to a run dir
SHARED_FILES = {_HERE.evaluation(layout.BASE_EVAL).as_posix(), _HERE.labels_html.as_posix(),
                _HERE.benchmarks_of(layout.BENCH_BASE).as_posix(), _HERE.benchmark_cache.as_posix()}
ABSENT = "(not set)"


@dataclass(frozen=True)
class Change:
    key: str
    old: str
    new: str

    def __str__(self) -> str:
        return f"{self.key}: {self.old} -> {self.new}"


@dataclass
class ChangedRun:
    """A run (or sweep variant) whose results were trained with another config than now."""

    vrun: str  # results/<vrun>, work/<vrun>
    label: str  # how the message names it
    changes: list[Change]
    trained: list[str]  # finished stages, then scratch checkpoints ("chunk02 (in progress)")
    old_id: str  # sha256 of the old train_config.yaml: the plan's cache key when it was trained


def _flat(tree, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict) and tree:
        out: dict[str, object] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def _values(yaml_text: str) -> dict[str, object]:
    """The resolved values of a train_config.yaml text, flattened to dotted keys."""
    from omegaconf import OmegaConf

    return _flat(OmegaConf.to_container(OmegaConf.create(yaml_text), resolve=False))


def _show(value) -> str:
    return ABSENT if value is ABSENT else json.dumps(value) if isinstance(value, str) else str(value)


def config_changes(old_text: str, new: train_config.TrainConfig) -> list[Change]:
    """Every key whose resolved value differs (a key only one side has: `(not set)` on the other).

    Values, not text: a comment or a config group the run does not use changes nothing. The
    plan's cache key is the sha256 of the text `to_yaml` writes, so a text that differs while
    every value is equal (keys in another order, after a pipeline update) is a change too:
    Snakemake would re-plan and retrain; it is named as such.
    """
    new_text = train_config.to_yaml(new)
    if new_text == old_text:
        return []
    old_values, new_values = _values(old_text), _values(new_text)
    changes = [Change(key, _show(old_values.get(key, ABSENT)), _show(new_values.get(key, ABSENT)))
               for key in sorted(old_values.keys() | new_values.keys())
               if old_values.get(key, ABSENT) != new_values.get(key, ABSENT)]
    return changes or [Change("(layout)", "train_config.yaml as an earlier pipeline version wrote it",
                              "the same values written in another order")]


def _show_stages(stages: list[dict]) -> str:
    total = stages[-1]["end"] if stages else 0
    return " + ".join(f"{s['name']}:{s['end'] - s['start']}" for s in stages) + f" = {total} updates"


def schedule_changes(plan: dict, stages: list[Stage]) -> list[Change]:
    """The plan's stages (names and update ranges) against the schedule's now."""
    old, new = plan.get("stages", []), [asdict(s) for s in stages]
    return [] if old == new else [Change("schedule", _show_stages(old), _show_stages(new))]


def trained(vdir: Path, scratch: Path, order: list[str] = ()) -> list[str]:
    """What a run has trained: its finished stages, then stages with an intra-stage checkpoint,
    each in plan order (`order`: the plan's stage names)."""
    rank = {name: i for i, name in enumerate(order)}

    def key(path: Path):
        return rank.get(path.name, len(rank)), path.name

    done = [p.name for p in sorted(layout.RunTree(vdir).stages.glob("*"), key=key) if p.is_dir()]
    started = [p.name for p in sorted(scratch.glob("*"), key=key)
               if p.name not in done and any(p.glob(layout.STEP_GLOB))]
    return done + [f"{name} (in progress)" for name in started]


def check(vrun: str, label: str, cfg: train_config.TrainConfig, stages: list[Stage], *,
          results: Path = Path(layout.RESULTS), work: Path = Path(layout.WORK)) -> ChangedRun | None:
    """The run's changes when it has trained anything with another config than `cfg` and `stages`."""
    vdir = results / vrun
    old_config, plan_file = layout.RunTree(vdir).train_config, layout.RunTree(vdir).plan
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    done = trained(vdir, work / vrun, [s["name"] for s in (plan or {}).get("stages", [])])
    if not done or not old_config.is_file():
        # Nothing trained, or nothing to compare with (stages without their plan: the plan reruns
        # for its missing output and the stages after it; there is no old value to name).
        return None
    old_text = old_config.read_text()
    changes = config_changes(old_text, cfg) + (schedule_changes(plan, stages) if plan is not None else [])
    if not changes:
        return None
    return ChangedRun(vrun, label, changes, done, train_config.config_id(old_text))


def stop_message(changed: list[ChangedRun], *, results: str = layout.RESULTS) -> str:
    """Why the workflow refuses to run: every changed run and key, and the ways on."""
    lines = ["these results were trained with another config than the one given now; running on would "
             "retrain them in place, deleting what they trained:"]
    for run in changed:
        lines.append(f"  {run.label} in {results}/{run.vrun}, trained {', '.join(run.trained)}; changed since "
                     f"(old -> now, old from {layout.TRAIN_CONFIG_FILE} and {layout.PLAN_FILE}):")
        lines += [f"    {change}" for change in run.changes]
    lines += [
        "To go on, either",
        "  - keep those results and train this config as a new run: give it a new `run:` name "
        "(e.g. --config run=<new-name>), or",
        f"  - set `on_config_change: archive` (e.g. --config on_config_change=archive): each run's plan, stages, "
        f"evaluations, exports and reports move into {results}/<run>/{layout.ARCHIVE_DIR}/<date>-<old config id>/ when "
        "the run starts, and it retrains (its data, tokenizer and base evaluation stay), or",
        "  - undo the change.",
    ]
    return "\n".join(lines)


def archive_name(run: ChangedRun, now: float | None = None) -> str:
    """`<UTC time>-<first 8 hex of the old config id>`: sorted by when, named by what it trained."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{run.old_id[:8]}"


def to_archive(vdir: Path, under: Path | None = None) -> list[Path]:
    """What `archive` moves out of results/<vrun>: all of it but the shared work (SHARED, SHARED_FILES);
    a dir that holds shared work is gone into (`under`: the dir being gone through)."""
    moved = []
    for path in sorted((under or vdir).iterdir()):
        rel = path.relative_to(vdir).as_posix()
        if rel in SHARED or rel in SHARED_FILES:
            continue
        if path.is_dir() and any(f.startswith(f"{rel}/") for f in SHARED_FILES):
            moved += to_archive(vdir, path)
        else:
            moved.append(path)
    return moved


def archive(run: ChangedRun, name: str, *, results: Path = Path(layout.RESULTS), work: Path = Path(layout.WORK)) -> Path:
    """Move a changed run's trained outputs into results/<vrun>/archive/<name>/ (scratch
    checkpoints of work/<vrun>/ into its work/), keeping their paths relative to the run.
    Each move is a rename on one file system (nothing copied, nothing half-written)."""
    vdir, scratch = results / run.vrun, work / run.vrun
    dest = layout.RunTree(vdir).archive(name)
    dest.mkdir(parents=True, exist_ok=False)
    for path in to_archive(vdir):
        target = dest / path.relative_to(vdir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, target)
    if scratch.is_dir():
        for path in sorted(scratch.iterdir()):
            if path.name != layout.VARIANTS_DIR:  # a sweep's variants under the plain run's scratch
                (dest / layout.WORK).mkdir(exist_ok=True)
                shutil.move(path, dest / layout.WORK / path.name)
    (dest / layout.ARCHIVED_FILE).write_text(json.dumps({
        "run": run.vrun, "old_config_id": run.old_id, "trained": run.trained,
        "changes": [asdict(c) for c in run.changes]}, indent=2) + "\n")
    return dest
