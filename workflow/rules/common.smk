# Validated config, the stage list, paths and input functions shared by all rules.

import json
import os
import re
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from pipeline.errors import UserError
from pipeline.planning.plan import world_size as plan_world_size
from pipeline.planning.resources import job_resources as rule_resources, training_threads, weights_bytes
from pipeline.planning.schedule import PILOT, plan_stages
from pipeline.storage import hub
from pipeline.planning.sweep import prune_points as sweep_prune_points, variants as sweep_variants
from pipeline.workflow_config import EMBEDDED_KINDS


def _chat_template_problems(value):
    from pipeline.data.chat import BUILTIN_TEMPLATES, TOKENIZER_OWN

    if value in TOKENIZER_OWN or value in BUILTIN_TEMPLATES or os.path.isfile(value):
        return []
    return [f"data.chat_template: {value!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
            "nor an existing .jinja file"]


def _check_config():
    """Every problem of config/config.yaml at once, naming its key, before any job runs."""
    from pipeline.workflow_config import path_problems, schema_problems

    problems = schema_problems(config, Path(workflow.current_basedir) / "../schemas/config.schema.yaml")
    if not problems:
        validate(config, "../schemas/config.schema.yaml")  # fills in the defaults
        problems = path_problems(config) + _chat_template_problems(config["data"]["chat_template"])
    if problems:
        raise WorkflowError("config: " + "\n  ".join(["problems in the workflow config (config/config.yaml):",
                                                      *problems]))


_check_config()

RUN = config["run"]
R = f"results/{RUN}"  # the run: the shared data and base evaluation, a sweep's comparison
WORK = f"work/{RUN}"  # undeclared scratch: intra-stage checkpoints survive a failed attempt
# The embedded defaults (`model` values, EMBEDDED_KINDS), each built by `prepare_base` into
# results/<name>/: its base model in model/, its demo dataset in data/.

_sched = config["schedule"]
STAGES = [s.name for s in plan_stages(_sched["total_updates"], _sched["pilot_fraction"], _sched["num_chunks"])]
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
    return {f"{RUN}/variants/{name}": (name, overrides) for name, overrides in named.items()}, at, keep


VARIANTS, PRUNE_AT, PRUNE_KEEP = _variants()
SWEEP = next(iter(VARIANTS)) != RUN
V = "results/{vrun}"  # one trained variant: its plan, stages, evaluations, exports


def is_embedded(value):
    return value in EMBEDDED_KINDS


# The demo whose dataset `data: embedded` means: the embedded model's own, else the text demo's.
DEMO = config["model"] if is_embedded(config["model"]) else "embedded"
MODEL = f"results/{config['model']}/model" if is_embedded(config["model"]) else config["model"]


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
    MODEL = f"{R}/model.json"


def _check_base_untouched():
    """The base model dir is read-only to us: refuse outputs inside it, up front."""
    if is_embedded(config["model"]) or not os.path.isdir(MODEL):
        return
    base = Path(MODEL).resolve()
    for out in (R, WORK, "logs", "benchmarks"):
        p = Path(out).resolve()
        if p == base or base in p.parents:
            raise WorkflowError(f"config: output path {out} is inside the base model dir {MODEL}; choose another run dir")


_check_base_untouched()


def data_file(split):
    """Path of a dataset split, an embedded demo's ("embedded": the embedded model's), or None when the config says null."""
    value = config["data"][split]
    if value is None:
        return None
    if is_embedded(value):
        return f"results/{DEMO if value == 'embedded' else value}/data/{split}.jsonl"
    return value


def model_inputs():
    """The base model as an input: its dir, or a hub model's model.json (made by `fetch_model`)."""
    return [MODEL]


def base_model(wildcards, input):
    """The base model argument: the dir or a hub model's model.json (read from the HF cache)."""
    return input.model


def data_inputs():
    return {split: data_file(split) for split in ("train", "val", "test") if data_file(split)}


# The run's tokenizer (`prepare_tokenizer`): the chat template the run trains with, and any
# special tokens it added; every job that renders or decodes text reads it.
TOKENIZER = f"{R}/tokenizer"


def train_overrides(variant_overrides=()):
    """Hydra overrides: the user's, the variant's, then the paths this workflow owns."""
    own = [f"model.path={MODEL}", f"model.tokenizer={TOKENIZER}", f"data.train_cache={R}/data/train.safetensors"]
    own.append(f"data.val_cache={R}/data/val.safetensors" if data_file("val") else "data.val_cache=null")
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
        raise WorkflowError(f"config{where}: the workflow config (config/config.yaml) and the trainer config "
                            "(config/train/ + train.overrides) disagree:\n  " + "\n  ".join(problems))
    return cfg, config_id(cfg)


