# Snakemake glue: the run's config (checked and resolved by the package), paths, input functions.
#
# Everything about the config itself (its checks, the sweep variants, the trainer overrides, the
# Hydra resolution and its id, the cross-checks, the guard) is pipeline/planning/run_config.py,
# one call below; what is here only hands its results to the rules.

import json
import os
import re
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

from pipeline import layout
from pipeline.errors import UserError
from pipeline.launch.command import shell_prefix
from pipeline.planning import guard, run_config
from pipeline.planning.resources import job_resources as rule_resources, training_threads, weights_bytes
from pipeline.planning.schedule import PILOT
from pipeline.workflow_config import EMBEDDED_KINDS

try:
    RUN_CONFIG = run_config.load(
        config, command_line=workflow.config_settings.config, configfiles=workflow.config_settings.configfiles,
        schema=Path(workflow.current_basedir) / "../schemas/config.schema.yaml",
        main_process=workflow.is_main_process)  # cluster jobs load the workflow again: the guard has decided
except UserError as err:
    raise WorkflowError(str(err)) from None

RUN = RUN_CONFIG.run
# Every path comes from pipeline/layout.py: R and V (below) are RunTrees that name the files.
R = RUN_CONFIG.tree  # the run: the shared data and base evaluation, a sweep's comparison
STAGES = [s.name for s in RUN_CONFIG.stages]
LAST_STAGE = STAGES[-1]
# vrun -> the variant's name and its own overrides. Without a sweep one variant, the run itself
# (vrun = run); with one, results/<run>/variants/<name>/ each (vrun = <run>/variants/<name>).
VARIANTS = {vrun: (v.name, v.overrides) for vrun, v in RUN_CONFIG.variants.items()}
SWEEP = RUN_CONFIG.sweep
V = layout.RunTree.of("{vrun}")  # one trained variant: its plan, stages, evaluations, exports
HAS_EMA = RUN_CONFIG.has_ema
MODEL = RUN_CONFIG.model  # a dir, or a hub model's model.json (made by `fetch_model`)
HUB_MODEL = RUN_CONFIG.hub_model
# The run's tokenizer (`prepare_tokenizer`): the chat template the run trains with, and any
# special tokens it added; every job that renders or decodes text reads it.
TOKENIZER = R.tokenizer

for _note in RUN_CONFIG.archive_notes():
    logger.warning(_note)
for _note in RUN_CONFIG.data.notes if workflow.is_main_process else []:
    logger.info(_note)


onstart:
    if not workflow.touch:
        for run, name in RUN_CONFIG.changed:
            logger.warning(f"on_config_change: archive: moved {run.label}'s trained outputs to "
                           f"{guard.archive(run, name)}")


def plan_params(variant_of, *, base=False):
    """The `plan` rule's params for the trained run `variant_of(wildcards)`: its keys, which Snakemake
    compares (--rerun-triggers params), and its other arguments as a function of `output`, which
    Snakemake leaves out (`run_config.RunConfig.plan_keys`, `plan_args`)."""
    keys = list(RUN_CONFIG.plan_keys(RUN_CONFIG.base, base=base))
    return {**{key: (lambda wc, key=key: RUN_CONFIG.plan_keys(variant_of(wc), base=base)[key]) for key in keys},
            "args": lambda wc, output: RUN_CONFIG.plan_args(variant_of(wc), base=base)}


# --- data: the dataset files and the training datasets -------------------------------------------

# The run's datasets (pipeline/data/datasets.py): every training dataset (one file is a mix of one) with its
# shards, the data flags every data command takes, the rules' inputs, the trainer's cache overrides.
DATA = RUN_CONFIG.data
data_file, train_caches, field_flags = DATA.split_path, DATA.train_caches, DATA.field_flags


def model_inputs():
    """The base model as an input: its dir, or a hub model's model.json (made by `fetch_model`)."""
    return [MODEL]


def base_model(wildcards, input):
    """The base model argument: the dir or a hub model's model.json (read from the HF cache)."""
    return input.model


# --- training, evaluation and export -------------------------------------------------------------

def variant_name(vrun):
    return VARIANTS[vrun][0]


