"""Disjoint local test sets (data.local_test = "disjoint", fedsplice.data.testsets): the quotas by
hand, the shortfall rules, the invariants on a toy data set built in-process, the errors, and the
default ("global") left as it was."""

import json

import numpy as np
import pytest
from conftest import write_toy_jsonl

from fedsplice.config import ExperimentConfig, from_dict
from fedsplice.core.streams import LOCAL_TEST, PARTITION, SCENARIO, rng
from fedsplice.data import partition as P
from fedsplice.data.datasets import TextDataset
from fedsplice.data.report import data_report
from fedsplice.data.samples import Sample
from fedsplice.data.scenarios import apply_scenario
from fedsplice.data.testsets import client_quotas, deal, disjoint_clients, fill, top_up
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build_data, make_clients, split_data

W = np.array([[3, 1, 0], [1, 1, 2]])  # two clients' training counts over 3 classes


def test_quotas_by_hand():
    # 3:1 of 6 is 4.5 / 1.5: floors 4, 1; the tie of remainders goes to the lower class
    assert client_quotas([np.array([0, 0, 0, 1])], 6, 3).tolist() == [[5, 1, 0]]
    assert client_quotas([np.array([0, 0, 0, 1]), np.array([0, 1, 2, 2])], 4, 3).tolist() == W.tolist()
    assert fill(W, 4, np.array([10, 10, 10])).tolist() == W.tolist()  # enough of everything: the quotas


def test_exhausted_class_cap_and_refill_by_hand():
    # class 0 has 2 items for asks 3 and 1: shared 1.5 / 0.5, the tie to client 0 -> [2, 0]
    assert fill(W, 4, np.array([2, 10, 10])).tolist() == [[2, 1, 0], [0, 1, 2]]
    # refill: client 0 misses 1 -> its other class (1); client 1 misses 1 -> classes 1, 2 at 1:2 -> class 2
    assert fill(W, 4, np.array([2, 10, 10]), refill=True).tolist() == [[2, 2, 0], [0, 1, 3]]
    # an empty class under "cap": its quotas are cut to 0, nothing moves
    assert fill(W, 4, np.array([0, 10, 10])).tolist() == [[0, 1, 0], [0, 1, 2]]
    # refill stops when a client's classes are all empty: client 0 gets what classes 0 and 1 hold
    assert fill(W, 4, np.array([1, 1, 10]), refill=True).tolist() == [[1, 1, 0], [0, 0, 4]]


def test_deal_and_top_up_are_disjoint_and_exact():
    labels = np.repeat(np.arange(3), 10)
    counts = np.array([[4, 1, 0], [5, 2, 3], [1, 7, 7]])
    picks = deal(counts, labels, np.random.default_rng(0))
    assert len(np.unique(np.concatenate(picks))) == counts.sum()
    assert [np.bincount(labels[p], minlength=3).tolist() for p in picks] == counts.tolist()
    top = top_up(np.array([1, 3, 5]), np.repeat(np.arange(3), [5, 5, 1]), 4, np.random.default_rng(0))
    assert np.bincount(np.repeat(np.arange(3), [5, 5, 1])[top], minlength=3).tolist() == [3, 1, 0]


# ----------------------------------------------------------------------------- on a toy data set

DISJOINT = {"data.local_test": '"disjoint"', "data.local_test_size": "8", "data.num_clients": "4",
            "data.holdout_clients": "1", "data.max_per_class": "0", "data.imbalance": "4.0", "data.n_max": "30",
            "eval.validation_per_class": "5"}


@pytest.fixture
def toy(tmp_path, cfg_factory):
    path = write_toy_jsonl(tmp_path / "toy.jsonl", per_class=80)

    def make(**kw):
        return cfg_factory("unused-model", path, **{k.replace(".", "__"): v for k, v in {**DISJOINT, **kw}.items()})
    return make


def _test_items(data, clients):
    glob = set(data.test_texts[:data.global_test_size])
    local = [[data.test_texts[i] for i in c.test_idx] for c in clients]
    return glob, local


