"""The run's data order and the micro-batches of each update.

Data order is a pure function of (seed, global update index): the sample at
global position g is permutation(epoch = g // N)[g % N], each epoch with its own
seeded permutation. A stage that starts at update s therefore reads exactly the
samples a one-process run would read at s, and the sampler's whole state is the
update index (saved in progress.json), with nothing to drift.

Making a batch can be slow (a vision-language batch decodes its images into
pixels): `TrainBatches.prefetch` then runs the batches of the coming updates in
DataLoader worker processes, ahead of the loop. What a batch holds is still a
pure function of its update index; the workers only change when it is made.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from pipeline.data.cache import IGNORE_INDEX
from pipeline.model.loss import Collator


class RunSampler:
    """Sample indices of every update of the run (see the module docstring)."""

    def __init__(self, num_samples: int, global_batch: int, seed: int):
        if num_samples < 1:
            raise ValueError("the training set is empty")
        self.n = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).numpy()}  # keep one epoch cached
        return self._perms[epoch]

    def global_indices(self, step: int) -> list[int]:
        """The `global_batch` sample indices of update `step`, all ranks together."""
        out = []
        for g in range(step * self.global_batch, (step + 1) * self.global_batch):
            out.append(int(self._perm(g // self.n)[g % self.n]))
        return out

    def rank_micro_batches(self, step: int, rank: int, world: int, micro: int) -> list[list[int]]:
        """This rank's share of update `step`, split into micro-batches."""
        idx = self.global_indices(step)
        per_rank = len(idx) // world
        mine = idx[rank * per_rank:(rank + 1) * per_rank]
        return [mine[i:i + micro] for i in range(0, len(mine), micro)]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.n


def supervised_counts(cache) -> np.ndarray:
    """Per sample: tokens that carry a loss (label of the *next* position is set)."""
    return np.array([int((cache[i][1][1:] != IGNORE_INDEX).sum()) for i in range(len(cache))], dtype=np.int64)


class TrainBatches:
    """The training data as the update loop sees it: this rank's micro-batches of any update.

    `supervised(step)` counts the supervised tokens of the update's whole
    global batch from the cache's labels: every rank gets the same number
    without communicating, and the loss is normalized by it.
    """

    def __init__(self, collate: Collator, *, global_batch: int, micro_batch: int, seed: int, rank: int, world: int,
                 workers: int = 0):
        """`workers`: DataLoader processes for `prefetch` (0: every batch is made when asked for)."""
        self.workers = workers
        self.sampler = RunSampler(len(collate.cache), global_batch, seed)
        self.counts = supervised_counts(collate.cache)
        self._updates = _Updates(collate, self.sampler, rank=rank, world=world, micro=micro_batch)
        self._ahead = None  # iterator of (step, micro-batches) from the workers

    def prefetch(self, start: int, end: int) -> None:
        """Make the batches of updates [start, end) in the worker processes, in order, ahead of use.

        The loader gets a generator of its own: creating its iterator draws a
        seed, which must not come from (and shift) the run's global RNG stream.
        """
        if not self.workers or start >= end:
            return
        loader = torch.utils.data.DataLoader(self._updates, batch_size=None, sampler=range(start, end),
                                             num_workers=self.workers, prefetch_factor=2, worker_init_fn=_worker_init,
                                             generator=torch.Generator().manual_seed(0))
        self._ahead = iter(loader)

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's share of update `step`, as collated CPU batches (prefetched ones in order)."""
        if self._ahead is None:
            return self.make(step)
        made, batches = next(self._ahead)
        if made != step:
            raise RuntimeError(f"prefetched update {made} arrived for update {step}: the loop skipped an update")
        return batches

    def make(self, step: int) -> list[dict[str, torch.Tensor]]:
        return self._updates[step][1]

    def supervised(self, step: int) -> int:
        return int(self.counts[self.sampler.global_indices(step)].sum())

    def epoch_of(self, step: int) -> float:
        return self.sampler.epoch_of(step)


def _worker_init(_: int) -> None:
    # SLURM and Snakemake signal the whole process group (SIGTERM / SIGUSR1) to preempt. The
    # loop acts on that at the next step boundary: it saves, then exits with the retry code;
    # a worker killed by the same signal would crash the loop before that. Out of the group,
    # a worker keeps making batches until the loop's loader stops it (or its parent is gone).
    os.setpgid(0, 0)


class _Updates(torch.utils.data.Dataset):
    """Update index -> (index, that update's micro-batches of this rank): what a worker makes.

    Holds no reference to the loader that runs it, so the loader is freed (and its
    workers stopped) as soon as the loop drops it.
    """

    def __init__(self, collate: Collator, sampler: RunSampler, *, rank: int, world: int, micro: int):
        self.collate, self.sampler = collate, sampler
        self.rank, self.world, self.micro = rank, world, micro

    def __getitem__(self, step: int):
        micro_batches = self.sampler.rank_micro_batches(step, self.rank, self.world, self.micro)
        return step, [self.collate(mb) for mb in micro_batches]
