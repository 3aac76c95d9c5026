"""The run's config as the workflow loads it: checked, resolved and keyed, in one call.

`load` is the one entry point (`workflow/rules/common.smk` calls it when the
Snakefile loads; the tests call it the same way). In order, it

1. checks the workflow config (`config/config.yaml`, `--configfile`, `--config`):
   the JSON schema, then the schema's defaults, the model and dataset paths and
   the chat template (`pipeline.workflow_config`), every problem at once;
2. derives the stages (`pipeline.planning.schedule`), a sweep's variants and
   prune points (`pipeline.planning.sweep`), the base model argument of every
   job (a dir, an embedded demo's, or a hub model's pinned model.json), the
   datasets (`pipeline.data.datasets.RunData`) and the ranks of a training stage;
3. builds each variant's trainer overrides (the user's `train.overrides`, the
   variant's, then the paths the workflow owns: base model, run tokenizer, token
   caches) and resolves them with Hydra (`pipeline.config.resolve`), checks each
   against the workflow config (`pipeline.planning.checks.cross_check`), and
   keys it by its resolved text (`config_id`): the `plan` rule writes that text
   as train_config.yaml, and Snakemake compares the id;
4. checks `evaluate.benchmarks` against the run (`pipeline.planning.benchmarks`) and, in the
   main Snakemake process, that every task's data is in the local caches;
5. in the main Snakemake process, compares each run with what it trained
   (`pipeline.planning.guard`): `on_config_change: stop` refuses here.

A problem raises `UserError` with the whole message (the Snakefile shows it as
it is). Torch-free: the Snakefile imports this at every start, also in every
cluster job, and `snakemake -n` must stay quick.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import config as train_config
from pipeline import layout, workflow_config
from pipeline.data.datasets import RunData
from pipeline.data.hub_splits import KEY_SPLIT, folder_split
from pipeline.errors import UserError
from pipeline.planning import benchmarks, guard
from pipeline.planning.checks import cross_check, world_size
from pipeline.planning.schedule import PILOT, Stage, plan_stages
from pipeline.planning.sweep import prune_points, variants as sweep_variants
from pipeline.storage import hub, hub_data
from pipeline.workflow_config import EMBEDDED, EMBEDDED_KINDS

TRAIN_CONFIG_DIR = "config/train"  # the trainer's Hydra configs, relative to the workflow's dir
SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Variant:
    """One trained run: the run itself (name ""), or a sweep variant."""

    name: str
    overrides: list[str]  # the variant's own trainer overrides (a sweep's), before the run's
    cfg: train_config.TrainConfig
    text: str  # train_config.yaml as `plan` writes it (`pipeline.config.to_yaml`)
    config_id: str  # sha256 of `text`: what the plan is keyed on

    def label(self, run: str) -> str:
        return f"sweep variant {self.name}" if self.name else f"run {run}"


@dataclass
class RunConfig:
    """What the workflow runs, as `load` derived it from the workflow config."""

    config: dict  # the workflow config, checked, with the schema's defaults
    sources: str  # where it came from, for messages: config/config.yaml, --configfile ..., --config ...
    stages: list[Stage]
    model: str  # the base model argument of every job: a dir, or a hub model's model.json
    hub_model: hub.HubModel | None  # a `model:` given by hub id
    hub_snapshot: hub.Snapshot | None  # its snapshot in the HF cache now (None: not fetched yet)
    data: RunData  # the datasets: every training dataset (one file is a mix of one), val, test
    world: int | None  # ranks of a training stage (None: one per GPU found)
    variants: dict[str, Variant] = field(default_factory=dict)  # vrun -> its trained run
    base: Variant | None = None  # what the base model is evaluated with (a sweep's: no variant overrides)
    prune_at: list[str] = field(default_factory=list)
    prune_keep: int | None = None
    benchmarks: benchmarks.Benchmarks | None = None  # evaluate.benchmarks: the lm-eval tasks and weights
    changed: list[tuple[guard.ChangedRun, str]] = field(default_factory=list)  # runs to archive, their names

    @property
    def run(self) -> str:
        return self.config["run"]

    @property
    def tree(self) -> layout.RunTree:
        return layout.RunTree.of(self.run)

    @property
    def sweep(self) -> bool:
        return next(iter(self.variants)) != self.run

    @property
    def has_ema(self) -> bool:
        return bool(self.base.cfg.ema.rates)

    @property
    def has_val(self) -> bool:
        return self.data.split_path("val") is not None

    def train_overrides(self, variant_overrides: list[str] = ()) -> list[str]:
        """Hydra overrides: the user's, the variant's, then the paths this workflow owns."""
        own = [f"model.path={self.model}", f"model.tokenizer={self.tree.tokenizer}", *self.data.trainer_overrides()]
        return list(self.config["train"]["overrides"]) + list(variant_overrides) + own

    def stage_inputs(self, tree: layout.RunTree, stage: str) -> dict[str, Path]:
        """What a training stage of `tree` reads besides its data: the plan and the trainer config, the
        stage before it (whose checkpoint it starts from), and after the pilot the pilot's gate
        report: no chunk starts before the pilot passed its sanity gate."""
        names = [s.name for s in self.stages]
        inputs = {"plan": tree.plan, "config": tree.train_config}
        if names.index(stage):
            inputs["init"] = tree.stage(names[names.index(stage) - 1])
        if stage != PILOT:
            inputs["gate"] = tree.pilot_report
        return inputs

    def adapter_exports(self, tree: layout.RunTree) -> list[Path]:
        """Every adapter dir a finished run exports (the merged model aside): the final weights, the
        EMA ones when it keeps any, and, tracked only with a validation set, the best raw (and EMA)."""
        names = [layout.ADAPTER_FINAL] + ([layout.ADAPTER_EMA] if self.has_ema else [])
        if self.has_val:
            names += [layout.ADAPTER_BEST] + ([layout.ADAPTER_BEST_EMA] if self.has_ema else [])
        return [tree.export(name) for name in names]

    def merge_source(self, tree: layout.RunTree) -> Path:
        """The adapter dir `merge_lora` merges and the smoke test checks: export.weights' choice."""
        return tree.export(layout.ADAPTER_EMA if self.config["export"]["weights"] == "ema" else layout.ADAPTER_FINAL)

    def finished_outputs(self, tree: layout.RunTree) -> list[Path]:
        """What a run that trained to its end makes besides its stages and their evaluations: its
        summary, plots, report pages and exports, the merge check and the smoke test."""
        return [tree.summary_csv, tree.loss_plot, tree.val_loss_plot, tree.summary_html, tree.plan_html,
                tree.overview_html, tree.samples_html, tree.pilot_gate_html, *self.adapter_exports(tree),
                tree.verification, tree.smoke_test]

    def plan_keys(self, variant: Variant, *, base: bool = False) -> dict[str, object]:
        """What a run's plan depends on, so what the `plan` rule is keyed on: the resolved trainer config
        (`config_id`), the stage windows and, for a trained run (`base`: a sweep's base config, which
        trains nothing), the ranks of a stage and the longest record (the memory estimate's).
        Not the export settings, nor how the overrides are written: they change no stage."""
        keys: dict[str, object] = {"config_id": variant.config_id,
                                   "schedule": " + ".join(f"{s.name}:{s.start}-{s.end}" for s in self.stages)}
        if not base:
            keys |= {"world": f"--world-size {self.world}" if self.world else "",
                     "max_length": self.config["data"]["max_length"]}
        return keys

    def plan_args(self, variant: Variant, *, base: bool = False) -> str:
        """The `plan` command's arguments besides its keys and outputs: the schedule, the resolved
        config's text (shell-quoted; its sha256 is `config_id`) and what is exported (`base`: nothing)."""
        schedule, export = self.config["schedule"], self.config["export"]
        weights = "--export-weights raw" if base else (f"--export-weights {export['weights']} "
                                                       f"--export-ema-rate {export['ema_rate']}")
        return (f"--total-updates {schedule['total_updates']} --pilot-fraction {schedule['pilot_fraction']} "
                f"--num-chunks {schedule['num_chunks']} --resolved-config {shlex.quote(variant.text)} {weights}")

    def archive_notes(self) -> list[str]:
        """A warning per run that `on_config_change: archive` moves aside when the run starts."""
        return [f"on_config_change: archive: {run.label} changed ({'; '.join(map(str, run.changes))}): its trained "
                f"outputs move to {layout.RunTree.of(run.vrun).archive(name)}/ when the run starts (not on a dry "
                "run), then it retrains" for run, name in self.changed]


