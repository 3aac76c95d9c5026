"""The run's data order: which records every update trains on, and how a padded update is cut.

Data order is a pure function of (seed, global update index): the sample at
global position g is permutation(epoch = g // N)[g % N], each epoch with its own
seeded permutation. A stage that starts at update s therefore reads exactly the
samples a one-process run would read at s, and the sampler's whole state is the
update index (saved in progress.json), with nothing to drift. Several datasets
(`tokens.mix`) replace the permutations by a `pipeline.data.mix.Mix` over their
concatenation: position g is again a pure function of (seed, g), with the
mixed epoch in place of the dataset's.

How an update's records become micro-batches is a pure function of the update
too: packed rows (`pipeline.planning.packing`, the default for text models), or
padded micro-batches of a fixed record count (`RunSampler.rank_micro_batches`).

Length grouping (`tokens.group_by_length`, padded micro-batches): an update's
global batch is the same set of samples either way, only cut differently into
micro-batches. Sorted by length (longest first; ties by position in the batch,
so the order is a pure function of the update too), it is cut into
micro-batches of similar lengths, dealt to the ranks in turn (micro-batch j to
rank j % world), so every rank gets a share of long and short ones and each
rank's first micro-batch is its longest (an out-of-memory shows at once).
Padding shrinks to what differs within a micro-batch; the update's gradient is
the same sum in another order.

Here, below the trainer, so that the plan computes the same order the stages
train on (its padding report). Imports no torch until a permutation is drawn.
"""

from __future__ import annotations

import numpy as np

from pipeline.data.mix import Mix


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
            import torch  # the permutations are torch's: the order every run so far has trained on

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
        """This rank's share of update `step`, split into padded micro-batches of `micro` records."""
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
