"""Secure aggregation (privacy.secure_aggregation): Flower's own SecAgg+ workflow and client mod,
driven in-process through fedsplice's real ClientApp (test_flower.FakeGrid), and the ledger of the
masked vectors. The real deployment (TLS on) is in test_flower.py.

- the SecAgg+ aggregate equals the plain run's, within SecAgg+'s quantization step, for FedAvg's
  weights and for distributed DP's fixed weights (seeded noise);
- a client that leaves after sharing its keys is recovered: the round sums the others;
- the server never holds an update: every upload's ArrayRecords are empty, and a masked vector
  is uniform over the modulus where the quantized update it hides sits near its middle;
- the sites' ledgers of masked vectors match the server's; `audit` catches a planted hash and
  an unmasked row;
- what SecAgg+ cannot do is refused in one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tomli_w
from test_flower import FakeGrid

from fedsplice.config import to_dict
from fedsplice.federation import ledger
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.flower import secagg
from fedsplice.runtimes.flower.transport import FlowerTransport, JsonLog
from fedsplice.runtimes.inprocess import run_rounds

STEP = 2 * 8.0 / 2 ** 22  # SecAgg+'s quantization step at Flower's default clipping and quantization ranges


@pytest.fixture
def flower(tmp_path, monkeypatch):
    """run(cfg, tag, tamper=None) -> (final state, metrics records, wire audit rows, server ledger dir)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedsplice.runtimes.flower.client import Node

    for k, v in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)

    def run(cfg, tag: str, tamper=None):
        root = tmp_path / tag
        grid = FakeGrid(tomli_w.dumps(to_dict(cfg)), root, 3, tamper=tamper)
        exp, records = build(cfg), []
        exp.ledger = root / "ledger"
        t = FlowerTransport(grid, exp, events=JsonLog(root / "events.jsonl"), audit=JsonLog(root / "wire.jsonl"),
                            min_nodes=3, say=lambda s: None, poll_s=0.01)
        state = run_rounds(exp, MemoryStore(), records.append, transport=t)
        wire = [json.loads(s) for s in (root / "wire.jsonl").read_text().splitlines()]
        return state, records, wire, root

    yield run
    Node._cached, Node._key = None, ()


def _cfg(cfg_factory, tiny_bert_dir, toy_jsonl, secure: bool, **kw):
    return cfg_factory(tiny_bert_dir, toy_jsonl, server__rounds="1", server__clients_per_round="3",
                       privacy__secure_aggregation=secure, **kw)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


@pytest.mark.parametrize("dp, gain", [
    ({}, 1.0),
    ({"privacy__mode": '"distributed"', "privacy__clip": "0.05", "privacy__noise_multiplier": "1.0",
      "privacy__noise": '"seeded"'}, 1.0),
    # FedYogi acts on the decoded mean: its step moves at most η/τ (= 10) times a change of the mean
    ({"server__optimizer": '"fedyogi"'}, 10.0)])
def test_secagg_equals_the_plain_aggregate_within_quantization(flower, cfg_factory, tiny_bert_dir, toy_jsonl, dp,
                                                                gain):
    """One round, 3 clients: |SecAgg+ − plain| per coordinate <= 3 clients × one quantization step
    (divided by the summed weight ratio, >= 1 here), and SecAgg+ did quantize (not exactly equal)."""
    plain, p_recs, _, _ = flower(_cfg(cfg_factory, tiny_bert_dir, toy_jsonl, False, **dp), "plain")
    sec, s_recs, wire, _ = flower(_cfg(cfg_factory, tiny_bert_dir, toy_jsonl, True, **dp), "secagg")
    d = _max_diff(plain["global_params"], sec["global_params"])
    assert 0 < d <= gain * 3 * STEP + 1e-9, d
    assert s_recs[1]["clients"] == p_recs[1]["clients"] == [0, 1, 2]
    assert s_recs[1]["train_loss"] == pytest.approx(p_recs[1]["train_loss"], abs=1e-9)  # the same local training
    assert s_recs[1].get("dp_epsilon") == p_recs[1].get("dp_epsilon")
    assert s_recs[1]["up_bytes"] > 0 and s_recs[1]["down_bytes"] > 0
    kinds = {r["kind"] for r in wire if r["round"] == 1 and r["dir"] == "up"}
    assert "secagg" in kinds and "train" not in kinds


def test_the_server_never_holds_an_update(flower, cfg_factory, tiny_bert_dir, toy_jsonl):
    masked: list[bytes] = []

    def keep(kind, node, msg, rep):
        if kind == "train" and secagg.masked(rep) is not None and node == 1001:
            masked.extend(secagg.masked(rep))

    _, _, wire, _ = flower(_cfg(cfg_factory, tiny_bert_dir, toy_jsonl, True), "secagg", tamper=keep)
    ups = [r for r in wire if r["dir"] == "up" and r["kind"] == "secagg"]
    assert len(ups) == 4 * 3  # four stages, three nodes
    assert all(all(not names for names in r["arrays"].values()) for r in ups)  # no tensor in any upload
    assert all(r["global_hits"] == 0 and r["private_hits"] == [] for r in ups)
    # the masked vector: uniform over [0, 2^32); unmasked, the quantized update of a LoRA delta
    # (|Δ| << 8) would sit at 2^21 ± a few thousand, i.e. within 1e-3 of the modulus' 0.5 × 2^-10
    values = np.concatenate([np.load(__import__("io").BytesIO(b)).ravel() for b in masked[1:]]) / 2 ** 32
    assert values.size > 1000
    # the masks are drawn from the OS's randomness (Flower's SecAgg+ keys): the bounds are 5 standard
    # errors of a uniform sample's mean and standard deviation (a chance failure ~1e-6), far from an
    # unmasked vector's mean ~5e-4 and spread ~0 (a fixed 0.02 on the mean was 2.2 standard errors)
    n = values.size
    assert abs(values.mean() - 0.5) < 5 * 12 ** -0.5 / n ** 0.5
    assert abs(values.std() - 12 ** -0.5) < 5 * ((1 / 80 - 1 / 144) / (4 * n / 12)) ** 0.5


