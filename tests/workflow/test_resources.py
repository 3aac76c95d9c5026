"""The rules ask for what pipeline/planning/resources.py derives (its unit tests: tests/test_resources.py),
and no profile of the repository overrides it."""

from __future__ import annotations

import re

import pytest
import yaml
from kits.run import copy_workflow, snakemake
from snakemake.utils import validate

from pipeline.planning.resources import job_resources

pytestmark = pytest.mark.workflow

# The kind of job each rule that may go to a cluster is.
RULE_KINDS = {"train_stage": "train", "evaluate_base": "evaluate", "evaluate_stage": "evaluate",
              "verify_merge": "verify", "smoke_test": "smoke", "merge_lora": "merge",
              "prepare_tokenizer": "cpu", "validate_dataset": "cpu", "tokenize_dataset": "cpu", "tokenize_val": "cpu",
              "consolidate": "cpu", "benchmark_base": "benchmark", "benchmark": "benchmark"}
# Snakemake's own additions to every job's resources.
SNAKEMAKE_OWN = {"tmpdir", "mem", "mem_mib", "disk", "disk_mb", "disk_mib"}


def _dry_run_resources(text: str) -> dict[str, dict[str, str]]:
    """rule -> the resources its first job shows in a dry run."""
    found = {}
    for block in re.split(r"^(?=(?:local)?(?:rule|checkpoint) \w+:$)", text, flags=re.M):
        rule = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", block)
        line = re.search(r"^\s+resources: (.*)$", block, re.M)
        if rule and line and rule.group(1) not in found:
            items = dict(item.split("=", 1) for item in line.group(1).split(", "))
            found[rule.group(1)] = {k: v for k, v in items.items() if k not in SNAKEMAKE_OWN}
    return found


def test_every_rule_asks_for_what_its_kind_derives(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    model = tmp_path / "big_model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(model / "model.safetensors", "wb") as f:  # a sparse 20 GiB file: size only, no disk
        f.truncate(20 * 2**30)
    variant = {"model": str(model), "train": {"nodes": 2, "gpus_per_node": 8, "nproc": 8}, "evaluate": {"gpus": 2},
               "slurm": {"train": {"partition": "gpu-long", "extra": "--exclusive"},
                         "evaluate": {"account": "lab-eval"}, "cpu": {"partition": "cpu"}}}
    (workdir / "variant.yaml").write_text(yaml.safe_dump(variant))
    dry = snakemake(workdir, "-n", "--cores", "all", "--configfile", "variant.yaml")
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-3000:]
    shown = _dry_run_resources(dry.stdout + dry.stderr)

    config = yaml.safe_load((workdir / "config/config.yaml").read_text()) | variant
    validate(config, str(workdir / "workflow/schemas/config.schema.yaml"))
    for rule, kind in RULE_KINDS.items():
        expected = {key: str(value(None, 1) if callable(value) else value)
                    for key, value in job_resources(kind, config, 20 * 2**30).items()}
        assert shown[rule] == expected, (rule, shown[rule], expected)
    # what that means for three of them
    assert {k: shown["train_stage"][k] for k in ("nodes", "gres", "mpi", "slurm_partition")} == \
        {"nodes": "2", "gres": "gpu:8", "mpi": "srun", "slurm_partition": "gpu-long"}
    assert shown["smoke_test"]["gpu"] == "2" and shown["smoke_test"]["slurm_account"] == "lab-eval"
    assert shown["tokenize_dataset"] == {"slurm_partition": "cpu"}
    # a benchmark job: evaluate.gpus GPUs, memory for the 20 GiB model, the evaluate account, 4 h
    assert {k: shown["benchmark"][k] for k in ("gpu", "mem_mb", "slurm_account", "runtime")} == \
        {"gpu": "2", "mem_mb": str(2 * 20 * 1024 + 4000), "slurm_account": "lab-eval", "runtime": "240"}
