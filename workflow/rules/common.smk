# Validated config, the stage list, paths and input functions shared by all rules.

import json
import os
import re
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.utils import validate

from pipeline import layout
from pipeline.errors import UserError
from pipeline.planning import guard
from pipeline.planning.plan import resolved_json, world_size as plan_world_size
from pipeline.planning.resources import job_resources as rule_resources, training_threads, weights_bytes
from pipeline.planning.schedule import PILOT, plan_stages
from pipeline.storage import hub
from pipeline.planning.sweep import prune_points as sweep_prune_points, variants as sweep_variants
from pipeline.data.datasets import RunData
from pipeline.workflow_config import EMBEDDED_KINDS, sources as config_sources


def _chat_template_problems(value):
    from pipeline.data.chat import BUILTIN_TEMPLATES, TOKENIZER_OWN

    if value in TOKENIZER_OWN or value in BUILTIN_TEMPLATES or os.path.isfile(value):
        return []
    builtins = ", ".join(BUILTIN_TEMPLATES)
    return [f"data.chat_template: {value!r} is neither a built-in template ({builtins}) nor an existing .jinja file"]


# What `--config` set (nested values still strings, as snakemake read them) and where the
# config came from: errors name `--config` or the file that holds the key.
COMMAND_LINE = dict(workflow.config_settings.config)
CONFIG_SOURCES = config_sources(workflow.config_settings.configfiles, COMMAND_LINE)


def _check_config():
    """Every problem of the workflow config at once, naming its key, before any job runs."""
    from pipeline.workflow_config import path_problems, schema_problems, type_command_line

    schema = Path(workflow.current_basedir) / "../schemas/config.schema.yaml"
    type_command_line(config, COMMAND_LINE, schema)
    problems = schema_problems(config, schema, COMMAND_LINE)
    if not problems:
        validate(config, "../schemas/config.schema.yaml")  # fills in the defaults
        problems = path_problems(config) + _chat_template_problems(config["data"]["chat_template"])
    if problems:
        raise WorkflowError("config: " + "\n  ".join([f"problems in the workflow config ({CONFIG_SOURCES}):",
                                                      *problems]))


_check_config()

RUN = config["run"]
# Every path comes from pipeline/layout.py: R and V (below) are RunTrees that name the files.
R = layout.RunTree.of(RUN)  # the run: the shared data and base evaluation, a sweep's comparison
WORK = layout.work_dir(RUN)  # undeclared scratch: intra-stage checkpoints survive a failed attempt
# The embedded defaults (`model` values, EMBEDDED_KINDS), each built by `prepare_base` into
# results/<name>/: its base model in model/, its demo dataset in data/.

_sched = config["schedule"]
STAGE_PLAN = plan_stages(_sched["total_updates"], _sched["pilot_fraction"], _sched["num_chunks"])  # with their updates
STAGES = [s.name for s in STAGE_PLAN]
LAST_STAGE = STAGES[-1]


def _variants():
    """vrun -> the variant's name and trainer overrides. Without a sweep one variant, the run
    itself (vrun = run); with one, results/<run>/variants/<name>/ each (vrun = <run>/variants/<name>)."""
    try:
        named = sweep_variants(config["sweep"])
        at, keep = sweep_prune_points(config["sweep"], STAGES)
    except UserError as err:
        raise WorkflowError(f"config: {err}") from None
    if not named:
        return {RUN: ("", [])}, [], None
    return {layout.variant_run(RUN, name): (name, overrides) for name, overrides in named.items()}, at, keep


VARIANTS, PRUNE_AT, PRUNE_KEEP = _variants()
SWEEP = next(iter(VARIANTS)) != RUN
V = layout.RunTree.of("{vrun}")  # one trained variant: its plan, stages, evaluations, exports


def is_embedded(value):
    return value in EMBEDDED_KINDS


# The demo whose dataset `data: embedded` means: the embedded model's own, else the text demo's.
DEMO = config["model"] if is_embedded(config["model"]) else "embedded"
MODEL = str(layout.RunTree.of(config["model"]).base_model) if is_embedded(config["model"]) else config["model"]


def _hub_model():
    """A `model:` given by hub id (org/name[@revision]): the `fetch_model` job puts it into the
    Hugging Face cache where snakemake runs and pins its commit in results/<run>/model.json, the
    model argument of every later job (each reads that commit's snapshot from the cache, never the
    network). Offline (HF_HUB_OFFLINE=1) it must be cached already: else stop here, saying how."""
    if is_embedded(config["model"]) or os.path.isdir(config["model"]):
        return None, None
    model = hub.parse(config["model"])  # path_problems refused anything else
    snapshot = hub.cached(model)  # no network: what is there now (sizes the training jobs)
    if snapshot is None and hub.offline():
        raise WorkflowError(hub.not_cached_message(model))
    return model, snapshot