def train_inputs(wildcards):
    """A stage's plan, config, previous stage and gate (`run_config.RunConfig.stage_inputs`), and data."""
    inputs = {**RUN_CONFIG.stage_inputs(layout.RunTree.of(wildcards.vrun), wildcards.stage), "train": train_caches()}
    return inputs | ({"val": R.cache("val")} if data_file("val") else {})


def init_flag(wildcards, input):
    return f"--init {stage_checkpoint(input.init)}" if "init" in input.keys() else ""


def stage_checkpoint(stage_dir):
    """The checkpoint inside a stage's output dir (what --checkpoint / --init take)."""
    return Path(stage_dir) / layout.STAGE_CHECKPOINT


def train_threads():
    """All local cores but one; 1 under a cluster executor (no local core count: there the job's
    cpus_per_task, from job_resources, sizes the allocation)."""
    try:
        return training_threads(workflow.cores)
    except WorkflowError:
        return training_threads(None)


TRAIN_GPUS = "all" if config["train"]["gpus_per_node"] == "auto" else config["train"]["gpus_per_node"]
EVAL_GPUS = config["evaluate"]["gpus"]


def launch(*, gpus=0, train=False):
    """The start of every rule's shell command (`pipeline.launch.command.shell_prefix`): the job's
    log, GPUs of its own, a training stage as one process, under torchrun or one per node."""
    return shell_prefix(config.get("tracker"), gpus=gpus, train=config["train"] if train else None)


# The base's weights on disk (0 while an embedded base is not built, or a hub model not cached).
BASE_BYTES = weights_bytes(RUN_CONFIG.hub_snapshot.path if RUN_CONFIG.hub_snapshot is not None else Path(MODEL))


def job_resources(kind):
    """A rule's `resources:` for its kind of job (pipeline/planning/resources.py): derived from
    train.* / evaluate.gpus and the base model's size, with the `slurm.*` settings of its kind."""
    return rule_resources(kind, config, BASE_BYTES)


def reached_stages(vrun):
    """(the stages a variant trains, whether it goes on to the end): a sweep's pruning stops a
    variant at the first prune point where it is not among the best (a Snakemake checkpoint:
    known once every variant has finished and been evaluated at that stage)."""
    for i, stage in enumerate(STAGES):
        if stage in RUN_CONFIG.prune_at:
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
    targets, finished = reached_targets(vrun)
    return targets + (RUN_CONFIG.finished_outputs(layout.RunTree.of(vrun)) if finished else [])


def compare_inputs(wildcards):
    """Every variant's evaluations and stages as far as it got, its smoke test when it finished, and
    the prune decisions: the sweep comparison waits for all of them."""
    inputs = {"prune": [checkpoints.sweep_prune.get(stage=s).output[0] for s in RUN_CONFIG.prune_at]}
    for i, vrun in enumerate(VARIANTS):
        key = f"variant{i}"
        inputs[key], finished = reached_targets(vrun)
        if finished:
            inputs[key].append(layout.RunTree.of(vrun).smoke_test)
    return {key: value for key, value in inputs.items() if value}


def run_evaluations(v):
    """The base model's evaluation, then every stage's of a variant: a run's evaluation table."""
    return [R.evaluation(layout.BASE_EVAL), *(v.evaluation(s) for s in STAGES)]


def fetched(dataset: str) -> str:
    """`dataset`, once its files are here: a training dataset given by hub URL waits for its `fetch_data`
    checkpoint, after which its shard count is read from its pin (the same on every later run)."""
    key = DATA.hub_key(dataset)
    if key is not None:
        checkpoints.fetch_data.get(key=key)
    return dataset


def fetched_input(name: str, value=None):
    """A `params` function giving the job's input `name` to its command (`value(wc)` in its place: a dataset's
    path, which for a glob is not the files it matches). Before a hub dataset's `fetch_data` checkpoint has
    run, a job after it has only that checkpoint's output as input, and a dry run that prints commands (-n -p)
    would fail on `{input.<name>}`: it prints a stand-in instead (the job is planned again once the dataset is
    here). A function of `output`, so --rerun-triggers params leaves it out."""
    def given(wc, input, output):
        if input.get(name) is None:
            return f"<{name} once fetch_data has run>"
        return value(wc) if value else input[name]
    return given


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
