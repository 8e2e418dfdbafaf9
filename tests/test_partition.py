"""Partitioners: coverage, determinism, skew, local test sets, long tail, errors (no network)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsplice.data.partition import (
    dirichlet_partition,
    iid_partition,
    largest_remainder,
    local_test_indices,
    long_tail_counts,
    long_tail_subsample,
    shard_partition,
)
from fedsplice.errors import ConfigError


def balanced_labels(num_classes=10, per_class=100):
    return np.repeat(np.arange(num_classes), per_class)


def assert_exact_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert np.array_equal(np.sort(allidx), np.arange(n))
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0)  # sorted, no repeats


def all_partitioners(labels, k, seed):
    return {
        "iid": iid_partition(labels, k, np.random.default_rng(seed)),
        "dirichlet": dirichlet_partition(labels, k, 0.5, np.random.default_rng(seed)),
        "shard": shard_partition(labels, k, 2, np.random.default_rng(seed)),
    }


def test_every_index_exactly_once():
    y = balanced_labels()
    for name, parts in all_partitioners(y, 10, 0).items():
        assert len(parts) == 10, name
        assert_exact_cover(parts, len(y))


@settings(max_examples=40, deadline=None)
@given(
    n_classes=st.integers(1, 6),
    n=st.integers(20, 200),
    k=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_cover_property(n_classes, n, k, seed):
    y = np.random.default_rng(seed).integers(0, n_classes, size=n)
    for parts in (
        iid_partition(y, k, np.random.default_rng(seed)),
        dirichlet_partition(y, k, 1.0, np.random.default_rng(seed), min_per_client=1),
        shard_partition(y, k, 2, np.random.default_rng(seed)),
    ):
        assert len(parts) == k
        assert_exact_cover(parts, n)


def test_seeded_reproducibility():
    y = balanced_labels()
    a, b, c = (all_partitioners(y, 10, s) for s in (7, 7, 8))
    for name in a:
        assert all(np.array_equal(x, z) for x, z in zip(a[name], b[name])), name
        assert any(not np.array_equal(x, z) for x, z in zip(a[name], c[name])), name


def test_iid_sizes_and_labels():
    y = balanced_labels()
    parts = iid_partition(y, 7, np.random.default_rng(0))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1000


def _label_dists(y, parts, c):
    return np.stack([np.bincount(y[p], minlength=c) / len(p) for p in parts])


def test_dirichlet_large_alpha_near_uniform_small_alpha_skewed():
    c, k = 10, 10
    y = balanced_labels(c, 200)
    uniform = np.full(c, 1 / c)
    big = _label_dists(y, dirichlet_partition(y, k, 1000.0, np.random.default_rng(0)), c)
    small = _label_dists(y, dirichlet_partition(y, k, 0.05, np.random.default_rng(0)), c)
    tv_big = 0.5 * np.abs(big - uniform).sum(axis=1)
    tv_small = 0.5 * np.abs(small - uniform).sum(axis=1)
    # Measured with seed 0: mean total-variation distance to uniform 0.013 vs 0.76.
    assert tv_big.max() < 0.15
    assert tv_small.mean() > 0.6
    # Small alpha: most clients are dominated by a few classes.
    top2 = np.sort(small, axis=1)[:, -2:].sum(axis=1)
    assert np.median(top2) > 0.8


def test_dirichlet_min_per_client_and_failure():
    y = balanced_labels(10, 100)
    parts = dirichlet_partition(y, 20, 0.1, np.random.default_rng(1), min_per_client=10)
    assert min(len(p) for p in parts) >= 10
    with pytest.raises(ConfigError, match="data.alpha") as e:
        dirichlet_partition(y, 100, 0.01, np.random.default_rng(0), min_per_client=8)
    assert "data.num_clients" in str(e.value)  # the message suggests both fixes


def test_shard_partition_is_pathological():
    y = balanced_labels(10, 100)
    parts = shard_partition(y, 10, 2, np.random.default_rng(0))
    for p in parts:
        assert len(p) == 100
        assert len(np.unique(y[p])) <= 2  # shards are label-pure at 100 per class


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda y, r: dirichlet_partition(y, 5, 0.0, r), "data.alpha"),
        (lambda y, r: dirichlet_partition(y, 5, -1.0, r), "data.alpha"),
        (lambda y, r: dirichlet_partition(y, 5, float("nan"), r), "data.alpha"),
        (lambda y, r: dirichlet_partition(y, 0, 1.0, r), "data.num_clients"),
        (lambda y, r: iid_partition(y, 0, r), "data.num_clients"),
        (lambda y, r: iid_partition(y, 31, r), "data.num_clients"),
        (lambda y, r: dirichlet_partition(y, 16, 1.0, r), "data.num_clients"),  # 16*2 > 30
        (lambda y, r: shard_partition(y, 31, 1, r), "data.num_clients"),
        (lambda y, r: shard_partition(y, 5, 0, r), "data.shards_per_client"),
        (lambda y, r: shard_partition(y, 5, 7, r), "data.shards_per_client"),
        (lambda y, r: long_tail_counts(5, 100, 0.5), "data.imbalance"),
        (lambda y, r: long_tail_subsample(y, 10, 0.9, r), "data.imbalance"),
        (lambda y, r: long_tail_counts(5, 0, 10), "data.n_max"),
        (lambda y, r: local_test_indices(y, y, 0, 3, r), "data.local_test_size"),
    ],
)
def test_errors_name_the_field(call, field):
    y = balanced_labels(3, 10)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        call(y, np.random.default_rng(0))


def test_largest_remainder():
    assert largest_remainder(np.array([1, 1, 1]), 10).tolist() == [4, 3, 3]
    assert largest_remainder(np.array([5, 3, 2, 0]), 7).tolist() == [4, 2, 1, 0]  # 3.5,2.1,1.4
    assert largest_remainder(np.array([0.7, 0.2, 0.1]), 3).tolist() == [2, 1, 0]


def test_local_test_matches_client_distribution():
    c = 5
    test_y = np.repeat(np.arange(c), 20)
    client_y = np.array([0] * 50 + [1] * 30 + [3] * 20)  # 50 % / 30 % / 20 %
    idx = local_test_indices(client_y, test_y, 30, c, np.random.default_rng(0))
    assert len(idx) == 30
    assert np.bincount(test_y[idx], minlength=c).tolist() == [15, 9, 0, 6, 0]
    assert len(np.unique(idx)) == 30  # without replacement when the pool suffices
    # Rounding: 1/3 each of 10 -> 4, 3, 3 (ties to the lower class index).
    idx = local_test_indices(np.array([0, 2, 4]), test_y, 10, c, np.random.default_rng(0))
    assert np.bincount(test_y[idx], minlength=c).tolist() == [4, 0, 3, 0, 3]


def test_local_test_property_within_rounding():
    c = 8
    test_y = np.repeat(np.arange(c), 20)
    rng = np.random.default_rng(3)
    for _ in range(50):
        client_y = rng.integers(0, c, size=rng.integers(1, 200))
        size = int(rng.integers(1, 100))
        idx = local_test_indices(client_y, test_y, size, c, rng)
        got = np.bincount(test_y[idx], minlength=c)
        want = np.bincount(client_y, minlength=c) / len(client_y) * size
        assert got.sum() == size
        assert np.all(np.abs(got - want) < 1)


def test_local_test_with_replacement_when_class_too_small():
    test_y = np.repeat(np.arange(2), 3)
    idx = local_test_indices(np.zeros(10, dtype=int), test_y, 8, 2, np.random.default_rng(0))
    assert len(idx) == 8 and set(test_y[idx]) == {0}
    assert set(idx.tolist()) <= {0, 1, 2}
    a = local_test_indices(np.array([0, 1]), test_y, 4, 2, np.random.default_rng(5))
    b = local_test_indices(np.array([0, 1]), test_y, 4, 2, np.random.default_rng(5))
    assert np.array_equal(a, b)


def test_long_tail_counts_exact():
    assert long_tail_counts(5, 100, 100) == [100, 31, 10, 3, 1]
    # 300 * 100 ** (-c / 18), floored.
    assert long_tail_counts(19, 300, 100) == [
        300, 232, 179, 139, 107, 83, 64, 50, 38, 30, 23, 17, 13, 10, 8, 6, 5, 3, 3]
    assert long_tail_counts(3, 50, 1) == [50, 50, 50]
    assert long_tail_counts(3, 64, 4) == [64, 32, 16]
    assert long_tail_counts(1, 7, 10) == [7]
    assert long_tail_counts(3, 10, 1000) == [10, 1, 1]  # 0.01 is clamped to 1


def test_long_tail_subsample():
    y = balanced_labels(5, 120)
    idx = long_tail_subsample(y, 100, 100, np.random.default_rng(0))
    assert np.bincount(y[idx]).tolist() == [100, 31, 10, 3, 1]
    assert np.all(np.diff(idx) > 0)
    again = long_tail_subsample(y, 100, 100, np.random.default_rng(0))
    assert np.array_equal(idx, again)
    # A class with fewer samples than its quota keeps them all.
    y2 = np.array([0] * 5 + [1] * 100 + [2] * 100)
    idx2 = long_tail_subsample(y2, 50, 4, np.random.default_rng(0))
    assert np.bincount(y2[idx2]).tolist() == [5, 25, 12]
    # class_order puts class 4 at the head.
    idx3 = long_tail_subsample(y, 100, 100, np.random.default_rng(0),
                               class_order=np.array([4, 3, 2, 1, 0]))
    assert np.bincount(y[idx3]).tolist() == [1, 3, 10, 31, 100]