def load(config: dict, *, command_line: Mapping | None = None, configfiles: list = (), schema: Path = SCHEMA,
         train_config_dir: str | Path = TRAIN_CONFIG_DIR, main_process: bool = True) -> RunConfig:
    """The workflow config `config` (Snakemake's, changed in place: typed, defaults filled), checked
    and resolved into what the workflow runs. `command_line`: what `--config` set; `configfiles`:
    the config files read; `main_process`: False in a cluster job (the guard has decided already)."""
    command_line = dict(command_line or {})
    sources = workflow_config.sources(list(configfiles), command_line)
    _check(config, command_line, schema, sources)
    run = _derive(config, sources)
    named, run.prune_at, run.prune_keep = _variants(config, [s.name for s in run.stages])
    for vrun, (name, overrides) in named.items():
        run.variants[vrun] = _resolve(run, name, overrides, train_config_dir)
    run.base = run.variants[run.run] if not run.sweep else _resolve(run, "", [], train_config_dir)
    if any(bool(v.cfg.ema.rates) != run.has_ema for v in run.variants.values()):
        raise UserError("config: in one sweep either every variant keeps EMA weights (ema.rates) or none does")
    run.benchmarks = _benchmarks(run, main_process)
    if main_process:
        run.changed = _changed_runs(run)
    return run


