"""A sweep on the real local SLURM: every variant's stages are jobs of their own.

Dry run of config/sweep.yaml (2 learning rates x 2 LoRA ranks) through the test
profile: the four pilots are four train_stage jobs, each asking SLURM for its
own GPU, and none waits for another (their only inputs are the shared data and
each variant's own plan), so the cluster runs them side by side.
"""

from __future__ import annotations

import re

import pytest
from kits.run import copy_workflow, jobs_with_wildcards

pytestmark = pytest.mark.slurm

GRID = ["lr-0.001_r-8", "lr-0.001_r-16", "lr-0.002_r-8", "lr-0.002_r-16"]
_NODE = re.compile(r'^\s*(\d+)\[label = "(\w+)(?:\\n)?([^"]*)"')
_EDGE = re.compile(r"^\s*(\d+) -> (\d+)")


def _ancestors(node: str, parents: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [node]
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_the_four_pilots_of_a_sweep_are_four_independent_slurm_jobs(slurm_cluster, tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    dry = slurm_cluster.snakemake(workdir, "-n", "--workflow-profile", "profiles/default",
                                  "--configfile", "config/sweep.yaml").check()
    pilots = [w for rule, w in jobs_with_wildcards(dry.stdout) if rule == "train_stage" and w["stage"] == "pilot"]
    assert sorted(w["vrun"] for w in pilots) == sorted(f"demo/variants/{name}" for name in GRID)
    for block in dry.stdout.split("rule train_stage:")[1:]:
        resources = next(line for line in block.splitlines() if line.strip().startswith("resources:"))
        # what the SLURM executor submits with: the test profile's partition for training, one GPU per stage
        assert f"slurm_partition={slurm_cluster.second_partition}" in resources and "gpu=1" in resources, resources
    # The job graph: no pilot has another training stage upstream of it.
    dag = slurm_cluster.snakemake(workdir, "--dag", "--workflow-profile", "profiles/default",
                                  "--configfile", "config/sweep.yaml").check().stdout
    labels = {m.group(1): (m.group(2), m.group(3)) for line in dag.splitlines() if (m := _NODE.match(line))}
    parents: dict[str, set[str]] = {}
    for line in dag.splitlines():
        if m := _EDGE.match(line):
            parents.setdefault(m.group(2), set()).add(m.group(1))
    pilot_nodes = [n for n, (rule, wc) in labels.items() if rule == "train_stage" and "stage: pilot" in wc]
    assert len(pilot_nodes) == 4
    for node in pilot_nodes:
        upstream = {labels[a][0] for a in _ancestors(node, parents)}
        assert "train_stage" not in upstream, upstream
        assert upstream <= {"plan", "tokenize_dataset", "tokenize_val", "data_reports", "validate_dataset", "prepare_base", "prepare_tokenizer"}, upstream