def test_disjoint_invariants(toy):
    cfg = toy(**{"data.global_test_per_class": "10"})
    data, clients, _ = build_data(cfg)
    glob, local = _test_items(data, clients)
    flat = [t for items in local for t in items]
    assert len(flat) == len(set(flat)) == 4 * 8  # pairwise disjoint, every client full
    assert not set(flat) & glob and not set(flat) & set(data.train_texts)
    # the validation hold-out, drawn as apply_validation draws it, is left out too
    d0, _ = split_data(toy(**{"data.local_test": '"global"', "eval.on": '"validation"'}))
    assert not set(flat) & set(d0.test_texts)
    assert data.global_test_size == 30 and np.bincount(data.test_labels[:30]).tolist() == [10, 10, 10]
    for c in clients:  # the labels follow the client's training distribution
        assert np.bincount(data.test_labels[c.test_idx], minlength=3).tolist() == \
            P.largest_remainder(np.bincount(data.train_labels[c.train_idx], minlength=3), 8).tolist()
    rep = data_report(data, clients)
    assert rep["local_test"]["drawn"] == 32 and rep["local_test"]["global_top_up"] == 30 - 3 * 6
    assert not rep["warnings"]


def test_validation_never_reads_the_test_runs_items(toy):
    """A validation run draws its local sets from the hold-out in training proportions (as
    "global" does); the measured run's disjoint sets leave the hold-out out, and the validation
    run trains on neither."""
    test_data, test_clients, _ = build_data(toy())
    val_data, val_clients, _ = build_data(toy(**{"eval.on": '"validation"'}))
    hold_out = set(val_data.test_texts[:val_data.global_test_size])
    _, local = _test_items(val_data, val_clients)
    assert {t for items in local for t in items} <= hold_out and "local_test" not in val_data.report
    assert not hold_out & set(test_data.test_texts) and not set(test_data.test_texts) & set(val_data.train_texts)


def test_exhaustion_is_handled_and_reported(toy):
    # the top-up leaves the head class (30 of its 74 train, 24 more to the global set) too few for
    # the clients' quotas of it; the other classes have more
    sizes = {}
    for rule in ("cap", "refill"):
        cfg = toy(**{"data.local_test_size": "20", "data.global_test_per_class": "30",
                     "data.local_test_shortfall": rule})
        data, clients, _ = build_data(cfg)
        lt = data.report["local_test"]
        assert lt["short_per_class"][0] > 0 and lt["drawn"] < lt["requested"] == 80
        assert sum(lt["short_per_client"]) == 80 - lt["drawn"] == 80 - sum(len(c.test_idx) for c in clients)
        assert any("ran out of unused items" in w for w in data.report["warnings"])
        _, local = _test_items(data, clients)
        flat = [t for items in local for t in items]
        assert len(flat) == len(set(flat))  # nothing reused to make up the shortfall
        assert np.bincount(data.test_labels[:data.global_test_size]).tolist() == [30, 30, 30]
        sizes[rule] = [len(c.test_idx) for c in clients]
        if rule == "cap":  # no class gets more than its quota; the short class is shared out in full
            quotas = client_quotas([data.train_labels[c.train_idx] for c in clients], 20, 3)
            got = np.stack([np.bincount(data.test_labels[c.test_idx], minlength=3) for c in clients])
            assert (got <= quotas).all() and (got[:, 1:] == quotas[:, 1:]).all()
    assert all(r >= c for r, c in zip(sizes["refill"], sizes["cap"])) and sizes["refill"] != sizes["cap"]


def test_global_top_up_shortfall_is_a_warning(toy):
    cfg = toy(**{"data.partition": '"iid"', "data.global_test_per_class": "50", "data.local_test_size": "4"})
    data, _, _ = build_data(cfg)
    counts = np.bincount(data.test_labels[:data.global_test_size])
    assert counts[0] < 50 and counts[1:].tolist() == [50, 50]  # the head class's pool ran out
    assert any("1 classes below data.global_test_per_class = 50" in w for w in data.report["warnings"])


