# Snakemake glue: the run's config (checked and resolved by the package), paths, input functions.
#
# Everything about the config itself (its checks, the sweep variants, the trainer overrides, the
# Hydra resolution and its id, the cross-checks, the guard) is pipeline/planning/run_config.py,
# one call below; what is here only hands its results to the rules.

import json
import re
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger

from pipeline import layout
from pipeline.errors import UserError
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


onstart:
    if not workflow.touch:
        for run, name in RUN_CONFIG.changed:
            logger.warning(f"on_config_change: archive: moved {run.label}'s trained outputs to "
                           f"{guard.archive(run, name)}")


def plan_params(variant_of, *, base=False):
    """The `plan` rule's params for the trained run `variant_of(wildcards)` (a `run_config.Variant`);
    `base`: a sweep's base config, which trains nothing (no ranks, no memory estimate, no export).

    Snakemake compares a rule's params to decide a rerun (--rerun-triggers params): the plan's
    are what it depends on, the resolved trainer config (`config_id`), the stage windows
    (`schedule`), and for a trained run the ranks of a stage and the longest record. The rest is a
    function of `output`, which Snakemake leaves out: the config's text (its sha256 is config_id)
    and the export settings (checked when the workflow loads: no reason to plan or train again).
    """
    schedule, export = config["schedule"], config["export"]
    params = {
        "config_id": lambda wc: variant_of(wc).config_id,
        "schedule": " + ".join(f"{s.name}:{s.start}-{s.end}" for s in RUN_CONFIG.stages),
        "args": lambda wc, output: (
            f"--total-updates {schedule['total_updates']} --pilot-fraction {schedule['pilot_fraction']} "
            f"--num-chunks {schedule['num_chunks']} --resolved-config {shlex.quote(variant_of(wc).text)}"),
    }
    if not base:
        params |= {
            "world": f"--world-size {RUN_CONFIG.world}" if RUN_CONFIG.world else "",
            "max_length": config["data"]["max_length"],  # the memory estimate's longest sequence
            "export": lambda wc, output: f"--export-weights {export['weights']} --export-ema-rate {export['ema_rate']}",
        }
    return params


# --- data: the dataset files and the training datasets -------------------------------------------

# Several training datasets (data.train a list; pipeline/workflow_config.py train_sets): name -> its
# path, weight / records, columns / roles. Each is validated and tokenized by jobs of its own
# (wildcard `dataset`), into R.train_set(name); None for one training file (the rules `validate_dataset`
# and `tokenize`).
TRAIN_SETS = RUN_CONFIG.train_sets


def data_file(split):
    """Path of a dataset split (of a run with one training file), or None when the config says null."""
    return RUN_CONFIG.dataset(split)


def model_inputs():
    """The base model as an input: its dir, or a hub model's model.json (made by `fetch_model`)."""
    return [MODEL]


def base_model(wildcards, input):
    """The base model argument: the dir or a hub model's model.json (read from the HF cache)."""
    return input.model


def data_inputs():
    return {split: data_file(split) for split in ("train", "val", "test") if data_file(split)}


def train_set_inputs(wildcards):
    """One training dataset of several, and the val / test files it is validated with (their overlaps)."""
    return {"train": TRAIN_SETS[wildcards.dataset]["path"], **data_inputs()}


def train_caches():
    """The training token cache(s) the stages read: one, or one per dataset of several."""
    if TRAIN_SETS is None:
        return [R.cache("train")]
    return [R.train_set_cache(name) for name in TRAIN_SETS]


def field_flags(fields=None):
    """`--columns ours=theirs,... --roles theirs=ours,...` from data.columns / data.roles, or a training
    dataset's own (`fields`: a TRAIN_SETS entry); nothing when empty. For every command that reads the dataset files."""
    fields = fields or config["data"]
    pairs = lambda mapping: ",".join(f"{k}={v}" for k, v in mapping.items())
    return " ".join(f"{flag} {shlex.quote(pairs(fields[key]))}" for flag, key in
                    (("--columns", "columns"), ("--roles", "roles")) if fields[key])


# --- training, evaluation and export -------------------------------------------------------------

def variant_name(vrun):
    return VARIANTS[vrun][0]


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
    """The start of every rule's shell command: `pipeline.launch` sends the command's output to
    the rule's log and, when it fails, the reason to the terminal; it hands the job GPUs of its
    own (`gpus`: 0, a count or "all"), and runs a training stage as one process, under torchrun,
    or as one torchrun per node.
    """
    extra = f" --train --nodes {config['train']['nodes']} --nproc {config['train']['nproc']}" if train else ""
    return tracker_exports() + f"exec python -m pipeline.launch --log {{log}} --gpus {gpus}{extra} -- "


def tracker_exports():
    """`export PIPELINE_TRACKER_...=...; ` for the config's tracker section (empty when off): an
    environment, not a param, so that turning tracking on or off reruns no job."""
    from pipeline.tracker import env_for

    text = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env_for(config.get("tracker", {})).items())
    return text.replace("{", "{{").replace("}", "}}")


# The base's weights on disk (0 while an embedded base is not built, or a hub model not cached).
BASE_BYTES = weights_bytes(RUN_CONFIG.hub_snapshot.path if RUN_CONFIG.hub_snapshot is not None else Path(MODEL))


def job_resources(kind):
    """A rule's `resources:` for its kind of job (pipeline/planning/resources.py): derived from
    train.* / evaluate.gpus and the base model's size, with the `slurm.*` settings of its kind."""
    return rule_resources(kind, config, BASE_BYTES)


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
    v = layout.RunTree.of(vrun)
    targets, finished = reached_targets(vrun)
    if finished:
        targets += [v.summary_csv, v.loss_plot, v.val_loss_plot,
                    v.summary_html, v.plan_html, v.overview_html, v.samples_html, v.pilot_gate_html,
                    *adapter_exports(v), v.verification, v.smoke_test]
    return targets


def run_evaluations(v):
    """The base model's evaluation, then every stage's of a variant: a run's evaluation table."""
    return [R.evaluation(layout.BASE_EVAL), *(v.evaluation(s) for s in STAGES)]


def optional(flag, value):
    """`flag value`, or nothing when there is no value: None, or the empty list Snakemake gives for an
    input / output declared as [] (a split the config sets to null): a flag without its value is an
    argparse error after the run has started."""
    absent = value is None or (isinstance(value, (list, str)) and not value)
    return "" if absent else f"{flag} {value}"


wildcard_constraints:
    stage="|".join(STAGES),
    dataset="|".join(re.escape(name) for name in TRAIN_SETS or ["(?!)"]),
    vrun="|".join(re.escape(v) for v in VARIANTS),
