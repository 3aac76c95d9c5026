"""Micro-batches: length grouping is a pure function of (seed, update) that only re-cuts each
update's batch, cuts padding, and splits it evenly over ranks; packed rows keep sequences apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.cache import IGNORE_INDEX, TokenCache
from pipeline.model.batch import Collator, collate
from pipeline.planning.order import RunSampler, padding_fraction
from pipeline.train.batches import TrainBatches


@pytest.fixture(scope="module")
def cache(tiny):
    return TokenCache(tiny["train"])


@pytest.mark.parametrize("world", [1, 2])
def test_grouping_recuts_each_update_and_is_a_pure_function_of_the_update(cache, world):
    grouped = RunSampler(len(cache), 16, seed=3, lengths=cache.lengths)
    plain = RunSampler(len(cache), 16, seed=3)
    for step in (0, 1, 7, 40):  # 40: a later epoch
        shares = [grouped.rank_micro_batches(step, r, world, 4) for r in range(world)]
        assert sorted(i for share in shares for mb in share for i in mb) == sorted(plain.global_indices(step))
        assert all(len(share) == 16 // (4 * world) for share in shares)  # same accumulation on every rank
        for share in shares:  # each rank's micro-batches, longest first
            longest = [max(cache.lengths[mb]) for mb in share]
            assert longest == sorted(longest, reverse=True)
        fresh = RunSampler(len(cache), 16, seed=3, lengths=cache.lengths)  # a resumed stage's sampler
        assert [fresh.rank_micro_batches(step, r, world, 4) for r in range(world)] == shares


def test_grouping_cuts_the_padding(cache):
    steps = range(0, 30)
    plain = padding_fraction(RunSampler(len(cache), 16, seed=0), cache.lengths, steps, micro=4)
    grouped = padding_fraction(RunSampler(len(cache), 16, seed=0, lengths=cache.lengths), cache.lengths, steps,
                               micro=4)
    assert grouped < 0.5 * plain


def test_token_counts_come_from_the_cache_without_collating(cache, tiny):
    kw = dict(global_batch=8, micro_batch=2, seed=0, world=2, group_by_length=True)
    ranks = [TrainBatches(Collator(cache, pad_id=0), rank=r, **kw) for r in range(2)]
    for step in range(5):
        batches = [b for data in ranks for b in data.micro_batches(step)]
        assert ranks[0].tokens(step) == sum(b.tokens for b in batches)
        assert ranks[0].supervised(step) == ranks[1].supervised(step) == sum(b.supervised for b in batches)


def test_packed_row_positions_restart_and_targets_stay_within_each_sequence(cache):
    idx = [4, 11, 23]
    packed = collate(cache, idx, pad_id=0, packed=True)
    ids, pos = packed.inputs["input_ids"][0], packed.inputs["position_ids"][0]
    starts, offset = [], 0
    for i in idx:
        tokens, labels = cache[i]
        n = len(tokens)
        assert torch.equal(ids[offset:offset + n], tokens) and torch.equal(pos[offset:offset + n], torch.arange(n))
        starts.append(offset)
        offset += n
    # a position predicts the next token of its own sequence: never the last position of a sequence
    ends = {s + len(cache[i][0]) - 1 for s, i in zip(starts, idx)}
    assert not ends & set(packed.loss_index.tolist())
    assert torch.equal(packed.targets, ids[packed.loss_index + 1])
    assert packed.supervised == sum(int((cache[i][1][1:] != IGNORE_INDEX).sum()) for i in idx)
    # flash-attention's varlen boundaries, given rather than found on the device
    assert packed.inputs["cu_seq_lens_q"].tolist() == [*starts, offset]
    assert packed.inputs["max_length_q"] == max(len(cache[i][0]) for i in idx)


def test_a_micro_batch_without_padding_has_no_attention_mask(cache):
    lengths = cache.lengths
    same = [int(i) for i in np.flatnonzero(lengths == np.bincount(lengths).argmax())[:3]]
    assert "attention_mask" not in collate(cache, same, pad_id=0).inputs  # SDPA may take its causal fast path
    mixed = [int(np.argmin(lengths)), int(np.argmax(lengths))]
    assert "attention_mask" in collate(cache, mixed, pad_id=0).inputs