def _check(config: dict, command_line: dict, schema: Path, sources: str) -> None:
    """Every problem of the workflow config at once, naming its key, before any job runs."""
    workflow_config.type_command_line(config, command_line, schema)
    problems = workflow_config.schema_problems(config, schema, command_line)
    if not problems:
        workflow_config.fill_defaults(config, schema)
        problems = workflow_config.path_problems(config) + chat_template_problems(config["data"]["chat_template"])
    if problems:
        raise UserError("config: " + "\n  ".join([f"problems in the workflow config ({sources}):", *problems]))


def chat_template_problems(value: str | None) -> list[str]:
    """data.chat_template: the tokenizer's own (null), a built-in name, or an existing .jinja file."""
    from pipeline.data.chat import BUILTIN_TEMPLATES, TOKENIZER_OWN

    if value in TOKENIZER_OWN or value in BUILTIN_TEMPLATES or os.path.isfile(value):
        return []
    builtins = ", ".join(BUILTIN_TEMPLATES)
    return [f"data.chat_template: {value!r} is neither a built-in template ({builtins}) nor an existing .jinja file"]


def _derive(config: dict, sources: str) -> RunConfig:
    """The stages, the base model argument, the datasets and the ranks of a training stage."""
    schedule, train = config["schedule"], config["train"]
    stages = plan_stages(schedule["total_updates"], schedule["pilot_fraction"], schedule["num_chunks"])
    model, hub_model, snapshot = _base_model(config["model"], config["run"])
    notes = []

    def resolve(value, split: str) -> str | None:
        path = _dataset_path(value, split, config["model"])
        chosen = None if path is None or path != value or hub_data.is_url(path) else folder_split(path, KEY_SPLIT[split])
        if chosen:
            notes.append(f"data.{split}: {value} holds several splits: reading its {KEY_SPLIT[split]} split, {chosen}")
        return chosen or path

    data = RunData(config, layout.RunTree.of(config["run"]), resolve)
    data.notes = notes
    try:
        world = world_size(train["nodes"], train["gpus_per_node"], train["nproc"])
    except UserError as err:
        raise UserError(f"config ({sources}): {err}") from None
    return RunConfig(config, sources, stages, model, hub_model, snapshot, data, world)


def _base_model(value: str, run: str) -> tuple[str, hub.HubModel | None, hub.Snapshot | None]:
    """(the base model argument of every job, the hub model, its cached snapshot).

    An embedded demo's is the dir `prepare_base` builds. A hub id (org/name[@revision]): the
    `fetch_model` job puts it into the Hugging Face cache where snakemake runs and pins its commit
    in results/<run>/model.json, the model argument of every later job (each reads that commit's
    snapshot from the cache, never the network). Offline (HF_HUB_OFFLINE=1) it must be cached
    already. A local dir: as given, and no output of the run may be inside it (it is read-only to us).
    """
    if value in EMBEDDED_KINDS:
        return str(layout.RunTree.of(value).base_model), None, None
    if os.path.isdir(value):
        _check_base_untouched(value, run)
        return value, None, None
    model = hub.parse(value)  # path_problems refused anything else
    snapshot = hub.cached(model)  # no network: what is there now (sizes the training jobs)
    if snapshot is None and hub.offline():
        raise UserError(hub.not_cached_message(model))
    return str(layout.RunTree.of(run).hub_model), model, snapshot