HUB_MODEL, HUB_SNAPSHOT = _hub_model()
if HUB_MODEL is not None:
    MODEL = str(R.hub_model)


def _check_base_untouched():
    """The base model dir is read-only to us: refuse outputs inside it, up front."""
    if is_embedded(config["model"]) or not os.path.isdir(MODEL):
        return
    base = Path(MODEL).resolve()
    for out in (R.root, WORK, layout.LOGS, layout.BENCHMARKS):
        p = Path(out).resolve()
        if p == base or base in p.parents:
            raise WorkflowError(f"config: output path {out} is inside the base model dir {MODEL}; choose another run dir")


_check_base_untouched()


def _dataset_path(value, split):
    """A dataset path as the config gives it: a file or dir, or an embedded demo's split ("embedded": the
    embedded model's); None for null."""
    if value is None:
        return None
    if is_embedded(value):
        return str(layout.RunTree.of(DEMO if value == "embedded" else value).demo_split(split))
    return value


# The run's datasets (pipeline/data/datasets.py): every training dataset (one file is a mix of one) with its
# shards, the data flags every data command takes, the rules' inputs, the trainer's cache overrides.
DATA = RunData(config, R, _dataset_path)
data_file, train_caches, field_flags = DATA.split_path, DATA.train_caches, DATA.field_flags


def model_inputs():
    """The base model as an input: its dir, or a hub model's model.json (made by `fetch_model`)."""
    return [MODEL]


def base_model(wildcards, input):
    """The base model argument: the dir or a hub model's model.json (read from the HF cache)."""
    return input.model


# The run's tokenizer (`prepare_tokenizer`): the chat template the run trains with, and any
# special tokens it added; every job that renders or decodes text reads it.
TOKENIZER = R.tokenizer


def train_overrides(variant_overrides=()):
    """Hydra overrides: the user's, the variant's, then the paths this workflow owns."""
    own = [f"model.path={MODEL}", f"model.tokenizer={TOKENIZER}"]
    own += DATA.trainer_overrides()
    return list(config["train"]["overrides"]) + list(variant_overrides) + own


TRAIN_CONFIG_DIR = "config/train"


WORLD_SIZE = plan_world_size(config["train"]["nodes"], config["train"]["gpus_per_node"], config["train"]["nproc"])


def _resolve_train_config(label, overrides):
    """The trainer config as every stage will train with it, checked against this workflow config.

    Resolved when the workflow loads, so a bad key, a bad value or a mismatch
    between the two configs stops `snakemake` before any job (the `plan` rule
    runs the same checks). Its content is also the plan's cache key:
    `config_id` changes only when a resolved value does.
    """
    from pipeline import config as train_config
    from pipeline.planning.plan import config_id, cross_check

    where = f" (sweep variant {label})" if label else ""
    try:
        cfg = train_config.resolve(TRAIN_CONFIG_DIR, config["train"]["config_name"], overrides)
    except UserError as err:
        raise WorkflowError(f"config{where}: {err}") from None
    problems = cross_check(cfg, export_weights=config["export"]["weights"],
                           export_ema_rate=config["export"]["ema_rate"], world=WORLD_SIZE)
    if problems:
        raise WorkflowError(f"config{where}: the workflow config ({CONFIG_SOURCES}) and the trainer config "
                            "(config/train/ + train.overrides) disagree:\n  " + "\n  ".join(problems))
    return cfg, config_id(cfg)


# vrun -> (resolved trainer config, its id); a sweep's base config (no variant's overrides) too:
# it is what the base model is evaluated with, once for all variants.
TRAIN = {vrun: _resolve_train_config(name, train_overrides(overrides)) for vrun, (name, overrides) in VARIANTS.items()}
BASE_TRAIN = TRAIN[RUN] if not SWEEP else _resolve_train_config("", train_overrides())
HAS_EMA = bool(next(iter(TRAIN.values()))[0].ema.rates)
if any(bool(cfg.ema.rates) != HAS_EMA for cfg, _ in TRAIN.values()):
    raise WorkflowError("config: in one sweep either every variant keeps EMA weights (ema.rates) or none does")


