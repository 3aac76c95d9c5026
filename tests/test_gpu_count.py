"""More training processes than GPUs fails with a message naming train.nproc and the device count:
at plan time where the plan sees the GPUs (a local run), and in every rank's setup (CUDA would
fail with "invalid device ordinal"). A GPU host is simulated by patching torch.cuda."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kits.train import resolved_config

from pipeline import distributed
from pipeline.errors import UserError
from pipeline.model import memory
from pipeline.planning import checks, plan

def _gpu_host(monkeypatch, count: int) -> list:
    """torch.cuda as on a host with `count` GPUs; returns the devices `set_device` was given."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def _ranks(monkeypatch, rank: int, local_world: int, world: int) -> None:
    for key, value in {"RANK": rank, "LOCAL_RANK": rank % local_world, "LOCAL_WORLD_SIZE": local_world,
                       "WORLD_SIZE": world}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_of_a_node_with_too_few_gpus_stops_naming_nproc_and_the_count(monkeypatch, rank):
    chosen = _gpu_host(monkeypatch, 1)
    _ranks(monkeypatch, rank, local_world=2, world=2)
    with pytest.raises(UserError) as err:
        distributed.setup()
    text = str(err.value)
    assert "starts 2 training processes" in text and "CUDA sees 1 GPU(s)" in text, text
    assert "train.nproc" in text and "train.gpus_per_node" in text and "CUDA_VISIBLE_DEVICES=3" in text
    assert chosen == []  # stopped before CUDA was asked for a device (rank 0 too: nobody waits for rank 1)


def test_a_rank_with_a_gpu_of_its_own_takes_it(monkeypatch):
    chosen = _gpu_host(monkeypatch, 2)
    _ranks(monkeypatch, 0, local_world=1, world=1)  # one process: no process group to start
    d = distributed.setup()
    assert d.device == torch.device("cuda", 0) and chosen == [torch.device("cuda", 0)]


def test_the_workflow_config_asking_more_processes_than_gpus_per_node_is_refused():
    with pytest.raises(UserError) as err:
        checks.world_size(2, 4, 8)
    assert "train.nproc=8" in str(err.value) and "train.gpus_per_node=4" in str(err.value)
    assert checks.world_size(2, 8, 8) == 16
    assert checks.world_size(1, 0, 2) == 2  # gpus_per_node 0: a CPU run, any number of processes


def _plan_args(tmp_path, world: int) -> list[str]:
    return ["--total-updates", "8", "--pilot-fraction", "0.25", "--num-chunks", "1",
            *resolved_config(["model.path=/m", "tokens.train_cache=/t"]), "--export-weights", "raw",
            "--world-size", str(world), "--out-plan", str(tmp_path / "plan.json"),
            "--out-config", str(tmp_path / "train_config.yaml")]


def test_plan_refuses_a_local_run_with_more_processes_than_visible_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "gpus_found", lambda: (1, 80 * memory.GiB))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(UserError) as err:
        plan.main(_plan_args(tmp_path, world=2))
    text = str(err.value)
    assert "start 2 training processes" in text and "1 visible GPU(s), CUDA_VISIBLE_DEVICES=0" in text, text
    assert "train.nproc" in text and not (tmp_path / "plan.json").exists()
    assert plan.gpu_count_problem(1) is None and plan.gpu_count_problem(None) is None
    # Under SLURM the plan's job does not have the training job's GPUs: nothing to compare with here.
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    assert plan.gpu_count_problem(2) is None


def test_plan_on_a_machine_without_gpus_checks_no_device_count(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "gpus_found", lambda: (0, None))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert plan.main(_plan_args(tmp_path, world=2)) == 0  # CPU ranks (gloo): as many as asked
    assert json.loads((tmp_path / "plan.json").read_text())["total_updates"] == 8
