"""The command lines of a training stage: one process, torchrun on one node, or one torchrun per node.

    nodes 1, 1 process      python -m pipeline train ...   (torchrun would add seconds of start-up and nothing else)
    nodes 1, N processes    torchrun --standalone --nproc-per-node N -m pipeline train ...
    nodes M (SLURM)         srun --nodes M --ntasks-per-node 1 [--gpus-per-node G]
                                 torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d
                                 --rdzv-endpoint <first node>:<port> --rdzv-id <job id>
                                 --rdzv-conf join_timeout=<s> ...
    nodes M (no SLURM)      the same M agents on this machine, rendezvous on localhost: how the
                            multi-node path is tested without a cluster

Under SLURM with one node and several processes the c10d form is used too, on
the job's node: the same path as M nodes, with M = 1.

The allocation (its node count and hosts) is asked of slurmctld (`scontrol show
job`) when the job's SLURM_* variables are gone: Snakemake's slurm-jobstep
executor runs the rule's command with every SLURM_* variable but the job id
removed, so that a nested srun does not inherit the batch step's settings.

Each remote agent starts with SIGUSR1 ignored (`trap "" USR1; exec ...`): srun
and SLURM's `--signal` deliver USR1 to every process of the step, and torchrun
would die of it (default action) before its ranks finish the checkpoint USR1
asks for. The ranks install their own handler.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

from pipeline.layout import RDZV_ENDPOINT_ENV

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
_IGNORE_USR1 = 'trap "" USR1; exec "$@"'
# The network interface the ranks' collectives use: NCCL's and gloo's own variables.
SOCKET_IFNAME_ENVS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
PORT_BASE, PORT_SPAN = 20000, 20000  # the default rendezvous port: PORT_BASE + job id % PORT_SPAN


@dataclass(frozen=True)
class Topology:
    nodes: int
    nproc: int  # processes per node
    endpoint: str | None  # c10d rendezvous host:port; None = --standalone
    rdzv_id: str = "sft"
    gpus_per_node: int = 0  # GPUs of each node's step (srun --gpus-per-node); 0: what SLURM gives it
    join_timeout_s: int | None = None  # how long the agents wait for every node to join (None: torchrun's 600 s)


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


def topology(nodes: int, nproc: int, endpoint: str | None = None, *, port: int | None = None,
             gpus_per_node: int = 0, join_timeout_s: int | None = None) -> Topology:
    """Where the ranks run and meet. Under SLURM: on the allocation's nodes, rendezvous on the first,
    on `port` (default: derived from the job id, so two jobs on one node do not meet)."""
    if in_slurm():
        job = os.environ["SLURM_JOB_ID"]
        allocated, hosts = allocation(job)
        if allocated != nodes:
            raise SystemExit(f"pipeline.launch: train.nodes={nodes} but the SLURM job has {allocated} node(s); "
                             "check the rule's resources (nodes) in the profiles")
        if endpoint is None and (nodes > 1 or nproc > 1):
            endpoint = f"{hosts[0]}:{port or PORT_BASE + int(job) % PORT_SPAN}"
        return Topology(nodes, nproc, endpoint, f"sft-{job}", gpus_per_node, join_timeout_s)
    if nodes > 1 and endpoint is None:
        endpoint = f"127.0.0.1:{port or _free_port()}"
    return Topology(nodes, nproc, endpoint, f"sft-{os.getpid()}", gpus_per_node, join_timeout_s)


def commands(module_args: list[str], topo: Topology) -> list[list[str]]:
    """The processes to start for a stage (`module_args`: what follows `python`, `-m pipeline train ...`)."""
    if topo.nodes == 1 and topo.nproc == 1:
        return [[sys.executable, *module_args]]
    if topo.endpoint is None:
        return [[*TORCHRUN, "--standalone", f"--nproc-per-node={topo.nproc}", *module_args]]
    agent = [*TORCHRUN, f"--nnodes={topo.nodes}", f"--nproc-per-node={topo.nproc}", "--rdzv-backend=c10d",
             f"--rdzv-endpoint={topo.endpoint}", f"--rdzv-id={topo.rdzv_id}"]
    if topo.join_timeout_s is not None:
        agent.append(f"--rdzv-conf=join_timeout={topo.join_timeout_s}")
    agent += module_args
    if not in_slurm():
        return [agent] * topo.nodes  # every "node" on this machine
    if topo.nodes == 1:
        return [agent]
    # One agent per node. --kill-on-bad-exit: a node that fails takes the others down with it
    # instead of leaving them waiting in a collective until the timeout.
    srun = ["srun", f"--nodes={topo.nodes}", f"--ntasks={topo.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1"]
    if topo.gpus_per_node:  # the step's GPUs on each node, whatever the job step would inherit
        srun.append(f"--gpus-per-node={topo.gpus_per_node}")
    return [[*srun, "bash", "-c", _IGNORE_USR1, "agent", *agent]]


def network_env(topo: Topology, socket_ifname: str | None, env: dict[str, str]) -> dict[str, str]:
    """What the ranks' environment adds: the rendezvous endpoint (for their start lines) and, when
    given, the interface NCCL and gloo open their sockets on (a variable the user set wins)."""
    out = {RDZV_ENDPOINT_ENV: topo.endpoint} if topo.endpoint else {}
    if socket_ifname:
        out.update({name: socket_ifname for name in SOCKET_IFNAME_ENVS if not env.get(name)})
    return out


def allocation(job: str) -> tuple[int, list[str]]:
    """(node count, hostnames in order) of SLURM job `job`: from its SLURM_* variables when the
    command still has them, else from slurmctld."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
        fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout))
        nodelist = fields.get("NodeList", "")
        if out.returncode != 0 or nodelist in ("", "(null)"):
            raise SystemExit(f"pipeline.launch: cannot read the nodes of SLURM job {job} "
                             f"(scontrol show job: {out.stderr.strip() or out.stdout.strip() or 'no NodeList'})")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    hosts = out.stdout.split()
    return len(hosts), hosts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