def test_default_is_todays_draw(toy):
    cfg = toy(**{"data.local_test": '"global"'})
    data, clients, _ = build_data(cfg)
    assert data.pool_texts is None and "local_test" not in data.report
    assert "local_test" not in data_report(data, clients)
    parts = P.dirichlet_partition(data.train_labels, 4, cfg.data.alpha, rng(cfg, PARTITION))
    g = rng(cfg, LOCAL_TEST)
    old = [P.local_test_indices(data.train_labels[p], data.test_labels, 8, 3, g) for p in parts]
    assert all(np.array_equal(c.test_idx, o) for c, o in zip(clients, old))
    assert data.global_test_size == len(data.test_texts)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("sets, msg", [
    ({"data.local_test": '"both"'}, "data.local_test: unknown value 'both'; choose one of global, disjoint"),
    ({"data.local_test": '"global"', "data.global_test_per_class": "10"}, "only with data.local_test = 'disjoint'"),
    ({"data.local_test": '"global"', "data.local_test_shortfall": '"refill"'}, "data.local_test_shortfall is for"),
    ({"data.local_test_shortfall": '"spread"'}, "data.local_test_shortfall: unknown value 'spread'"),
    ({"data.global_test_per_class": "3"}, r"at least data.test_per_class = 6, got 3"),
    ({"data.global_test_per_class": "-1"}, "data.global_test_per_class must be 0"),
])
def test_config_errors(toy, sets, msg):
    with pytest.raises(ConfigError, match=msg):
        toy(**sets)


def test_sites_and_given_splits_are_refused(toy, tmp_path):
    with pytest.raises(ConfigError, match="per-site data tests each site"):
        from_dict(ExperimentConfig, {"data": {"dataset": "sites", "labels": ["a", "b"],
                                               "local_test": "disjoint"}}).check()
    test = write_toy_jsonl(tmp_path / "test.jsonl", per_class=5, seed=3)
    with pytest.raises(ConfigError, match="data.test is your own test split"):
        toy(**{"data.test": f'"jsonl:{test}"', "data.global_test_per_class": "10"})
    rows = [json.loads(r) for r in (tmp_path / "toy.jsonl").read_text().splitlines()]
    split = tmp_path / "split.jsonl"  # a `split` column: known only once the file is read
    split.write_text("\n".join(json.dumps({**r, "split": "train" if i % 10 else "test"}) for i, r in enumerate(rows)))
    with pytest.raises(ConfigError, match="test split is given .* remove data.global_test_per_class"):
        build_data(toy(**{"data.dataset": f'"jsonl:{split}"', "data.global_test_per_class": "10"}))


def test_too_few_unused_items(toy):
    with pytest.raises(ConfigError, match=r"data.local_test_size = 90: 4 disjoint local test sets need 360 unused "
                                          r"training items, but \d+ are left .* lower it to at most \d+"):
        build_data(toy(**{"data.local_test_size": "90"}))
    # client 0 trains only on class 0, and no class-0 item is unused
    data = TextDataset("syn", ["a", "b"], ["x0", "x1", "y0", "y1"], np.array([0, 0, 1, 1]), ["t0", "t1"],
                       np.array([0, 1]), "tests")
    data.pool_texts, data.pool_labels = [f"p{i}" for i in range(10)], np.ones(10, np.int64)
    with pytest.raises(ConfigError, match="client 0 trains only on classes whose unused items are all taken"):
        disjoint_clients(from_dict(ExperimentConfig, {"data": {"local_test": "disjoint", "local_test_size": 2}}).data,
                         data, [np.array([0, 1]), np.array([2, 3])], (), np.random.default_rng(0))


# ----------------------------------------------------------------------------- scenarios


def test_scenario_copies_follow_the_local_sets():
    """A scenario appends changed local test copies after everything in test_texts: with disjoint
    sets that is after the clients' items, not after the global test set."""
    img = np.zeros((2, 2, 3), np.uint8)

    def items(prefix, n):
        return [Sample(f"{prefix}{i}", img, f"t {prefix}{i}") for i in range(n)]
    labels = np.repeat(np.arange(2), 20)
    data = TextDataset("syn", ["a", "b"], items("tr", 40), labels, items("te", 8), np.repeat(np.arange(2), 4), "tests")
    data.pool_texts, data.pool_labels = data.train_texts + items("po", 40), np.concatenate([labels, labels])
    cfg = from_dict(ExperimentConfig, {"data": {"num_clients": 2, "local_test_size": 6, "local_test": "disjoint"},
                                       "scenario": {"missing_rate": 1.0, "missing": "image"}})
    clients = make_clients(cfg, data)
    before = [[data.test_texts[i] for i in c.test_idx] for c in clients]
    n = len(data.test_texts)
    apply_scenario(cfg.scenario, data, clients, rng(cfg, SCENARIO), seed=0)
    for c, old in zip(clients, before):
        assert all(i >= n for i in c.test_idx)  # every copy is new: nothing overwrote another client's item
        assert [data.test_texts[i] for i in c.test_idx] == [f"{s}|noimg" for s in old]
    assert data.global_test_size == 8 and len(data.test_texts) == n + 12
