"""Long-tailed protocol (docs/design.md §5-§6): balancedness, shot groups, pooled group accuracies,
head bias, the long-tail cut of the training set and its config errors. Values by hand."""

import math

import numpy as np
import pytest

from fedsplice.data.datasets import TextDataset
from fedsplice.data.partition import long_tail_counts
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import apply_long_tail
from fedsplice.federation.metrics import balancedness, head_bias, longtail_metrics, per_class_counts, shot_groups
from fedsplice.federation.validate import load_config

# ----------------------------------------------------------------------------- balancedness


@pytest.mark.parametrize("acc", [[0.3] * 5, [1.0, 1.0], [0.0, 0.0, 0.0], [0.55]])
def test_balancedness_is_one_for_equal_accuracies(acc):
    assert balancedness(np.array(acc), 0.1) == 1.0
    assert balancedness(np.array(acc), 0.01) == 1.0


def test_balancedness_two_classes_by_hand():
    # pairs (i, j): two with d = 0 -> 1, two with d = ±1 -> exp(-1/0.1)
    assert balancedness(np.array([1.0, 0.0]), 0.1) == pytest.approx((2 + 2 * math.exp(-10)) / 4, abs=1e-15)
    assert balancedness(np.array([1.0, 0.0]), 1.0) == pytest.approx((2 + 2 * math.exp(-1)) / 4, abs=1e-15)


def test_balancedness_three_classes_by_hand():
    a = [0.9, 0.5, 0.2]
    sigma = 0.1
    expect = sum(math.exp(-((x - y) ** 2) / sigma) for x in a for y in a) / 9
    # explicitly: 3 + 2·(e^{-1.6} + e^{-4.9} + e^{-0.9})
    assert expect == pytest.approx((3 + 2 * (math.exp(-1.6) + math.exp(-4.9) + math.exp(-0.9))) / 9)
    assert balancedness(np.array(a), sigma) == pytest.approx(expect, rel=1e-12)
    # smaller sigma punishes the same spread harder
    assert balancedness(np.array(a), 0.01) < balancedness(np.array(a), 0.1) < 1.0


# ----------------------------------------------------------------------------- groups and pooling


def test_shot_groups_default_thresholds():
    counts = np.array([150, 101, 100, 50, 20, 19, 1, 0])
    g = shot_groups(counts, many=100, few=20)
    assert g["many"].tolist() == [True, True, False, False, False, False, False, False]
    assert g["medium"].tolist() == [False, False, True, True, True, False, False, False]
    assert g["few"].tolist() == [False, False, False, False, False, True, True, True]
    # a partition: every class in exactly one group
    assert (g["many"].astype(int) + g["medium"] + g["few"] == 1).all()


def test_shot_groups_custom_thresholds():
    g = shot_groups(np.array([54, 31, 18]), many=40, few=20)
    assert [int(np.flatnonzero(g[k])[0]) for k in ("many", "medium", "few")] == [0, 1, 2]


def test_per_class_counts():
    labels = np.array([0, 0, 1, 1, 1, 3])
    pred = np.array([0, 1, 1, 1, 0, 2])
    correct, total = per_class_counts(labels, pred, 4)
    assert correct.tolist() == [1, 2, 0, 0]
    assert total.tolist() == [2, 3, 0, 1]


def test_longtail_metrics_pool_groups_by_counts():
    correct = np.array([5, 3, 1, 0, 2])
    total = np.array([10, 6, 4, 0, 8])
    zs_correct = np.array([4, 4, 2, 0, 4])
    train_counts = np.array([200, 150, 50, 5, 3])
    m = longtail_metrics(correct, total, zs_correct, train_counts, many=100, few=20, sigma=0.1)
    # pooled, not the mean of per-class accuracies: (5 + 3) / (10 + 6)
    assert m["many"] == pytest.approx(8 / 16)
    assert m["medium"] == pytest.approx(1 / 4)
    # class 3 has no test samples, class 4 does: few = 2/8
    assert m["few"] == pytest.approx(2 / 8)
    # balancedness over the classes with test samples: a = [0.5, 0.5, 0.25, 0.25]
    a = [0.5, 0.5, 0.25, 0.25]
    for sigma, key in ((0.1, "balancedness"), (0.1, "balancedness_0.1"), (0.01, "balancedness_0.01")):
        expect = sum(math.exp(-((x - y) ** 2) / sigma) for x in a for y in a) / 16
        assert m[key] == pytest.approx(expect, rel=1e-12)
    assert m["balancedness_sigma"] == 0.1
    # Δ vs zero-shot = [0.1, -1/6, -0.25, -0.25] on counts [200, 150, 50, 3]: monotone but tied
    from scipy.stats import spearmanr

    expect_hb = spearmanr([200, 150, 50, 3], [0.5 - 0.4, 0.5 - 4 / 6, 0.25 - 0.5, 0.25 - 0.5]).statistic
    assert m["head_bias"] == pytest.approx(float(expect_hb))
    assert m["head_bias"] > 0.9


