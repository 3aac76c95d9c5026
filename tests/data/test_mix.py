"""The mix of several training datasets: counts per mixed epoch, the run's order, determinism by seed."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.mix import Mix, Source, epoch_counts, largest_remainder


def test_weights_split_the_weighted_records_by_largest_remainder():
    # 0.7 / 0.3 of 48 + 48 = 96 records: 67.2 and 28.8 -> floors 67 + 28, the spare record to 0.8.
    assert epoch_counts([Source("a", 48, weight=0.7), Source("b", 48, weight=0.3)]) == [67, 29]
    # weights are relative: 7 / 3 is 0.7 / 0.3
    assert epoch_counts([Source("a", 48, weight=7), Source("b", 48, weight=3)]) == [67, 29]
    # records: exact; neither: the whole dataset; only the weighted ones share their records
    assert epoch_counts([Source("a", 10, records=25), Source("b", 7), Source("c", 5, weight=1),
                         Source("d", 15, weight=1)]) == [25, 7, 10, 10]
    assert largest_remainder(np.array([1 / 3, 1 / 3, 1 / 3]) * 10, 10) == [4, 3, 3]  # ties: the earlier


@pytest.mark.parametrize("bad, message", [
    (Source("a", 0, weight=1), "'a' has no records"),
    (Source("a", 5, weight=1, records=3), "'a': give a weight or records, not both"),
    (Source("a", 5, weight=0), "'a': weight 0 must be > 0"),
    (Source("a", 5, records=0), "'a': records 0 must be >= 1"),
])
def test_bad_sources_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        epoch_counts([bad, Source("b", 5)])


def _dataset_of(mix: Mix, indices) -> np.ndarray:
    return np.searchsorted(mix.offsets, indices, side="right") - 1


def test_every_mixed_epoch_holds_the_counts_and_the_run_draws_what_drawn_says():
    mix = Mix([Source("a", 48, weight=0.7), Source("b", 20, weight=0.3)], seed=5)  # 68 records: 48 + 20
    assert mix.counts == [48, 20] and mix.size == 68  # 47.6 / 20.4
    order = np.array(mix.indices(0, 3 * mix.size + 30))
    which = _dataset_of(mix, order)
    for e in range(3):
        assert np.bincount(which[e * 68:(e + 1) * 68], minlength=2).tolist() == [48, 20]
    assert np.bincount(which, minlength=2).tolist() == mix.drawn(len(order))
    # a dataset's stream: each mixed epoch takes the next `count` items of its permutations, so a whole
    # dataset shows each record once per epoch
    a = order[:68][which[:68] == 0]
    assert sorted(a.tolist()) == list(range(48))


def test_a_cut_dataset_covers_every_record_and_a_repeated_one_repeats_evenly():
    mix = Mix([Source("big", 30, records=10), Source("small", 4, records=10)], seed=0)
    order = np.array(mix.indices(0, 3 * mix.size))
    which = _dataset_of(mix, order)
    big = order[which == 0]
    assert sorted(big.tolist()) == list(range(30))  # 3 epochs of 10 = one pass over the 30
    small = order[which == 1] - mix.offsets[1]
    repeats = np.bincount(small, minlength=4)
    assert repeats.sum() == 30 and repeats.max() - repeats.min() <= 1  # 30 draws of 4 records: 7 or 8 each


def test_the_order_is_a_pure_function_of_the_seed():
    sources = [Source("a", 48, weight=0.7), Source("b", 48, weight=0.3)]
    one = Mix(sources, seed=1).indices(0, 300)
    again = Mix(sources, seed=1)
    assert again.indices(150, 300) == one[150:]  # a resumed run starts mid-way and reads the same samples
    assert again.indices(0, 150) == one[:150]
    other = Mix(sources, seed=2).indices(0, 300)
    assert other != one
    assert np.bincount(_dataset_of(again, other[:96]), minlength=2).tolist() == [67, 29]  # same counts
