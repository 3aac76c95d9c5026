"""Copies of the workflow set up for the test SLURM cluster (tests/slurm), and the environment its
snakemake calls run in: shared by the SLURM tests and bench/bench_slurm_nodes.py."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kits.run import copy_workflow

# The workflow's own `slurm` settings in the SLURM tests' copies (config/config.yaml): where the
# test profile's set-resources say nothing, they decide; where it does, it wins.
SLURM_SETTINGS = {"evaluate": {"partition": "gpu", "account": "acct_workflow"}, "cpu": {"account": "acct_cpu"}}
# Every training stage on the nodes, with short rendezvous and collective timeouts: a lost node
# ends its job within them (the defaults, 600 s and 1800 s, suit real clusters).
RDZV_TIMEOUT_S, COLLECTIVE_TIMEOUT_S = 60, 60


def slurm_workdir(dest: Path, nodes: int = 2) -> Path:
    """A copy of the workflow whose config/config.yaml carries SLURM_SETTINGS, `train.nodes` and the
    timeouts above (every later snakemake call in it, local or not, then sees the same config)."""
    workdir = copy_workflow(dest)
    path = workdir / "config/config.yaml"
    config = yaml.safe_load(path.read_text())
    for kind, settings in SLURM_SETTINGS.items():
        config["slurm"][kind].update(settings)
    config["train"].update({"nodes": nodes, "rdzv_timeout_s": RDZV_TIMEOUT_S})
    config["train"]["overrides"].append(f"distributed.timeout_s={COLLECTIVE_TIMEOUT_S}")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return workdir


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment without inherited SLURM_*/SBATCH_*/SRUN_* job variables.

    The SLURM_TEST_* knobs of cluster.sh (e.g. SLURM_TEST_FAKE_GPUS) are kept.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("SLURM_TEST_")
        or not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
    }
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env
