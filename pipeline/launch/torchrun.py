"""The command lines of a training stage: one process, torchrun on one node, or one torchrun per node.

    nodes 1, 1 process      python -m pipeline train ...   (torchrun would add seconds of start-up and nothing else)
    nodes 1, N processes    torchrun --standalone --nproc-per-node N -m pipeline train ...
    nodes M (SLURM)         srun --nodes M --ntasks-per-node 1  torchrun --nnodes M --nproc-per-node N
                                 --rdzv-backend c10d --rdzv-endpoint <first node>:<port> --rdzv-id <job id> ...
    nodes M (no SLURM)      the same M agents on this machine, rendezvous on localhost: how the
                            multi-node path is tested without a cluster

Under SLURM with one node and several processes the c10d form is used too, on
the job's node: the same path as M nodes, with M = 1.

Each remote agent starts with SIGUSR1 ignored (`trap "" USR1; exec ...`): srun
and SLURM's `--signal` deliver USR1 to every process of the step, and torchrun
would die of it (default action) before its ranks finish the checkpoint USR1
asks for. The ranks install their own handler.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
_IGNORE_USR1 = 'trap "" USR1; exec "$@"'


@dataclass(frozen=True)
class Topology:
    nodes: int
    nproc: int  # processes per node
    endpoint: str | None  # c10d rendezvous host:port; None = --standalone
    rdzv_id: str = "sft"


def processes(nproc: str, devices: list[str] | None) -> int:
    """Processes per node: `auto` is one per device the job holds (1 without GPUs)."""
    if nproc == "auto":
        return max(1, len(devices or []))
    n = int(nproc)
    if n < 1:
        raise SystemExit(f"pipeline.launch: --nproc must be auto or >= 1, not {nproc}")
    return n


def in_slurm() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def topology(nodes: int, nproc: int, endpoint: str | None = None) -> Topology:
    """Where the ranks run and meet. Under SLURM: on the allocation's nodes, rendezvous on the first."""
    if in_slurm():
        allocated = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        if allocated != nodes:
            raise SystemExit(f"pipeline.launch: train.nodes={nodes} but the SLURM job has {allocated} node(s); "
                             "check the rule's resources (nodes) in the profiles")
        job = os.environ["SLURM_JOB_ID"]
        if endpoint is None and (nodes > 1 or nproc > 1):
            endpoint = f"{_first_node()}:{20000 + int(job) % 20000}"
        return Topology(nodes, nproc, endpoint, rdzv_id=f"sft-{job}")
    if nodes > 1 and endpoint is None:
        endpoint = f"127.0.0.1:{_free_port()}"
    return Topology(nodes, nproc, endpoint, rdzv_id=f"sft-{os.getpid()}")


def commands(module_args: list[str], topo: Topology) -> list[list[str]]:
    """The processes to start for a stage (`module_args`: what follows `python`, `-m pipeline train ...`)."""
    if topo.nodes == 1 and topo.nproc == 1:
        return [[sys.executable, *module_args]]
    if topo.endpoint is None:
        return [[*TORCHRUN, "--standalone", f"--nproc-per-node={topo.nproc}", *module_args]]
    agent = [*TORCHRUN, f"--nnodes={topo.nodes}", f"--nproc-per-node={topo.nproc}", "--rdzv-backend=c10d",
             f"--rdzv-endpoint={topo.endpoint}", f"--rdzv-id={topo.rdzv_id}", *module_args]
    if not in_slurm():
        return [agent] * topo.nodes  # every "node" on this machine
    if topo.nodes == 1:
        return [agent]
    # One agent per node. --kill-on-bad-exit: a node that fails takes the others down with it
    # instead of leaving them waiting in a collective until the timeout.
    srun = ["srun", f"--nodes={topo.nodes}", f"--ntasks={topo.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1"]
    return [[*srun, "bash", "-c", _IGNORE_USR1, "agent", *agent]]


def _first_node() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
