"""Multi-node as configuration: the launcher's one-torchrun-per-node path, run as two agents on this
host (c10d rendezvous on localhost, one gloo process each), computes what one 2-rank process does."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kits.train import checkpoint_digests, make_run, pipeline_env, stage_names, step_losses

pytestmark = pytest.mark.distributed


def _train_two_nodes(run, stage: str, init: str | None) -> None:
    """A stage as the rule starts it with train.nodes=2: the launcher, which starts one agent per node."""
    log = run.root / "logs" / f"{stage}.log"
    args = ["--plan", run.plan, "--config", run.config, "--stage", stage, "--scratch", run.scratch(stage),
            "--out", run.stage_dir(stage)]
    if init:
        args += ["--init", run.stage_dir(init) / "checkpoint"]
    cmd = [sys.executable, "-m", "pipeline.launch", "--log", str(log), "--train", "--nodes", "2", "--nproc", "1",
           "--", "-m", "pipeline", "train", *map(str, args)]
    proc = subprocess.run(cmd, env=pipeline_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr + log.read_text()[-3000:]


def test_two_agents_with_c10d_equal_one_process_with_two_ranks(tiny, tmp_path):
    nodes = make_run(tmp_path / "nodes", tiny, total=9, fraction=0.25, chunks=2)
    names = stage_names(nodes)
    assert names == ["pilot", "chunk01", "chunk02", "tail"]
    prev = None
    for name in names:
        _train_two_nodes(nodes, name, prev)
        prev = name
    one = make_run(tmp_path / "one", tiny, total=9, fraction=0.25, chunks=2, single_stage=True)
    one.train("all", nproc=2)
    assert checkpoint_digests(nodes.stage_dir(names[-1]) / "checkpoint") == checkpoint_digests(
        one.stage_dir("all") / "checkpoint")
    assert step_losses([nodes.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    state = nodes.stage_dir(names[-1]) / "checkpoint" / "training_state"
    assert (state / "rng_rank000.json").is_file() and (state / "rng_rank001.json").is_file()