# vrun -> (resolved trainer config, its id); a sweep's base config (no variant's overrides) too:
# it is what the base model is evaluated with, once for all variants.
TRAIN = {vrun: _resolve_train_config(name, train_overrides(overrides)) for vrun, (name, overrides) in VARIANTS.items()}
BASE_TRAIN = TRAIN[RUN] if not SWEEP else _resolve_train_config("", train_overrides())
HAS_EMA = bool(next(iter(TRAIN.values()))[0].ema.rates)
if any(bool(cfg.ema.rates) != HAS_EMA for cfg, _ in TRAIN.values()):
    raise WorkflowError("config: in one sweep either every variant keeps EMA weights (ema.rates) or none does")


def variant_overrides(vrun):
    return train_overrides(VARIANTS[vrun][1])


def variant_name(vrun):
    return VARIANTS[vrun][0]


def previous_stage(stage):
    i = STAGES.index(stage)
    return STAGES[i - 1] if i else None


def train_inputs(wildcards):
    v = f"results/{wildcards.vrun}"
    inputs = {
        "plan": f"{v}/plan.json",
        "config": f"{v}/train_config.yaml",
        "train": f"{R}/data/train.safetensors",
    }
    if data_file("val"):
        inputs["val"] = f"{R}/data/val.safetensors"
    prev = previous_stage(wildcards.stage)
    if prev is not None:
        inputs["init"] = f"{v}/stages/{prev}"
    if wildcards.stage != PILOT:
        # No chunk starts before the pilot passed its sanity gate.
        inputs["gate"] = f"{v}/pilot_report.json"
    return inputs


def init_flag(wildcards, input):
    return f"--init {input.init}/checkpoint" if "init" in input.keys() else ""


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
    return f"{V}/export/adapter_ema" if config["export"]["weights"] == "ema" else f"{V}/export/adapter_final"


def ema_rate_flag():
    rate = config["export"]["ema_rate"]
    return f"--ema-rate {rate}" if rate is not None else ""


def best_exports(v):
    """A run's best raw (and EMA, when it keeps any) weights; tracked only with a validation set."""
    if not data_file("val"):
        return []
    return [f"{v}/export/adapter_best"] + ([f"{v}/export/adapter_best_ema"] if HAS_EMA else [])


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


def run_targets(vrun):
    """What `snakemake` makes of one variant: every stage it reaches and its evaluation, and, when
    it goes on to the end, its summary, report pages and exports."""
    v = f"results/{vrun}"
    stages, finished = reached_stages(vrun)
    targets = [f"{v}/stages/{s}" for s in stages] + [f"{v}/eval/{s}.json" for s in stages]
    if finished:
        targets += [f"{v}/eval/summary.csv", f"{v}/eval/loss.png", f"{v}/eval/val_loss.png",
                    f"{v}/report/summary.html", f"{v}/report/plan.html",
                    f"{v}/report/overview.html", f"{v}/report/samples.html", f"{v}/report/pilot_gate.html",
                    f"{v}/export/adapter_final", *([f"{v}/export/adapter_ema"] if HAS_EMA else []),
                    f"{v}/export/verification.json", f"{v}/export/smoke_test.json", *best_exports(v)]
    return targets


def compare_inputs(wildcards):
    """Every variant's evaluations and stages as far as it got, its smoke test when it finished, and
    the prune decisions: the sweep comparison waits for all of them."""
    inputs = {"prune": [checkpoints.sweep_prune.get(stage=s).output[0] for s in PRUNE_AT]}
    for i, vrun in enumerate(VARIANTS):
        stages, finished = reached_stages(vrun)
        v = f"results/{vrun}"
        key = f"variant{i}"
        inputs[key] = [f"{v}/stages/{s}" for s in stages] + [f"{v}/eval/{s}.json" for s in stages]
        if finished:
            inputs[key].append(f"{v}/export/smoke_test.json")
    return {key: value for key, value in inputs.items() if value}


def card_inputs():
    """What an export dir's model card (README.md) is written from: the run's plan, data stats,
    trainer config and every evaluation (the export rules declare them as inputs)."""
    return {
        "plan": f"{V}/plan.json",
        "stats": f"{R}/data/stats.json",
        "train_config": f"{V}/train_config.yaml",
        "evals": [f"{R}/eval/base.json", *(f"{V}/eval/{s}.json" for s in STAGES)],
    }


def card_flags(wildcards, input):
    """The export commands' `--card-*` options for the `card_inputs` of a rule."""
    return (f"--card-run {wildcards.vrun} --card-plan {input.plan} --card-stats {input.stats} "
            f"--card-config {input.train_config} --card-eval {' '.join(input.evals)}")


def optional(flag, value):
    return f"{flag} {value}" if value is not None else ""


wildcard_constraints:
    stage="|".join(STAGES),
    vrun="|".join(re.escape(v) for v in VARIANTS),
