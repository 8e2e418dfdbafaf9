"""Failing and hostile clients: dropout, stragglers, retries, skipped rounds, poisoned updates.

Everything here runs in-process on the tiny BERT and the toy data set. The reliability rules
live in `robust.gather` (the round's reply handling) and `robust.check_update`, which any
runtime goes through; a fake transport below plays a misbehaving network.
"""

import math

import numpy as np
import pytest
import torch

from fedsplice.core import robust, wire
from fedsplice.core.server import weighted_mean
from fedsplice.federation import Reply
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes import inprocess as simulation
from fedsplice.runtimes.inprocess import InProcess, run_rounds

POISONED = 3
BOUND = 5.0  # honest updates of this tiny setup have norms of 0.2-0.5


@pytest.fixture
def cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    def make(**kw):
        base = dict(data__num_clients="8", data__holdout_clients="0", server__clients_per_round="5",
                    server__rounds="5")
        return cfg_factory(tiny_bert_dir, toy_jsonl, **{**base, **kw})
    return make


def _run(cfg, transport=None):
    exp = build(cfg)
    store = MemoryStore()
    records = []
    final = run_rounds(exp, store, records.append, transport=transport)
    return exp, store, records, final


def _floats(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _floats(v)
    elif isinstance(x, list):
        for v in x:
            yield from _floats(v)
    elif isinstance(x, float):
        yield x


def _strip(records):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in records]


# ----------------------------------------------------------------------------- the Done-means test


def test_dropout_and_a_poisoned_client(cfg, monkeypatch):
    """30% dropout + one client that sends NaN (odd rounds) or a huge update (even rounds):
    the run finishes, exactly the poisoned updates are rejected, and every metric is finite."""
    orig = simulation.fit_client
    sent = {}  # (round, cid) -> "nan" | "norm", for every poisoned upload that left the client

    def poisoned(exp, store, cid, rnd, down):
        up, st = orig(exp, store, cid, rnd, down)
        if cid != POISONED:
            return up, st
        t = wire.decode(up)
        name = sorted(t)[0]
        if rnd % 2:
            t[name] = t[name].clone()
            t[name].view(-1)[0] = float("nan")
            sent[(rnd, cid)] = "nan"
        else:
            t = {k: v * 1e6 for k, v in t.items()}
            sent[(rnd, cid)] = "norm"
        return wire.encode(t), st

    monkeypatch.setattr(simulation, "fit_client", poisoned)
    c = cfg(faults__dropout="0.3", server__update_norm_bound=str(BOUND))
    exp, store, records, final = _run(c)
    assert set(sent.values()) == {"nan", "norm"}, sent  # the setup exercises both attacks

    rejected = {(r["round"], e["client"]): e["reason"] for r in records[1:]
                for e in r.get("events", []) if e["event"] == "rejected"}
    assert set(rejected) == set(sent)  # exactly the poisoned ones: no honest client refused
    for key, kind in sent.items():
        assert ("non-finite" in rejected[key]) if kind == "nan" else ("exceeds" in rejected[key])
    # dropout happened, and is counted per round; counts match the logged events
    assert sum(r["dropped"] for r in records[1:]) > 0
    for r in records[1:]:
        ev = r.get("events", [])
        for kind in ("dropped", "late", "rejected"):
            assert r[kind] == sum(e["event"] == kind for e in ev)
        assert POISONED not in r["clients"]
        assert set(r["clients"]) | {e["client"] for e in ev} == set(exp.sampling[r["round"] - 1])
        assert not r.get("skipped")
    # metrics and the model stay finite
    assert all(math.isfinite(x) for x in _floats(records))
    assert all(bool(torch.isfinite(t).all()) for t in final["global_params"].values())
    # uploads that arrived are counted, including the rejected ones (they crossed the wire)
    per_upload = len(wire.encode({n: exp.init_params[n] for n in exp.global_names}))
    for r in records[1:]:
        arrived = len(r["clients"]) + r["rejected"]
        assert r["up_bytes"] == per_upload * arrived