def _changed_runs():
    """Runs (sweep variants) that trained with another trainer config or schedule than they would
    now (pipeline.planning.guard). `on_config_change: stop` refuses to run before any job, naming
    every changed key; `archive` moves their trained outputs aside when the run starts (onstart
    below: Snakemake calls it only when jobs really run, never on a dry run, a report or a DAG).
    A sweep's runs are checked one by one, and results/<run>/ too when a plain run trained there.
    Cluster jobs load the workflow again: the main process has decided already."""
    if not workflow.is_main_process:
        return []
    runs = {vrun: (f"sweep variant {name}" if name else f"run {RUN}", TRAIN[vrun][0])
            for vrun, (name, _) in VARIANTS.items()}
    if SWEEP:
        runs[RUN] = (f"run {RUN} (without the sweep)", BASE_TRAIN[0])
    changed = [run for vrun, (label, cfg) in runs.items() if (run := guard.check(vrun, label, cfg, STAGE_PLAN))]
    if changed and config["on_config_change"] == "stop":
        raise WorkflowError(f"config ({CONFIG_SOURCES}): {guard.stop_message(changed)}")
    names = {run.vrun: guard.archive_name(run) for run in changed}
    for run in changed:
        logger.warning(f"on_config_change: archive: {run.label} changed ({'; '.join(map(str, run.changes))}): "
                       f"its trained outputs move to {layout.RunTree.of(run.vrun).root / guard.ARCHIVE_DIR / names[run.vrun]}/ when "
                       "the run starts (not on a dry run), then it retrains")
    return [(run, names[run.vrun]) for run in changed]


CHANGED_RUNS = _changed_runs()


onstart:
    if not workflow.touch:
        for run, name in CHANGED_RUNS:
            logger.warning(f"on_config_change: archive: moved {run.label}'s trained outputs to "
                           f"{guard.archive(run, name)}")


def variant_overrides(vrun):
    return train_overrides(VARIANTS[vrun][1])


def variant_name(vrun):
    return VARIANTS[vrun][0]


def previous_stage(stage):
    i = STAGES.index(stage)
    return STAGES[i - 1] if i else None


def train_inputs(wildcards):
    v = layout.RunTree.of(wildcards.vrun)
    inputs = {
        "plan": v.plan,
        "config": v.train_config,
        "train": train_caches(),
    }
    if data_file("val"):
        inputs["val"] = R.cache("val")
    prev = previous_stage(wildcards.stage)
    if prev is not None:
        inputs["init"] = v.stage(prev)
    if wildcards.stage != PILOT:
        # No chunk starts before the pilot passed its sanity gate.
        inputs["gate"] = v.pilot_report
    return inputs


def stage_checkpoint(stage_dir):
    """The checkpoint inside a stage's output dir (what --checkpoint / --init take)."""
    return Path(stage_dir) / layout.STAGE_CHECKPOINT


def init_flag(wildcards, input):
    return f"--init {stage_checkpoint(input.init)}" if "init" in input.keys() else ""


def train_threads():
    """All local cores but one; 1 under a cluster executor (no local core count: there the job's
    cpus_per_task, from job_resources, sizes the allocation)."""
    try:
        return training_threads(workflow.cores)
    except WorkflowError:
        return training_threads(None)


TRAIN_NODES = config["train"]["nodes"]
TRAIN_GPUS = "all" if config["train"]["gpus_per_node"] == "auto" else config["train"]["gpus_per_node"]
EVAL_GPUS = config["evaluate"]["gpus"]


def launch(*, gpus=0, train=False):
    """The start of every rule's shell command: `pipeline.launch` sends the command's output to
    the rule's log and, when it fails, the reason to the terminal; it hands the job GPUs of its
    own (`gpus`: 0, a count or "all"), and runs a training stage as one process, under torchrun,
    or as one torchrun per node.
    """
    extra = f" --train --nodes {TRAIN_NODES} --nproc {config['train']['nproc']}" if train else ""
    return tracker_exports() + f"exec python -m pipeline.launch --log {{log}} --gpus {gpus}{extra} -- "


def tracker_exports():
    """`export PIPELINE_TRACKER_...=...; ` for the config's tracker section (empty when off): an
    environment, not a param, so that turning tracking on or off reruns no job."""
    import shlex

    from pipeline.tracker import env_for

    text = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env_for(config.get("tracker", {})).items())
    return text.replace("{", "{{").replace("}", "}}")


# The base's weights on disk (0 while an embedded base is not built, or a hub model not cached).
BASE_BYTES = weights_bytes(HUB_SNAPSHOT.path if HUB_SNAPSHOT is not None else Path(MODEL))


