"""Process-group setup under torchrun, the few collective helpers the stages need, preemption.

One process without torchrun (or torchrun with one process) runs with no process
group at all, so the CPU default pays nothing for distribution.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(backend: str = "auto", timeout_s: int = 1800) -> Dist:
    """Read torchrun's environment, pick the device, init the process group if needed.

    `timeout_s` bounds every collective (gloo: each operation; NCCL: its watchdog aborts the
    process group): a rank whose peer stopped answering fails after it instead of waiting forever.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        _check_gpu_count(local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return Dist(rank, local_rank, world, device)


def _check_gpu_count(local_rank: int) -> None:
    """Every process of this node must have a GPU of its own, or CUDA fails with "invalid device ordinal".

    Checked on every rank against the node's process count (LOCAL_WORLD_SIZE,
    set by torchrun), not only on the ranks left without a GPU: all ranks stop
    here together, before any of them waits in the process group for the others.
    """
    count = torch.cuda.device_count()
    local_world = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), local_rank + 1)
    if local_world <= count:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible})"
    raise UserError(
        f"this node starts {local_world} training processes but CUDA sees {count} GPU(s) here{shown}: "
        f"one process per GPU. Set train.nproc to at most {count} (or auto: one per GPU), and train.gpus_per_node "
        "to the GPUs each of train.nodes has; to train on the CPU instead, hide the GPUs (CUDA_VISIBLE_DEVICES=)")


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def any_rank(d: Dist, flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (so all ranks act together)."""
    if not d.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(d: Dist, obj):
    """Every rank's `obj`, on every rank (small objects only: RNG states, checksums)."""
    if not d.enabled:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(d: Dist, obj):
    """Rank 0's `obj` on every rank (small objects: a path, a verdict)."""
    if not d.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


CHECKSUM_CHUNK = 2**20  # elements cast to float64 at a time: an 8 MiB temporary, whatever the tensor's size


@torch.no_grad()
def checksum(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[sum, sum of |x|] of `params` in float64, on `device`, without a float64 copy of any of them.

    Each tensor is summed in chunks of `CHECKSUM_CHUNK` elements, each cast to
    float64 on its own (`sum(dtype=float64)` would cast the whole tensor first):
    an 8B-parameter model would otherwise need 64 GB of float64 copies. The
    order of the sums is fixed by the shapes, so equal tensors give equal sums.
    The result stays on the device: no host sync per tensor.
    """
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for p in params:
        for chunk in p.detach().reshape(-1).split(CHECKSUM_CHUNK):
            wide = chunk.double()
            total[0] += wide.sum()
            total[1] += wide.abs().sum()
    return total


def check_consistent(d: Dist, params: list[torch.Tensor], what: str) -> None:
    """Fail if ranks hold different weights: a float64 checksum per rank (`checksum`)."""
    if not d.enabled:
        return
    local = checksum(params, params[0].device if params else torch.device("cpu")).tolist()
    sums = gather_objects(d, local)
    if any(s != sums[0] for s in sums):
        raise RuntimeError(f"ranks disagree on the {what} (per-rank checksums {sums})")


def all_reduce_sum(d: Dist, t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks in place (nothing to do with one process); returns it."""
    if d.enabled:
        dist.all_reduce(t)
    return t


def plain(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor result (the total grad norm under FSDP): a collective then."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def print0(d: Dist, *args) -> None:
    """Print on rank 0 only (all other output goes through logging)."""
    if d.is_main:
        print(*args, flush=True)


class Preemption:
    """SIGTERM / SIGUSR1 set a flag; the loop acts on it at the next step boundary.

    SLURM sends them before a time limit or a preemption (`--signal`), Snakemake
    and torchrun pass TERM on. `requested()` is collective: every rank learns
    whether any rank was signalled, so all of them save and exit together. After
    an update the ranks have agreed already, in the update's own all-reduce
    (`pipeline.train.update`), and pass that verdict: no collective then.
    """

    def __init__(self, d: Dist):
        self.d = d
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
        log.warning("received %s: will checkpoint and exit at the next step boundary", signal.Signals(signum).name)

    @property
    def flagged(self) -> bool:
        """This rank was signalled (not collective)."""
        return self.signal is not None

    def requested(self, agreed: bool | None = None) -> bool:
        """Was any rank signalled? `agreed`: the ranks' verdict exchanged already (a signal that
        came after that exchange is acted on at the next one); one process reads its own flag."""
        if agreed is not None and self.d.enabled:
            return agreed
        return any_rank(self.d, self.flagged)