# ----------------------------------------------------------------------------- dropout, retries, skips


def test_faults_are_seeded_and_dropped_clients_do_not_train(cfg, monkeypatch):
    calls = []
    orig = simulation.fit_client

    def spy(exp, store, cid, rnd, down):
        calls.append((rnd, cid))
        return orig(exp, store, cid, rnd, down)

    monkeypatch.setattr(simulation, "fit_client", spy)
    c = cfg(faults__dropout="0.4", server__rounds="3")
    _, _, a, _ = _run(c)
    first_calls = list(calls)
    calls.clear()
    _, _, b, _ = _run(c)
    assert _strip(a) == _strip(b) and calls == first_calls  # same seed, same failures
    dropped = {(r["round"], e["client"]) for r in a[1:] for e in r.get("events", [])}
    assert dropped and not dropped & set(first_calls)  # a dropped client never ran
    _, _, other, _ = _run(cfg(faults__dropout="0.4", server__rounds="3", seed="5"))
    assert [r["dropped"] for r in other[1:]] != [r["dropped"] for r in a[1:]] or \
        [r["clients"] for r in other[1:]] != [r["clients"] for r in a[1:]]


class Recording:
    """A transport wrapper that records whom each fit call asked."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def fit(self, rnd, cids, down):
        self.asked.append((rnd, list(cids)))
        return self.inner.fit(rnd, cids, down)

    def run(self, task, cids, down):
        return self.inner.run(task, cids, down)


def test_below_min_replies_retries_then_skips_never_crashes(cfg):
    c = cfg(faults__dropout="0.7", server__min_replies="4", server__max_retries="2", server__rounds="4")
    exp = build(c)
    store = MemoryStore()
    rec = Recording(InProcess(exp, store))
    records = []
    final = run_rounds(exp, store, records.append, transport=rec)
    rounds = records[1:]
    assert len(rounds) == 4 and any(r.get("attempts", 1) > 1 for r in rounds)
    skipped = [r for r in rounds if r.get("skipped")]
    assert skipped, "the setup should skip at least one round"
    for r in skipped:
        assert r["attempts"] == 3 and len(r["clients"]) < 4  # retried up to the bound, then skipped
        assert "train_loss" not in r and "gm" in r  # still evaluated and logged
    for r in rounds:
        if not r.get("skipped"):
            assert len(r["clients"]) >= 4 and "train_loss" in r
        # each retry asks exactly the clients that failed the attempt before
        asked = [cids for rnd, cids in rec.asked if rnd == r["round"]]
        assert len(asked) == r.get("attempts", 1) and asked[0] == exp.sampling[r["round"] - 1]
        for a in range(1, len(asked)):
            failed = [e["client"] for e in r["events"] if e["attempt"] == a - 1]
            assert asked[a] == sorted(failed)
    if all(r.get("skipped") for r in rounds):
        assert all(torch.equal(final["global_params"][n], exp.init_params[n]) for n in exp.global_names)
    assert all(math.isfinite(x) for x in _floats(records))


def test_skipped_round_keeps_global_and_server_state(cfg):
    c = cfg(faults__dropout="1.0", server__max_retries="1", server__rounds="2",
            server__optimizer='"fedadam"')
    exp, store, records, final = _run(c)
    assert all(r["skipped"] and r["dropped"] == 10 and r["attempts"] == 2 for r in records[1:])
    assert all(torch.equal(final["global_params"][n], exp.init_params[n]) for n in exp.global_names)
    assert int(final["server_state"]["step"]) == 0
    assert store.clients() == [] and final["up_bytes"] == 0


def test_stragglers_are_late_and_their_work_is_discarded(cfg):
    c = cfg(faults__straggler="0.5", server__round_deadline_s="30", faults__straggler_delay_s="60",
            server__rounds="3")
    exp, store, records, final = _run(c)
    late = [(r["round"], e["client"]) for r in records[1:] for e in r.get("events", []) if e["event"] == "late"]
    assert late and sum(r["late"] for r in records[1:]) == len(late)
    trained = {cid for r in records[1:] for cid in r["clients"]}
    never = {cid for _, cid in late} - trained
    assert all(store.get(cid) is None for cid in never)  # a late client's PRIVATE state is untouched
    # a deadline above the stragglers' delay makes nobody late (checked by the config: an error)
    from fedsplice.errors import ConfigError
    from fedsplice.federation.validate import load_config

    with pytest.raises(ConfigError, match="round_deadline_s"):
        load_config(None, ["faults.straggler=0.5", "server.round_deadline_s=90"])


# ----------------------------------------------------------------------------- a misbehaving network


class FlakyTransport:
    """Wraps the in-process clients and breaks their replies the ways a real network does."""

    def __init__(self, inner):
        self.inner = inner

    def fit(self, rnd, cids, down):
        replies = self.inner.fit(rnd, cids, down)
        if rnd != 1:
            return replies
        a, b, c, d, e = replies  # 5 sampled clients
        out = [a]  # a: fine
        out.append(Reply(b.cid, b"", 0, {}, 0, len(down), error="connection reset"))  # b: failed
        out.append(Reply(c.cid, c.payload, c.num_examples, c.stats, c.up_bytes, c.down_bytes, late=True))
        out.append(Reply(d.cid, b"\x00garbage", 5, d.stats, 9, len(down)))  # undecodable
        out.append(a)  # a duplicate of a's reply
        out.append(Reply(99, a.payload, 1, a.stats, 0, 0))  # a client that was not asked
        out.append(Reply(e.cid, e.payload, 0, e.stats, e.up_bytes, e.down_bytes))  # bad sample count
        return out

    def run(self, task, cids, down):
        return self.inner.run(task, cids, down)


def test_failures_from_any_transport_flow_through_the_same_loop(cfg):
    c = cfg(server__rounds="2", server__max_retries="0")
    exp = build(c)
    store = MemoryStore()
    records = []
    run_rounds(exp, store, records.append, transport=FlakyTransport(InProcess(exp, store)))
    r = records[1]
    a, b, c_, d, e = exp.sampling[0]
    assert r["clients"] == [a] and not r.get("skipped")
    kinds = {(ev["client"], ev["event"]) for ev in r["events"]}
    assert kinds == {(b, "dropped"), (c_, "late"), (d, "rejected"), (a, "rejected"), (99, "rejected"),
                     (e, "rejected")}
    reasons = " | ".join(ev["reason"] for ev in r["events"])
    for needle in ("connection reset", "deadline", "undecodable", "not asked", "sample count"):
        assert needle in reasons
    assert r["dropped"] == 1 and r["late"] == 1 and r["rejected"] == 4
    assert records[2]["clients"] == exp.sampling[1] and "events" not in records[2]


def test_missing_replies_with_retry(cfg):
    class Silent(FlakyTransport):
        def fit(self, rnd, cids, down):
            replies = self.inner.fit(rnd, cids, down)
            return replies[:1] if len(cids) == 5 else replies  # first ask: only one answers

    c = cfg(server__rounds="1", server__min_replies="3", server__max_retries="1")
    exp = build(c)
    store = MemoryStore()
    records = []
    run_rounds(exp, store, records.append, transport=Silent(InProcess(exp, store)))
    r = records[1]
    assert r["attempts"] == 2 and r["clients"] == exp.sampling[0] and r["dropped"] == 4
    assert all(e["reason"] == "no reply" and e["attempt"] == 0 for e in r["events"])


# ----------------------------------------------------------------------------- robust aggregation


def test_median_aggregation_survives_a_huge_update_without_a_bound(cfg, monkeypatch):
    orig = simulation.fit_client

    def huge(exp, store, cid, rnd, down):
        up, st = orig(exp, store, cid, rnd, down)
        if cid == POISONED:
            up = wire.encode({k: v * 1e6 for k, v in wire.decode(up).items()})
        return up, st

    monkeypatch.setattr(simulation, "fit_client", huge)
    exp, _, records, final = _run(cfg(server__aggregation='"median"', server__rounds="2"))
    assert any(POISONED in r["clients"] for r in records[1:])  # accepted (no bound) ...
    g = torch.cat([t.flatten() for t in final["global_params"].values()])
    assert float(g.abs().max()) < 10  # ... but it cannot drag the median
    assert all(math.isfinite(x) for x in _floats(records))


def _updates(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(3, 4, generator=g, dtype=torch.float64), "b": torch.randn(5, generator=g,
                                                                                        dtype=torch.float64)}
            for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_median_and_trimmed_mean_match_numpy(n):
    ups = _updates(n)
    med = robust.aggregate(ups, [1] * n, "median")
    for k in ups[0]:
        want = np.median(np.stack([u[k].numpy() for u in ups]), axis=0)
        assert np.allclose(med[k].numpy(), want, rtol=0, atol=1e-12)
    tm = robust.aggregate(ups, [1] * n, "trimmed_mean", trim_fraction=0.2)
    cut = int(0.2 * n)
    for k in ups[0]:
        s = np.sort(np.stack([u[k].numpy() for u in ups]), axis=0)
        assert np.allclose(tm[k].numpy(), s[cut:n - cut].mean(0), rtol=0, atol=1e-12)


def test_mean_aggregation_is_the_weighted_mean_bit_for_bit():
    ups = _updates(4)
    w = [3, 1, 7, 2]
    m, ref = robust.aggregate(ups, w, "mean"), weighted_mean(ups, w)
    assert all(torch.equal(m[k], ref[k]) for k in ref)


def test_trimmed_mean_drops_outliers():
    ups = _updates(5)
    ups[0] = {k: v + 1e9 for k, v in ups[0].items()}
    ups[1] = {k: v - 1e9 for k, v in ups[1].items()}
    tm = robust.trimmed_mean(ups, 0.2)
    assert all(float(v.abs().max()) < 10 for v in tm.values())


def test_check_update_reasons():
    ref = {"w": torch.zeros(2, 3), "v": torch.zeros(4)}
    ok = {"w": torch.ones(2, 3) * 0.1, "v": torch.zeros(4)}
    assert robust.check_update(ok, ref, {"p"}, norm_bound=1.0) is None
    cases = [
        ({**ok, "p": torch.zeros(1)}, "PRIVATE tensor p"),
        ({**ok, "x": torch.zeros(1)}, "unknown tensor x"),
        ({"w": ok["w"]}, "lacks GLOBAL tensor v"),
        ({**ok, "v": torch.zeros(5)}, "shape (5,)"),
        ({**ok, "v": torch.zeros(4, dtype=torch.float64)}, "dtype torch.float64"),
        ({**ok, "v": torch.tensor([0.0, float("inf"), 0.0, 0.0])}, "non-finite"),
        ({**ok, "v": torch.full((4,), 2.0)}, "exceeds server.update_norm_bound"),
    ]
    for upd, needle in cases:
        reason = robust.check_update(upd, ref, {"p"}, norm_bound=1.0)
        assert reason is not None and needle in reason, (needle, reason)
    assert robust.check_update({**ok, "v": torch.full((4,), 2.0)}, ref, {"p"}, norm_bound=0.0) is None
    assert robust.check_weight(0) and robust.check_weight(True) and robust.check_weight(2.5)
    assert robust.check_weight(np.int64(3)) is None
    assert robust.check_stats({"loss": float("nan")}) and robust.check_stats({"loss": "x"})
    assert robust.check_stats({"loss": 1.0, "steps": 2}) is None
    assert "negative" in robust.check_stats({"weight/x": -1.0}) and robust.check_stats({"weight/x": 0.0}) is None