def job_resources(kind):
    """A rule's `resources:` for its kind of job (pipeline/planning/resources.py): derived from
    train.* / evaluate.gpus and the base model's size, with the `slurm.*` settings of its kind."""
    return rule_resources(kind, config, BASE_BYTES)


def export_adapter():
    return V.export(layout.ADAPTER_EMA if config["export"]["weights"] == "ema" else layout.ADAPTER_FINAL)


def ema_rate_flag():
    rate = config["export"]["ema_rate"]
    return f"--ema-rate {rate}" if rate is not None else ""


def best_exports(v):
    """A run's best raw (and EMA, when it keeps any) weights; tracked only with a validation set."""
    if not data_file("val"):
        return []
    return [v.export(layout.ADAPTER_BEST)] + ([v.export(layout.ADAPTER_BEST_EMA)] if HAS_EMA else [])


def adapter_exports(v):
    """Every adapter dir a finished run exports (the merged model aside): the final weights, the
    EMA ones when it keeps any, and the best ones."""
    return [v.export(layout.ADAPTER_FINAL), *([v.export(layout.ADAPTER_EMA)] if HAS_EMA else []), *best_exports(v)]


def reached_stages(vrun):
    """(the stages a variant trains, whether it goes on to the end): a sweep's pruning stops a
    variant at the first prune point where it is not among the best (a Snakemake checkpoint:
    known once every variant has finished and been evaluated at that stage)."""
    for i, stage in enumerate(STAGES):
        if stage in PRUNE_AT:
            decision = json.loads(Path(checkpoints.sweep_prune.get(stage=stage).output[0]).read_text())
            if variant_name(vrun) not in decision["kept"]:
                return STAGES[:i + 1], False
    return STAGES, True


def reached_targets(vrun):
    """(every stage a variant reaches, then their evaluations; whether it goes on to the end):
    what `run_targets` asks for and the sweep comparison waits for."""
    stages, finished = reached_stages(vrun)
    v = layout.RunTree.of(vrun)
    return [v.stage(s) for s in stages] + [v.evaluation(s) for s in stages], finished


def run_targets(vrun):
    """What `snakemake` makes of one variant: every stage it reaches and its evaluation, and, when
    it goes on to the end, its summary, report pages and exports."""
    v = layout.RunTree.of(vrun)
    targets, finished = reached_targets(vrun)
    if finished:
        targets += [v.summary_csv, v.loss_plot, v.val_loss_plot,
                    v.summary_html, v.plan_html, v.overview_html, v.samples_html, v.pilot_gate_html,
                    *adapter_exports(v), v.verification, v.smoke_test]
    return targets


def compare_inputs(wildcards):
    """Every variant's evaluations and stages as far as it got, its smoke test when it finished, and
    the prune decisions: the sweep comparison waits for all of them."""
    inputs = {"prune": [checkpoints.sweep_prune.get(stage=s).output[0] for s in PRUNE_AT]}
    for i, vrun in enumerate(VARIANTS):
        key = f"variant{i}"
        inputs[key], finished = reached_targets(vrun)
        if finished:
            inputs[key].append(layout.RunTree.of(vrun).smoke_test)
    return {key: value for key, value in inputs.items() if value}


def run_evaluations(v):
    """The base model's evaluation, then every stage's of a variant: a run's evaluation table."""
    return [R.evaluation(layout.BASE_EVAL), *(v.evaluation(s) for s in STAGES)]


def card_inputs():
    """What an export dir's model card (README.md) is written from: the run's plan, data stats,
    trainer config and every evaluation (the export rules declare them as inputs)."""
    return {
        "plan": V.plan,
        "stats": R.stats,
        "train_config": V.train_config,
        "evals": run_evaluations(V),
    }


def card_flags(wildcards, input):
    """The export commands' `--card-*` options for the `card_inputs` of a rule."""
    return (f"--card-run {wildcards.vrun} --card-plan {input.plan} --card-stats {input.stats} "
            f"--card-config {input.train_config} --card-eval {' '.join(input.evals)}")


def optional(flag, value):
    """`flag value`, or nothing when there is no value: None, or the empty list Snakemake gives for an
    input / output declared as [] (a split the config sets to null): a flag without its value is an
    argparse error after the run has started."""
    absent = value is None or (isinstance(value, (list, str)) and not value)
    return "" if absent else f"{flag} {value}"


wildcard_constraints:
    stage="|".join(STAGES),
    dataset=DATA.wildcard(),
    shard=r"\d+",
    vrun="|".join(re.escape(v) for v in VARIANTS),
