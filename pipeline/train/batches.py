"""The run's data order and the micro-batches of each update.

Data order is a pure function of (seed, global update index): the sample at
global position g is permutation(epoch = g // N)[g % N], each epoch with its own
seeded permutation. A stage that starts at update s therefore reads exactly the
samples a one-process run would read at s, and the sampler's whole state is the
update index (saved in progress.json), with nothing to drift. Several datasets
(`tokens.mix`) replace the permutations by a `pipeline.data.mix.Mix` over their
concatenation: position g is again a pure function of (seed, g), with the
mixed epoch in place of the dataset's.

Length grouping (`tokens.group_by_length`): an update's global batch is the same
set of samples either way, only cut differently into micro-batches. Sorted by
length (longest first; ties by position in the batch, so the order is a pure
function of the update too), it is cut into micro-batches of similar lengths,
dealt to the ranks in turn (micro-batch j to rank j % world), so every rank
gets a share of long and short ones and each rank's first micro-batch is its
longest (an out-of-memory shows at once). Padding shrinks to what differs
within a micro-batch; the update's gradient is the same sum in another order.

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
from pipeline.model.loss import Batch, Collator


class RunSampler:
    """Sample indices of every update of the run (see the module docstring).

    `lengths` (tokens per sample) turns on length grouping; None keeps each
    rank's micro-batches in sampling order. `mix`: the order of a mixed run
    (its indices address the concatenated caches, `num_samples` of them).
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int, lengths: np.ndarray | None = None,
                 mix: Mix | None = None):
        if num_samples < 1:
            raise ValueError("the training set is empty")
        self.n = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.lengths = lengths
        self.mix = mix
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).numpy()}  # keep one epoch cached
        return self._perms[epoch]

    def global_indices(self, step: int) -> list[int]:
        """The `global_batch` sample indices of update `step`, all ranks together."""
        if self.mix is not None:
            return self.mix.indices(step * self.global_batch, (step + 1) * self.global_batch)
        out = []
        for g in range(step * self.global_batch, (step + 1) * self.global_batch):
            out.append(int(self._perm(g // self.n)[g % self.n]))
        return out

    def rank_micro_batches(self, step: int, rank: int, world: int, micro: int) -> list[list[int]]:
        """This rank's share of update `step`, split into micro-batches."""
        idx = self.global_indices(step)
        if self.lengths is not None:
            # Stable sort: equal lengths keep their sampled order.
            by_length = sorted(idx, key=lambda i: -int(self.lengths[i]))
            cut = [by_length[i:i + micro] for i in range(0, len(by_length), micro)]
            return cut[rank::world]
        per_rank = len(idx) // world
        mine = idx[rank * per_rank:(rank + 1) * per_rank]
        return [mine[i:i + micro] for i in range(0, len(mine), micro)]

    def micro_batch_places(self, rank: int, world: int, count: int) -> list[int]:
        """Where each of this rank's `count` micro-batches of an update sits among the update's
        micro-batches (all ranks, in the order one process would run them), as
        `rank_micro_batches` deals them."""
        if self.lengths is not None:
            return [rank + i * world for i in range(count)]
        return [rank * count + i for i in range(count)]

    def epoch_of(self, step: int) -> float:
        """Epochs done before update `step` (a mixed run's: mixed epochs)."""
        return step * self.global_batch / (self.mix.size if self.mix is not None else self.n)


def supervised_counts(cache) -> np.ndarray:
    """Per sample: tokens that carry a loss (label of the *next* position is set); from the cache's arrays."""
    return cache.supervised_counts()


def padding_fraction(sampler: RunSampler, lengths: np.ndarray, steps: range, *, micro: int, world: int = 1) -> float:
    """Padding tokens / tokens computed, over the padded micro-batches of `steps` (all ranks)."""
    real = padded = 0
    for step in steps:
        for rank in range(world):
            for mb in sampler.rank_micro_batches(step, rank, world, micro):
                lens = lengths[mb]
                real += int(lens.sum())
                padded += int(lens.max()) * len(mb)
    return 1.0 - real / max(padded, 1)


class TrainBatches:
    """The training data as the update loop sees it: this rank's micro-batches of any update.

    `supervised(step)` counts the supervised tokens of the update's whole
    global batch from the cache's labels: every rank gets the same number
    without communicating, and the loss is normalized by it; `tokens(step)`
    its tokens (padding not included), the same way. `collator` makes the
    micro-batches (`pipeline.model.loss.Collator`: padded or packed rows, and
    a vision-language model's pixels).
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
        self._updates = _Updates(collator, self.sampler, rank=rank, world=world, micro=micro_batch)
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
        computes what one process computes."""
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

    def __init__(self, collator: Collator, sampler: RunSampler, *, rank: int, world: int, micro: int):
        self.collator, self.sampler = collator, sampler
        self.rank, self.world, self.micro = rank, world, micro

    def __getitem__(self, step: int):
        micro_batches = self.sampler.rank_micro_batches(step, self.rank, self.world, self.micro)
        return step, [self.collator(mb) for mb in micro_batches]
