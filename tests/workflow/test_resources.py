"""What a training stage asks a cluster for follows train.nodes / gpus_per_node / nproc and the model."""

from __future__ import annotations

import re

import pytest
import yaml
from runkit import copy_workflow, snakemake

pytestmark = pytest.mark.workflow


def _train_resources(workdir, config: dict) -> dict[str, str]:
    (workdir / "variant.yaml").write_text(yaml.safe_dump(config))
    dry = snakemake(workdir, "results/demo/stages/pilot", "-n", "--cores", "all", "--configfile", "variant.yaml")
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-3000:]
    block = (dry.stdout + dry.stderr).split("rule train_stage:", 1)[1]
    line = re.search(r"^\s+resources: (.*)$", block, re.M).group(1)
    return dict(item.split("=", 1) for item in line.split(", "))


def test_one_node_asks_for_its_gpus_and_cpus_and_memory_per_rank(tmp_path):
    res = _train_resources(copy_workflow(tmp_path / "wf"), {"train": {"gpus_per_node": 4}})
    assert res["nodes"] == "1" and res["gpu"] == "4" and "mpi" not in res
    assert res["cpus_per_task"] == "16" and int(res["mem_mb"]) >= 4 * 6000


def test_two_nodes_ask_for_gpus_per_node_and_one_task_per_node(tmp_path):
    res = _train_resources(copy_workflow(tmp_path / "wf"), {"train": {"nodes": 2, "gpus_per_node": 8, "nproc": 8}})
    assert (res["nodes"], res["mpi"], res["tasks"], res["gres"]) == ("2", "srun", "2", "gpu:8")
    assert "gpu" not in res and res["cpus_per_task"] == "32" and int(res["mem_mb"]) >= 8 * 6000


def test_memory_follows_the_model_size(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    model = tmp_path / "big_model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(model / "model.safetensors", "wb") as f:  # a sparse 20 GiB file: size only, no disk
        f.truncate(20 * 2**30)
    res = _train_resources(workdir, {"model": str(model), "train": {"gpus_per_node": 1}})
    assert int(res["mem_mb"]) >= 20 * 1024 + 6000
