"""What each kind of job asks a cluster for: GPUs, tasks, memory, CPUs, runtime, partition, account.

Derived from the workflow config (`train.nodes` / `gpus_per_node` / `nproc`, `evaluate.gpus`,
`slurm.*`) and the base model's size on disk; the rules' `resources:` read it
(`job_resources(kind)` in workflow/rules/common.smk). No profile of this repository sets per-rule
resources: a key of the workflow profile (profiles/default) replaces the same key of the user's
`--profile` whole, so a `set-resources` there used to drop a cluster user's own.

Precedence, as Snakemake 9.27 with snakemake-executor-plugin-slurm 2.8 applies it (seen on the
test SLURM, tests/slurm/):

    `--set-resources` on the command line   (replaces the profiles' `set-resources` whole)
    > the user's profile `set-resources`
    > what this module derives (a rule's `resources:`), `slurm.*` settings included
    > the profile's `default-resources`

A key left out here (a null `slurm.*` setting, a CPU job's memory) falls to the profile's
`default-resources`. Torch-free: imported every time the Snakefile loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

# The kinds of job. Evaluation covers a stage's and the base's; CPU covers the data jobs
# (base, tokenizer, validation, tokenization) and consolidation.
TRAIN, EVALUATE, VERIFY, SMOKE, MERGE, CPU = "train", "evaluate", "verify", "smoke", "merge", "cpu"
BENCHMARK = "benchmark"  # one lm-eval task on one set of weights (evaluate.benchmarks)
# Which `slurm.<group>` setting (partition, account, extra) each kind takes.
SLURM_GROUP = {TRAIN: "train", EVALUATE: "evaluate", VERIFY: "evaluate", SMOKE: "evaluate", BENCHMARK: "evaluate",
               MERGE: "cpu", CPU: "cpu"}
# SLURM's warning before the time limit, on which the trainer checkpoints and exits so that the
# retry resumes (profiles/slurm's default slurm_extra). A rule's slurm_extra replaces the
# profile's, so a `slurm.train.extra` without a --signal of its own gets this one in front.
TRAIN_SIGNAL = "--signal=USR1@300"

MB = 2**20
RUNTIME_MINUTES = {EVALUATE: 60, BENCHMARK: 240}  # per attempt: a retry after a timeout gets longer


def job_resources(kind: str, config: Mapping, weights_bytes: int) -> dict:
    """The `resources:` of one kind of job under the validated workflow config (defaults filled)."""
    if kind not in SLURM_GROUP:
        raise ValueError(f"unknown kind of job {kind!r} (known: {', '.join(SLURM_GROUP)})")
    if kind == TRAIN:
        own = train_resources(config["train"], weights_bytes)
    elif kind in (EVALUATE, VERIFY, SMOKE, BENCHMARK):
        own = evaluate_resources(kind, config["evaluate"]["gpus"], weights_bytes)
    elif kind == MERGE:
        own = merge_resources()
    else:
        own = {}
    return own | slurm_resources(config.get("slurm", {}).get(SLURM_GROUP[kind]) or {}, train=kind == TRAIN)


def train_resources(train: Mapping, weights_bytes: int) -> dict:
    """A training stage, from `train.nodes` / `gpus_per_node` / `nproc` and the model's size.

    One node: `gpu` GPUs (sbatch --gpus). More: one task per node (the launcher starts one
    torchrun per node with srun; snakemake runs the rule's command on the first node, `mpi`),
    `gres: gpu:G` per node. Memory per node: about one copy of the base (a sharded FSDP load maps
    it once per node) plus 6 GB per rank; 4 CPUs per rank. Runtime 240 minutes per attempt: a
    retry after a timeout gets longer (it resumes from the last checkpoint).
    """
    nodes = int(train["nodes"])
    # A cluster needs a number: `auto` (every GPU present locally) asks for one.
    gpus = 1 if train["gpus_per_node"] == "auto" else int(train["gpus_per_node"])
    ranks = int(train["nproc"]) if train["nproc"] != "auto" else max(1, gpus)
    resources = {
        "nodes": nodes,
        "mem_mb": max(8000, int(weights_bytes * 1.25 / MB) + 6000 * ranks),
        "cpus_per_task": 4 * ranks,
        "runtime": per_attempt(240),
    }
    if nodes > 1:
        resources.update(mpi="srun", tasks=nodes, tasks_per_gpu=0)
        if gpus:
            resources["gres"] = f"gpu:{gpus}"
    elif gpus:
        resources["gpu"] = gpus
    return resources


def evaluate_resources(kind: str, gpus: int, weights_bytes: int) -> dict:
    """Evaluation (of a stage or the base), merge verification, the smoke test and a benchmark:
    `evaluate.gpus` GPUs on one node (none at 0: then they run on the CPUs), 4 CPUs.

    Memory: one model at a time (verification frees the reference before it loads the merged
    model), in fp32 when it runs on a CPU: twice a bf16 checkpoint, plus 4 GB; never less than
    the 16 GB these jobs always had. Runtime: an hour, an evaluation an hour per attempt, a
    benchmark four hours per attempt (a generative task such as GSM8K decodes every answer).
    """
    resources = {
        "mem_mb": max(16000, int(2 * weights_bytes / MB) + 4000),
        "cpus_per_task": 4,
        "runtime": per_attempt(RUNTIME_MINUTES[kind]) if kind in RUNTIME_MINUTES else 60,
    }
    if gpus:
        resources["gpu"] = int(gpus)
    return resources


def merge_resources() -> dict:
    """The streaming merge reads one tensor of the base at a time (pipeline.export.merge): its
    memory does not grow with the model, so fixed values, 2 CPUs, 8 GB, two hours."""
    return {"cpus_per_task": 2, "mem_mb": 8000, "runtime": 120}


def slurm_resources(settings: Mapping, *, train: bool = False) -> dict:
    """`slurm.<group>`'s partition, account and extra sbatch flags as the plugin's resources;
    a null setting sets nothing, so the profile's default-resources apply.

    `extra` replaces the profile's default `slurm_extra` (the plugin takes one value): a training
    job's gets `TRAIN_SIGNAL` in front unless it names a `--signal` itself, so preemption still
    checkpoints and resumes.
    """
    resources = {}
    if settings.get("partition") is not None:
        resources["slurm_partition"] = str(settings["partition"])
    if settings.get("account") is not None:
        resources["slurm_account"] = str(settings["account"])
    extra = settings.get("extra")
    if extra is not None:
        if train and "--signal" not in extra:
            extra = f"{TRAIN_SIGNAL} {extra}"
        resources["slurm_extra"] = extra
    return resources


def per_attempt(minutes: int) -> Callable:
    """A runtime that grows with Snakemake's `attempt` (1, 2, ... with --retries)."""
    def runtime(wildcards, attempt):
        return minutes * attempt
    return runtime


def weights_bytes(model_dir: Path | None) -> int:
    """Bytes of a model's weight files (*.safetensors, else *.bin); 0 when the dir is not there
    yet (an embedded base before `prepare_base`, a hub model not cached)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return 0
    files = list(Path(model_dir).glob("*.safetensors")) or list(Path(model_dir).glob("*.bin"))
    return sum(p.stat().st_size for p in files)


def training_threads(cores: int | None) -> int:
    """A local training stage's threads: all cores but one (left to evaluating the previous stage
    meanwhile). None (a cluster executor has no local core count): 1, as the job's cpus_per_task
    sizes the allocation there."""
    return max(1, cores - 1) if cores else 1
