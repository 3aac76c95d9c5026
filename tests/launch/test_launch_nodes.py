"""Multi-node as configuration: the launcher's one-torchrun-per-node path, run as two agents on this
host (c10d rendezvous on localhost, one gloo process each), computes what one process and one 2-rank
process compute; a node that stops answering or never joins ends the stage within its timeout.

The same on two real (namespaced) nodes under SLURM: tests/slurm/test_slurm_pipeline.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kits.train import checkpoint_digests, make_run, pipeline_env, stage_names, step_losses

from pipeline.launch import torchrun
from pipeline.launch.run import _first_node_ended, _quiet_ranks
from pipeline.watch import node_line

pytestmark = pytest.mark.distributed


def _launcher(run, stage: str, init: str | None, *extra: str) -> list[str]:
    """A stage as the rule starts it with train.nodes=2: the launcher, which starts one agent per node."""
    log = run.root / "logs" / f"{stage}.log"
    args = ["--plan", run.plan, "--config", run.config, "--stage", stage, "--scratch", run.scratch(stage),
            "--out", run.stage_dir(stage)]
    if init:
        args += ["--init", run.stage_dir(init) / "checkpoint"]
    return [sys.executable, "-m", "pipeline.launch", "--log", str(log), "--train", "--nodes", "2", "--nproc", "1",
            *extra, "--", "-m", "pipeline", "train", *map(str, args)]


def _train_two_nodes(run, stage: str, init: str | None) -> None:
    proc = subprocess.run(_launcher(run, stage, init), env=pipeline_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr + (run.root / "logs" / f"{stage}.log").read_text()[-3000:]


def test_two_agents_with_c10d_equal_one_process_and_one_process_with_two_ranks(tiny, tmp_path):
    """With LoRA dropout on, each micro-batch's forward is seeded by its place in the update, not by
    the rank that runs it, so 1 and 2 ranks draw the same masks."""
    dropout = ["lora.dropout=0.05"]
    nodes = make_run(tmp_path / "nodes", tiny, total=9, fraction=0.25, chunks=2, overrides=dropout)
    names = stage_names(nodes)
    assert names == ["pilot", "chunk01", "chunk02", "tail"]
    prev = None
    for name in names:
        _train_two_nodes(nodes, name, prev)
        prev = name
    two = make_run(tmp_path / "two", tiny, total=9, fraction=0.25, chunks=2, single_stage=True, overrides=dropout)
    two.train("all", nproc=2)
    one = make_run(tmp_path / "one", tiny, total=9, fraction=0.25, chunks=2, single_stage=True, overrides=dropout)
    one.train("all")
    assert "dropout: 0.05" in one.config.read_text()
    final = checkpoint_digests(nodes.stage_dir(names[-1]) / "checkpoint")
    assert {"adapter/adapter_model.safetensors", "ema/0.9/adapter_model.safetensors",
            "training_state/optimizer.safetensors"} <= set(final)
    assert final == checkpoint_digests(two.stage_dir("all") / "checkpoint")
    assert final == checkpoint_digests(one.stage_dir("all") / "checkpoint")
    assert step_losses([nodes.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    state = nodes.stage_dir(names[-1]) / "checkpoint" / "training_state"
    assert (state / "rng_rank000.json").is_file() and (state / "rng_rank001.json").is_file()
    # Each node's first rank said where it runs, at the start of every stage.
    log = (nodes.root / "logs" / "pilot.log").read_text()
    for node in (0, 1):
        assert f"node rank {node} of 2: host " in log and f"(ranks {node}-{node}), rendezvous 127.0.0.1:" in log


def _rank_pid(root: Path, rank: int) -> int | None:
    """The training process of `rank` whose command names `root` (this test's run, no other)."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in cmdline and str(root).encode() in b" ".join(cmdline) and f"RANK={rank}".encode() in environ \
                and b"torch.distributed.run" not in b" ".join(cmdline):
            return int(entry.name)
    return None


def _step(metrics: Path) -> int:
    try:
        return max((json.loads(line).get("step", -1) for line in metrics.read_text().splitlines()), default=-1)
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def test_a_rank_that_stops_answering_fails_the_stage_within_the_collective_timeout_naming_it(tiny, tmp_path):
    """Rank 1 is frozen (SIGSTOP) mid-stage: rank 0 waits in the gradient all-reduce until
    distributed.timeout_s, then fails naming rank 1 and its node; the launcher ends the other
    agent (as srun --kill-on-bad-exit does) instead of waiting on it."""
    timeout_s = 10
    run = make_run(tmp_path / "run", tiny, total=40, fraction=0.5, chunks=1, single_stage=True,
                   overrides=[f"distributed.timeout_s={timeout_s}"])
    proc = subprocess.Popen(_launcher(run, "all", None), env=pipeline_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while _step(run.scratch("all") / "metrics.jsonl") < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = _rank_pid(run.root, 1)
        assert pid is not None and proc.poll() is None, "rank 1 never trained"
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=timeout_s + 120)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    # The timeout, the update in flight, the 5 s heartbeat check, the agents' exit.
    assert took < timeout_s + 45, (took, stderr)
    assert "rank 1 stopped answering" in stderr and "(node rank 1, address " in stderr, stderr
    assert f"Timed out waiting {timeout_s * 1000}ms" in stderr, stderr
    # Rank 0 saw it go quiet before the timeout (half of it): on GPUs, where NCCL's watchdog ends
    # the waiting rank without a Python error, this line is what names it.
    log = (run.root / "logs" / "all.log").read_text()
    assert "WARNING pipeline.distributed: node " in log and ": rank 1 stopped answering (no heartbeat for" in log
    assert _rank_pid(run.root, 1) is None  # the frozen rank was ended too


def test_a_node_that_never_joins_fails_the_stage_after_the_rendezvous_timeout(tiny, tmp_path):
    """Only the first of two agents starts (the second node never came up): it gives up after
    train.rdzv_timeout_s (torchrun's join_timeout) instead of torchrun's 600 s."""
    run = make_run(tmp_path / "run", tiny, total=4, fraction=0.5, chunks=1, single_stage=True)
    printed = subprocess.run([*_launcher(run, "all", None, "--rdzv-timeout", "5", "--print-command")],
                             env=pipeline_env(), capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(printed) == 2 and all("--rdzv-conf=join_timeout=5" in line for line in printed), printed
    t0 = time.monotonic()
    alone = subprocess.run(printed[0], shell=True, env=pipeline_env(), capture_output=True, text=True, timeout=300)
    assert alone.returncode != 0
    assert "RendezvousTimeoutError" in alone.stderr, alone.stderr[-3000:]
    assert time.monotonic() - t0 < 5 + 60


def test_the_node_line_names_host_address_node_rank_ranks_and_rendezvous():
    env = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2", "SFT_RDZV_ENDPOINT": "127.0.0.1:29400"}
    line = node_line(env)
    assert line.startswith("node rank 1 of 2: host ") and line.endswith(
        ", address 127.0.0.1, local ranks 0-1 (ranks 2-3), rendezvous 127.0.0.1:29400"), line
    assert node_line({**env, "LOCAL_RANK": "1"}) is None  # once per node
    assert node_line({"WORLD_SIZE": "1"}) is None  # one process: nothing to say


def test_the_failure_names_the_quiet_rank_and_the_first_node_srun_saw_end():
    log = ("INFO pipeline.distributed: node rank 1 of 2: host sft-n2, address 10.77.77.12, local ranks 0-0 ...\n"
           "INFO pipeline.distributed: node rank 0 of 2: host sft-n1, address 10.77.77.11, local ranks 0-0 ...\n"
           "2026-01-01 12:00:00,000 WARNING pipeline.distributed: node sft-n2 (node rank 1, address 10.77.77.12): "
           "rank 1 stopped answering (no heartbeat for 60 s)\n"
           "srun: error: sft-n1: task 0: Aborted\nsrun: error: sft-n2: task 1: Killed\n")
    assert _quiet_ranks(log) == [
        "node sft-n2 (node rank 1, address 10.77.77.12): rank 1 stopped answering (no heartbeat for 60 s)"]
    assert _first_node_ended(log) == [
        "srun: the first task to end was task 0 on node sft-n1 (node rank 0, address 10.77.77.11): Aborted"]
    assert _first_node_ended("no srun here") == [] and _quiet_ranks("nor here") == []


def test_the_ranks_get_the_rendezvous_endpoint_and_the_socket_interface_unless_the_user_set_it():
    topo = torchrun.Topology(nodes=2, nproc=8, endpoint="node1:29400")
    assert torchrun.network_env(topo, "ib0", {}) == {
        "SFT_RDZV_ENDPOINT": "node1:29400", "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    assert torchrun.network_env(topo, "ib0", {"NCCL_SOCKET_IFNAME": "^lo"}) == {
        "SFT_RDZV_ENDPOINT": "node1:29400", "GLOO_SOCKET_IFNAME": "ib0"}
    assert torchrun.network_env(topo, None, {}) == {"SFT_RDZV_ENDPOINT": "node1:29400"}


def test_stopping_the_heartbeat_waits_for_its_thread_to_leave_the_store():
    """A rank's exit must not find the heartbeat thread inside a store call (a C++ abort at exit): stop()
    returns only once the thread has ended, here while a beat is held in the store for 0.5 s."""
    import threading

    import torch

    from pipeline import distributed
    from pipeline.watch import Heartbeat

    entered = threading.Event()

    class SlowStore:
        def add(self, key, amount):
            entered.set()
            time.sleep(0.5)
            return 1

    beat = Heartbeat(distributed.Dist(rank=1, world_size=2, local_rank=1, device=torch.device("cpu")), SlowStore(), 5.0)
    beat.HEARTBEAT_S = 0.01
    beat._thread.start()
    assert entered.wait(5)
    beat.stop()
    assert not beat._thread.is_alive()