def test_a_client_that_drops_mid_round_is_recovered(flower, cfg_factory, tiny_bert_dir, toy_jsonl):
    """Node 1002 shares its keys, then never sends its masked vector: the survivors' shares of its
    key remove its pairwise masks, and the round sums clients 0 and 1, as the plain run does when
    client 2 never answers."""
    cfg = _cfg(cfg_factory, tiny_bert_dir, toy_jsonl, True, server__round_deadline_s="1.0")

    def drop(kind, node, msg, rep):
        is_fit = secagg.is_round(msg) or (kind == "train" and "task" in msg.content.config_records)
        return "silence" if node == 1002 and is_fit else None

    sec, recs, _, _ = flower(cfg, "secagg", tamper=drop)
    plain, p_recs, _, _ = flower(_cfg(cfg_factory, tiny_bert_dir, toy_jsonl, False, server__round_deadline_s="1.0"),
                                 "plain", tamper=drop)
    assert recs[1]["clients"] == p_recs[1]["clients"] == [0, 1] and not recs[1].get("skipped")
    assert recs[1]["dropped"] == 1
    # SecAgg+ weighs client i by n_i / max_weight, max_weight = the round's largest n (client 2's
    # counts too): two survivors' errors of < 1 step each are divided by their summed ratio, < 1
    # when client 2 is the largest
    n = [len(c.train_idx) for c in build(cfg).clients]
    ratios = (n[0] + n[1]) / max(n[:3])
    assert 0 < _max_diff(plain["global_params"], sec["global_params"]) <= 2 * STEP / ratios + 1e-9, (n, ratios)


def test_the_ledgers_of_masked_vectors_match_and_audit_catches_plants(flower, cfg_factory, tiny_bert_dir,
                                                                       toy_jsonl):
    _, _, _, root = flower(_cfg(cfg_factory, tiny_bert_dir, toy_jsonl, True), "secagg")
    split = json.loads((root / "ledger" / ledger.SPLIT).read_text())
    server = ledger.read(root / "ledger" / ledger.SERVER)
    sites = {str(f): ledger.read(f) for f in sorted(root.rglob("site-*.jsonl"))}
    assert len(sites) == 3 and server and all(r["masked"] and r["secagg"] for r in server)
    assert {r["name"] for r in server} == {ledger.SECAGG_WEIGHT, *split["global"]}
    # each site also records the update it contributed (secagg, not masked): it never reached the server
    own = [r for rs in sites.values() for r in rs if not r.get("masked")]
    assert own and all(r["secagg"] for r in own)
    assert not {r["sha256"] for r in own} & {r["sha256"] for r in server}
    bad, summary = ledger.check(split, server, sites)
    assert bad == [] and all(s["received"] == len(split["global"]) + 1 for s in summary.values())
    planted = [dict(server[0], sha256="0" * 64), *server[1:]]
    assert any("differs from what the client sent (sha256)" in b for b in ledger.check(split, planted, sites)[0])
    unmasked = [*server, {**own[0]}]
    assert any("received unmasked" in b for b in ledger.check(split, unmasked, sites)[0])


@pytest.mark.parametrize("sets, match", [
    (["privacy.secure_aggregation=true", "server.aggregation='median'"], "server.aggregation = 'median' needs"),
    (["privacy.secure_aggregation=true", "privacy.mode='central'", "privacy.clip=1.0",
      "privacy.noise_multiplier=1.0"], "privacy.mode = 'central' clips each update on the server"),
    (["privacy.secure_aggregation=true", "server.update_norm_bound=5.0"], "server.update_norm_bound cannot"),
    (["privacy.secure_aggregation=true", "privacy.secagg_num_shares=2"], "privacy.secagg_num_shares must be"),
    (["privacy.secure_aggregation=true", "privacy.secagg_threshold=0"], "privacy.secagg_threshold must be"),
    (["privacy.secure_aggregation=true", "server.clients_per_round=1"], "must be >= 2"),
    (["privacy.secure_aggregation=true"], "runs Flower's SecAgg+: use runtime.kind = 'flower'"),
])
def test_what_secagg_cannot_do_is_refused_in_one_line(cli_refuses, tiny_cfg, sets, match):
    cli_refuses(tiny_cfg(), sets, match)


def test_a_method_with_its_own_weights_is_refused(tiny_cfg):
    from fedsplice.errors import ConfigError

    with pytest.raises(ConfigError, match="needs one weight per client, and algorithm 'hetlora'"):
        build(tiny_cfg(algorithm='"hetlora"', privacy__secure_aggregation="true"))  # its check_config: at load


def test_flower_up_needs_one_supernode_per_training_client(tiny_cfg, tmp_path):
    from fedsplice.app.flower import launcher
    from fedsplice.errors import ConfigError

    cfg = tiny_cfg(privacy__secure_aggregation="true")
    with pytest.raises(ConfigError, match="runtime.num_supernodes = 2, set it to the 3 training clients"):
        launcher.up(cfg, tmp_path / "run", launcher.Launch(supernodes=2, quiet=True))
    assert not (tmp_path / "run").exists()
