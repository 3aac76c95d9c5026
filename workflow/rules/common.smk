# Validated config, the stage list, paths and input functions shared by all rules.

import os
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from pipeline.errors import UserError
from pipeline.schedule import PILOT, plan_stages


validate(config, "../schemas/config.schema.yaml")

RUN = config["run"]
R = f"results/{RUN}"  # declared outputs of this run
WORK = f"work/{RUN}"  # undeclared scratch: intra-stage checkpoints survive a failed attempt
# The embedded defaults (`model` values), each built by `prepare_base` into results/<name>/:
# its base model in model/, its demo dataset in data/.
EMBEDDED_KINDS = {"embedded": "text", "embedded-vlm": "vlm"}

_sched = config["schedule"]
STAGES = [s.name for s in plan_stages(_sched["total_updates"], _sched["pilot_fraction"], _sched["num_chunks"])]
LAST_STAGE = STAGES[-1]


def is_embedded(value):
    return value in EMBEDDED_KINDS


# The demo whose dataset `data: embedded` means: the embedded model's own, else the text demo's.
DEMO = config["model"] if is_embedded(config["model"]) else "embedded"
MODEL = f"results/{config['model']}/model" if is_embedded(config["model"]) else config["model"]


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
    """The base model as a file input when it is local (a hub id is only a param)."""
    return [MODEL] if is_embedded(config["model"]) or os.path.isdir(MODEL) else []


def base_model(wildcards, input):
    """The base model argument: the local dir input, else the hub id."""
    return input.model if input.get("model") else MODEL


def data_inputs():
    return {split: data_file(split) for split in ("train", "val", "test") if data_file(split)}


def train_overrides():
    """Hydra overrides: the user's, then the paths this workflow owns."""
    own = [f"model.path={MODEL}", f"data.train_cache={R}/data/train.safetensors"]
    own.append(f"data.val_cache={R}/data/val.safetensors" if data_file("val") else "data.val_cache=null")
    return list(config["train"]["overrides"]) + own


TRAIN_CONFIG_DIR = "config/train"


def _resolve_train_config():
    """The trainer config as every stage will train with it, checked against this workflow config.

    Resolved when the workflow loads, so a bad key, a bad value or a mismatch
    between the two configs stops `snakemake` before any job (the `plan` rule
    runs the same checks). Its content is also the plan's cache key:
    `TRAIN_CONFIG_ID` changes only when a resolved value does.
    """
    from pipeline import config as train_config
    from pipeline.plan import config_id, cross_check

    try:
        cfg = train_config.resolve(TRAIN_CONFIG_DIR, config["train"]["config_name"], train_overrides())
    except UserError as err:
        raise WorkflowError(f"config: {err}") from None
    problems = cross_check(cfg, export_weights=config["export"]["weights"],
                           export_ema_rate=config["export"]["ema_rate"], nproc=config["train"]["nproc"])
    if problems:
        raise WorkflowError("config: the workflow config (config/config.yaml) and the trainer config "
                            "(config/train/ + train.overrides) disagree:\n  " + "\n  ".join(problems))
    return cfg, config_id(cfg)


TRAIN_CFG, TRAIN_CONFIG_ID = _resolve_train_config()
HAS_EMA = bool(TRAIN_CFG.ema.rates)


def previous_stage(stage):
    i = STAGES.index(stage)
    return STAGES[i - 1] if i else None


def train_inputs(wildcards):
    inputs = {
        "plan": f"{R}/plan.json",
        "config": f"{R}/train_config.yaml",
        "train": f"{R}/data/train.safetensors",
    }
    if data_file("val"):
        inputs["val"] = f"{R}/data/val.safetensors"
    prev = previous_stage(wildcards.stage)
    if prev is not None:
        inputs["init"] = f"{R}/stages/{prev}"
    if wildcards.stage != PILOT:
        # No chunk starts before the pilot passed its sanity gate.
        inputs["gate"] = f"{R}/pilot_report.json"
    return inputs


def init_flag(wildcards, input):
    return f"--init {input.init}/checkpoint" if "init" in input.keys() else ""


def train_threads():
    """All local cores but one (left to evaluating the previous stage meanwhile).

    A cluster executor has no local core count; there the job's cpus_per_task
    (profiles/default) sizes the allocation and this value is not used.
    """
    try:
        return max(1, workflow.cores - 1)
    except WorkflowError:
        return 1


def nproc(wildcards, resources):
    """Processes per training job: one per allocated GPU (1 on CPU), unless configured."""
    n = config["train"]["nproc"]
    return int(n) if n != "auto" else max(1, int(resources.get("gpu", 0)))


def export_adapter():
    return f"{R}/export/adapter_ema" if config["export"]["weights"] == "ema" else f"{R}/export/adapter_final"


def ema_rate_flag():
    rate = config["export"]["ema_rate"]
    return f"--ema-rate {rate}" if rate is not None else ""


def best_exports():
    """The run's best raw (and EMA, when it keeps any) weights; tracked only with a validation set."""
    if not data_file("val"):
        return []
    return [f"{R}/export/adapter_best"] + ([f"{R}/export/adapter_best_ema"] if HAS_EMA else [])


def optional(flag, value):
    return f"{flag} {value}" if value is not None else ""


wildcard_constraints:
    stage="|".join(STAGES),
