"""The run's data order and batch assembly.

Data order is a pure function of (seed, global update index): the sample at
global position g is permutation(epoch = g // N)[g % N], each epoch with its own
seeded permutation. A stage that starts at update s therefore reads exactly the
samples a one-process run would read at s, and the sampler's whole state is the
update index (saved in progress.json), with nothing to drift.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE = -100


class RunSampler:
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
    return np.array([int((cache[i][1][1:] != IGNORE).sum()) for i in range(len(cache))], dtype=np.int64)


def collate(cache, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (IGNORE on padding)."""
    items = [cache[i] for i in indices]
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(items):
        input_ids[row, :len(ids)] = ids
        labels[row, :len(lab)] = lab
        mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over supervised positions, computed in fp32."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
    )