def test_longtail_metrics_empty_group_is_none():
    m = longtail_metrics([3, 1], [4, 4], [2, 2], [500, 300], many=100, few=20, sigma=0.1)
    assert m["many"] == pytest.approx(4 / 8)
    assert m["medium"] is None and m["few"] is None


def test_head_bias_sign():
    counts = [300, 120, 40, 10]
    zs = [0.5, 0.5, 0.5, 0.5]
    head_favouring = [0.9, 0.7, 0.45, 0.1]  # Δ decreasing with rarity
    assert head_bias(counts, head_favouring, zs) == pytest.approx(1.0)
    tail_favouring = [0.1, 0.45, 0.7, 0.9]
    assert head_bias(counts, tail_favouring, zs) == pytest.approx(-1.0)
    assert head_bias(counts, [0.6] * 4, zs) is None  # constant change
    assert head_bias(counts, zs, zs) is None  # no change at all
    assert head_bias([50] * 4, head_favouring, zs) is None  # constant counts


# ----------------------------------------------------------------------------- the long-tail cut


def _toy_dataset(sizes):
    labels = np.concatenate([np.full(n, c) for c, n in enumerate(sizes)]).astype(np.int64)
    perm = np.random.default_rng(3).permutation(len(labels))
    labels = labels[perm]
    texts = [f"class{y} item{i}" for i, y in enumerate(labels)]
    return TextDataset("toy", [f"c{c}" for c in range(len(sizes))], texts, labels,
                       ["t"] * len(sizes), np.arange(len(sizes)), "test")


@pytest.mark.parametrize("imbalance,n_max", [(4.0, 0), (4.0, 12), (10.0, 30), (1.5, 25)])
def test_apply_long_tail_follows_profile_largest_first(imbalance, n_max):
    sizes = [10, 30, 20, 25]  # largest-first order: 1, 3, 2, 0
    data = _toy_dataset(sizes)
    before = dict(zip(data.train_texts, data.train_labels.tolist()))
    cfg = load_config(None, [f"data.imbalance={imbalance}", f"data.n_max={n_max}"])
    out = apply_long_tail(cfg, data)
    prof = long_tail_counts(4, n_max or 30, imbalance)
    expect = np.zeros(4, dtype=int)
    for rank, c in enumerate([1, 3, 2, 0]):
        expect[c] = min(prof[rank], sizes[c])
    assert np.bincount(out.train_labels, minlength=4).tolist() == expect.tolist()
    # a subset: every kept text keeps its own label, none duplicated
    assert len(set(out.train_texts)) == len(out.train_texts)
    assert all(before[t] == y for t, y in zip(out.train_texts, out.train_labels.tolist()))


def test_apply_long_tail_by_hand_and_deterministic():
    cfg = load_config(None, ["data.imbalance=4.0"])
    a = apply_long_tail(cfg, _toy_dataset([10, 30, 20]))
    # n_max = 30: 30, 30/2 = 15, 30/4 = 7.5 -> 7 for the classes ranked 1, 2, 0
    assert np.bincount(a.train_labels).tolist() == [7, 30, 15]
    b = apply_long_tail(cfg, _toy_dataset([10, 30, 20]))
    assert a.train_texts == b.train_texts
    # imbalance = 1 keeps the data as it is
    same = apply_long_tail(load_config(None, ["data.imbalance=1.0"]), _toy_dataset([10, 30, 20]))
    assert np.bincount(same.train_labels).tolist() == [10, 30, 20]


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("sets,field", [
    (["data.imbalance=0.5"], "data.imbalance"),
    (["data.imbalance=-3.0"], "data.imbalance"),
    (['algorithm="fedpurel"', "method={lam = 1.5}"], "method.lam"),
    (['algorithm="fedpurel"', "method={lam = -0.1}"], "method.lam"),
    (["eval.few_threshold=50", "eval.many_threshold=20"], "eval.few_threshold"),
])
def test_config_errors_name_the_field(sets, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, sets)


@pytest.mark.parametrize("sets", [
    ['algorithm="fedpurel"', "method={lam = 0.0}"],
    ['algorithm="fedpurel"', "method={lam = 1.0}"],
    ["data.imbalance=1.0"],
    ["eval.few_threshold=20", "eval.many_threshold=20"],
])
def test_config_boundaries_are_accepted(sets):
    load_config(None, sets)
