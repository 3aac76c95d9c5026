"""The training data as the update loop sees it: this rank's micro-batches of any update.

Which records an update trains on is the run's order (`pipeline.planning.order`,
a pure function of (seed, update)); how they become micro-batches is a pure
function of the update too: packed rows (`pipeline.planning.packing`, the
default for text models) or padded micro-batches of `optim.micro_batch` records
(grouped by length). So a stage that starts at update s makes exactly the
micro-batches a one-process run makes at s, and the whole data state is the
update index.

Making a batch can be slow (a vision-language batch decodes its images into
pixels): `TrainBatches.prefetch` then runs the batches of the coming updates in
DataLoader worker processes, ahead of the loop. What a batch holds is still a
pure function of its update index; the workers only change when it is made.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from pipeline.data.mix import Mix
from pipeline.model.batch import Batch, Collator
from pipeline.planning.order import RunSampler
from pipeline.planning.packing import pack_update, row_capacity


def supervised_counts(cache) -> np.ndarray:
    """Per sample: tokens that carry a loss (label of the *next* position is set); from the cache's arrays."""
    return cache.supervised_counts()


class TrainBatches:
    """The training data as the update loop sees it: this rank's micro-batches of any update.

    `supervised(step)` counts the supervised tokens of the update's whole
    global batch from the cache's labels: every rank gets the same number
    without communicating, and the loss is normalized by it; `tokens(step)`
    its tokens (padding not included), the same way. `collator` makes the
    micro-batches (`pipeline.model.batch.Collator`: padded micro-batches, and a
    vision-language model's pixels; or packed rows when its layout is packed,
    `pipeline.planning.packing.pack_update` then cutting each update into them).
    """

    def __init__(self, collator: Collator, *, global_batch: int, micro_batch: int, seed: int, rank: int, world: int,
                 group_by_length: bool = False, workers: int = 0, mix: Mix | None = None):
        """`workers`: DataLoader processes for `prefetch` (0: every batch is made when asked for).
        `mix`: several datasets (the collator's cache is then their `ConcatCache`)."""
        cache = collator.cache
        self.workers = workers
        self.sampler = RunSampler(len(cache), global_batch, seed, cache.lengths if group_by_length else None, mix)
        self.counts = supervised_counts(cache)
        self.lengths = cache.lengths
        self.capacity = row_capacity(self.lengths)  # packed rows: tokens per row at most
        self._updates = _Updates(collator, self.sampler, self.lengths, rank=rank, world=world, micro=micro_batch,
                                 capacity=self.capacity)
        self._ahead = None  # iterator of (step, micro-batches) from the workers
        self.seed, self.rank, self.world = seed, rank, world

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

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's share of update `step`, as collated CPU batches (prefetched ones in order)."""
        if self._ahead is None:
            return self.make(step)
        made, batches = next(self._ahead)
        if made != step:
            raise RuntimeError(f"prefetched update {made} arrived for update {step}: the loop skipped an update")
        return batches

    def make(self, step: int) -> list[Batch]:
        """This rank's share of update `step`, made now in this process."""
        return self._updates[step][1]

    def forward_seeds(self, step: int, count: int) -> list[int]:
        """A seed for the forward pass of each of this rank's `count` micro-batches of update
        `step`: a function of the run's seed, the update and the micro-batch's place in the
        update, not of which rank runs it. Seeded with it, a forward's random draws (LoRA
        dropout) are those of the same micro-batch on any number of ranks, so a 2-rank run
        computes what one process computes. Packed micro-batches are dealt as grouped padded
        ones are (`pipeline.planning.packing.pack_update`): micro-batch rank + i x world."""
        if self._updates.collator.packed:
            places = [self.rank + i * self.world for i in range(count)]
        else:
            places = self.sampler.micro_batch_places(self.rank, self.world, count)
        return [int(np.random.SeedSequence([self.seed, step, place]).generate_state(1, np.uint64)[0] >> 1)
                for place in places]

    def supervised(self, step: int) -> int:
        return int(self.counts[self.sampler.global_indices(step)].sum())

    def tokens(self, step: int) -> int:
        return int(self.lengths[self.sampler.global_indices(step)].sum())

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

    def __init__(self, collator: Collator, sampler: RunSampler, lengths: np.ndarray, *, rank: int, world: int,
                 micro: int, capacity: int):
        self.collator, self.sampler, self.lengths = collator, sampler, lengths
        self.rank, self.world, self.micro, self.capacity = rank, world, micro, capacity

    def micro_batches(self, step: int) -> list:
        """This rank's micro-batches of update `step` as record indices (packed: rows of them)."""
        if not self.collator.packed:
            return self.sampler.rank_micro_batches(step, self.rank, self.world, self.micro)
        # Every rank packs the whole update (a few hundred records at most) and keeps its share.
        return pack_update(self.sampler.global_indices(step), self.lengths, capacity=self.capacity,
                           world=self.world, micro=self.micro)[self.rank]

    def __getitem__(self, step: int):
        return step, [self.collator(mb) for mb in self.micro_batches(step)]