def _check_base_untouched(model_dir: str, run: str) -> None:
    base = Path(model_dir).resolve()
    for out in (layout.RunTree.of(run).root, layout.work_dir(run), Path(layout.LOGS), Path(layout.BENCHMARKS)):
        path = Path(out).resolve()
        if path == base or base in path.parents:
            raise UserError(f"config: output path {out} is inside the base model dir {model_dir}; "
                            "choose another run dir")


def _dataset_path(value: str | None, split: str, model: str) -> str | None:
    """A dataset path as the config gives it: a file or dir, or an embedded demo's split; None for null.
    "embedded" is the embedded model's own demo dataset (`model`), else the text demo's."""
    if value is None:
        return None
    if value in EMBEDDED_KINDS:
        return str(layout.RunTree.of(_demo(model) if value == EMBEDDED else value).demo_split(split))
    return value


def _demo(model: str) -> str:
    """The embedded demo whose dataset (and benchmark) `embedded` means: the embedded model's own,
    else the text demo's."""
    return model if model in EMBEDDED_KINDS else EMBEDDED


def _variants(config: dict, stages: list[str]) -> tuple[dict[str, tuple[str, list[str]]], list[str], int | None]:
    """(vrun -> the variant's name and its overrides, the prune points, how many go on at each).
    Without a sweep one variant, the run itself (vrun = run); with one, results/<run>/variants/<name>/
    each (vrun = <run>/variants/<name>)."""
    try:
        named = sweep_variants(config["sweep"])
        at, keep = prune_points(config["sweep"], stages)
    except UserError as err:
        raise UserError(f"config: {err}") from None
    if not named:
        return {config["run"]: ("", [])}, at, keep
    return {layout.variant_run(config["run"], name): (name, o) for name, o in named.items()}, at, keep


def _resolve(run: RunConfig, name: str, overrides: list[str], config_dir: str | Path) -> Variant:
    """A variant's trainer config as every stage will train with it, checked against the workflow config."""
    where = f" (sweep variant {name})" if name else ""
    try:
        cfg = train_config.resolve(config_dir, run.config["train"]["config_name"], run.train_overrides(overrides))
    except UserError as err:
        raise UserError(f"config{where}: {err}") from None
    export = run.config["export"]
    problems = cross_check(cfg, export_weights=export["weights"], export_ema_rate=export["ema_rate"], world=run.world)
    if problems:
        raise UserError(f"config{where}: the workflow config ({run.sources}) and the trainer config "
                        "(config/train/ + train.overrides) disagree:\n  " + "\n  ".join(problems))
    text = train_config.to_yaml(cfg)
    return Variant(name, list(overrides), cfg, text, train_config.config_id(text))


def _benchmarks(run: RunConfig, main_process: bool) -> benchmarks.Benchmarks:
    """evaluate.benchmarks, checked against the run (its weights, a validation set, the base), and in
    the main process every task's data in the local caches (one line each that is not)."""
    model = run.config["model"]
    bench = benchmarks.Benchmarks(run.config["evaluate"][benchmarks.SECTION], run=run.run, variants=list(run.variants),
                                  demo=_demo(model))
    problems = bench.problems(has_ema=run.has_ema, has_val=run.has_val,
                              model_dir=None if model in EMBEDDED_KINDS else Path(run.model),
                              embedded_kind=EMBEDDED_KINDS.get(model))
    if problems:
        raise UserError("config: " + "\n  ".join([f"problems in the workflow config ({run.sources}):", *problems]))
    missing = benchmarks.data_problems(bench.unscored()) if main_process else []
    if missing:
        raise UserError("\n".join(missing))
    return bench


def _changed_runs(run: RunConfig) -> list[tuple[guard.ChangedRun, str]]:
    """Runs (sweep variants) that trained with another trainer config or schedule than they would
    now, each with the name of its archive dir. `on_config_change: stop` refuses to run, naming
    every changed key; `archive` moves their trained outputs aside when the run starts (the
    Snakefile's onstart: Snakemake calls it only when jobs really run, never on a dry run, a report
    or a DAG). A sweep's runs are checked one by one, and results/<run>/ too when a plain run
    trained there."""
    runs = {vrun: (v.label(run.run), v.cfg) for vrun, v in run.variants.items()}
    if run.sweep:
        runs[run.run] = (f"run {run.run} (without the sweep)", run.base.cfg)
    changed = [c for vrun, (label, cfg) in runs.items() if (c := guard.check(vrun, label, cfg, run.stages))]
    if changed and run.config["on_config_change"] == "stop":
        raise UserError(f"config ({run.sources}): {guard.stop_message(changed)}")
    return [(c, guard.archive_name(c)) for c in changed]
