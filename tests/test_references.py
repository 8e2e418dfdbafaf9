"""Reference rows (issue 16): centralized, majority and local-prior.

The priors are checked on a hand-made experiment whose every number is worked out below, then
end to end on the tiny model against the partition the run itself used; centralized end to end
(0 bytes, GM on the global test set, the pooled data and budget); bad uses exit 2 in one line.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from fedsplice.app.cli import main
from fedsplice.config import EvalConfig
from fedsplice.data.partition import Client
from fedsplice.errors import ConfigError
from fedsplice.federation import build, evaluate_only, pooled, tasks
from fedsplice.federation.evaluation import evaluate_global, summarize_pm
from fedsplice.runtimes.inprocess import InProcess

# ----------------------------------------------------------------------------- by hand

# 3 classes. Training labels of the 3 training clients (client 3 is held out, never pooled):
#   client 0: 0 0 0 1   -> own majority 0
#   client 1: 1 1 2     -> own majority 1
#   client 2: 2 2 2 2 0 -> own majority 2
#   client 3: 1 1 1 1 1 1 1 (held out: would make 1 the majority if it were pooled)
# pooled over clients 0-2: class 0: 4, class 1: 3, class 2: 5 -> global majority 2.
TRAIN = [[0, 0, 0, 1], [1, 1, 2], [2, 2, 2, 2, 0], [1] * 7]
# Global test set, balanced: 0 0 1 1 2 2 (indices 0-5). Local test sets (indices into it):
#   client 0: 0 1 2 4 -> labels 0 0 1 2     client 1: 2 3 4 -> 1 1 2     client 2: 4 5 0 1 -> 2 2 0 0
TEST_LABELS = [0, 0, 1, 1, 2, 2]
LOCAL_TEST = [[0, 1, 2, 4], [2, 3, 4], [4, 5, 0, 1], [0, 2, 4]]
# majority (class 2):   GM 2/6 = 1/3; PM per client 1/4, 1/3, 2/4; PM mean 13/36
# local-prior (0, 1, 2): GM = majority's 1/3; PM per client 2/4, 2/3, 2/4; PM mean 5/9
MAJORITY_PM = [1 / 4, 1 / 3, 1 / 2]
LOCAL_PM = [1 / 2, 2 / 3, 1 / 2]


def hand_exp(prior: str, train=TRAIN, test_labels=TEST_LABELS, local=LOCAL_TEST, many=4, few=4):
    """An experiment object with just what scoring reads; no model at all (a model call fails)."""
    labels = np.array([y for ys in train for y in ys])
    starts = np.cumsum([0] + [len(ys) for ys in train])
    clients = [Client(k, np.arange(starts[k], starts[k + 1]), np.array(t)) for k, t in enumerate(local)]
    c = max(max(labels), max(test_labels)) + 1
    data = SimpleNamespace(class_names=[f"c{i}" for i in range(c)], train_labels=labels,
                           test_labels=np.array(test_labels), global_test_size=len(test_labels))
    return SimpleNamespace(
        recipe=SimpleNamespace(prior=prior), clients=clients, train_ids=[0, 1, 2], data=data, model=None,
        caches={"train_counts": np.bincount(labels[:starts[3]], minlength=c)},
        cfg=SimpleNamespace(eval=EvalConfig(many_threshold=many, few_threshold=few, min_group_samples=1)))


@pytest.mark.parametrize("prior, pm", [("global", MAJORITY_PM), ("local", LOCAL_PM)])
def test_priors_by_hand(prior, pm):
    exp = hand_exp(prior)
    per_client = [tasks.evaluate(exp, None, k, {}) for k in exp.train_ids]
    assert [m["accuracy"] for m in per_client] == pytest.approx(pm)
    summary = summarize_pm(exp, per_client)
    assert summary["accuracy"] == pytest.approx(np.mean(pm))  # 13/36 or 5/9
    assert summary["accuracy"] == pytest.approx(13 / 36 if prior == "global" else 5 / 9)
    assert summary["accuracy_min"] == pytest.approx(min(pm)) and summary["accuracy_max"] == pytest.approx(max(pm))
    gm = evaluate_global(exp, {})  # both: the pooled majority class 2 on 0 0 1 1 2 2
    assert gm["accuracy"] == pytest.approx(1 / 3)
    # F1 of class 2: precision 2/6, recall 1 -> 1/2; classes 0, 1: 0 -> macro 1/6
    assert gm["f1_macro"] == pytest.approx(1 / 6)
    # train counts 4, 3, 5 with thresholds 4/4: many = {2} (acc 1), medium = {0}, few = {1} (acc 0)
    assert (gm["many"], gm["medium"], gm["few"]) == (1.0, 0.0, 0.0)
    assert gm["class_accuracy"] == [0.0, 0.0, 1.0]
    assert "tkl" not in gm and gm["head_bias"] is None  # never compared with a zero-shot model


def test_prior_ties_go_to_the_lowest_class_and_binary_auc_is_chance():
    # 2 classes, pooled 2 / 2: a tie -> class 0; constant scores rank nothing: AUC 1/2
    exp = hand_exp("global", train=[[0, 1], [1, 0], [], [1]], test_labels=[0, 0, 1, 1],
                   local=[[0, 1, 2], [2, 3], [0, 2], [3]])
    gm = evaluate_global(exp, {})
    assert gm["accuracy"] == 0.5 and gm["auc"] == 0.5
    assert [tasks.evaluate(exp, None, k, {})["accuracy"] for k in (0, 1, 2)] == [pytest.approx(2 / 3), 0.0, 0.5]


def test_priors_refuse_per_site_data():
    cfg = SimpleNamespace(algorithm="majority", data=SimpleNamespace(dataset="sites"))
    with pytest.raises(ConfigError, match="pooled training labels"):
        pooled.check_reference(cfg, hand_exp("global").recipe)


# ----------------------------------------------------------------------------- tiny model, end to end

# a long tail (IF 4) and skewed clients: the majorities are clear and the clients' own differ
SKEW = {"data__imbalance": 4.0, "data__alpha": 0.3}


def _expected(exp):
    """Independently of the evaluation code: global majority over the training clients' labels,
    each client's own majority, and their shares in the test sets."""
    d = exp.data
    pooled = np.concatenate([exp.clients[k].train_idx for k in exp.train_ids])
    g = int(np.bincount(d.train_labels[pooled], minlength=len(d.class_names)).argmax())
    local_y = [d.test_labels[exp.clients[k].test_idx] for k in exp.train_ids]
    own = [int(np.bincount(d.train_labels[exp.clients[k].train_idx], minlength=len(d.class_names)).argmax())
           for k in exp.train_ids]
    gm = float(np.mean(d.test_labels[:d.global_test_size] == g))
    return gm, [float(np.mean(y == g)) for y in local_y], [float(np.mean(y == o)) for y, o in zip(local_y, own)]


@pytest.mark.parametrize("algo", ["majority", "local-prior"])
def test_priors_end_to_end_never_run_the_model(algo, tiny_cfg, monkeypatch):
    cfg = tiny_cfg(algorithm=algo, **SKEW)
    from fedsplice.model.taskmodel import TaskModel

    def no_forward(*a, **k):
        raise AssertionError("a prior reference ran the model")

    monkeypatch.setattr(TaskModel, "predict", no_forward)
    exp = build(cfg)
    records = []
    final = evaluate_only(exp, InProcess(exp, None), records.append)
    assert final["up_bytes"] == final["down_bytes"] == 0
    gm_share, majority_pm, local_pm = _expected(exp)
    pm = majority_pm if algo == "majority" else local_pm
    assert gm_share == pytest.approx(1 / 3)  # toy data: 3 classes, a balanced global test set
    assert records[0]["gm"]["accuracy"] == pytest.approx(gm_share)
    per_client = InProcess(exp, None).run("evaluate", exp.train_ids, b"")
    assert [m["accuracy"] for m in per_client.values()] == pytest.approx(pm)
    assert records[0]["pm"]["accuracy"] == pytest.approx(np.mean(pm))
    if algo == "local-prior":
        assert local_pm != majority_pm  # the skewed clients' own majorities do differ here


def _run(capsys, tmp_path, tiny_bert_dir, toy_jsonl, *sets) -> tuple[int, str]:
    from conftest import TINY_BUDGET

    base = [a for k, v in {**TINY_BUDGET, "model.name": json.dumps(str(tiny_bert_dir)),
                           "data.dataset": json.dumps(f"jsonl:{toy_jsonl}"), "method": "{}"}.items()
            for a in ("--set", f"{k}={v}")]
    rc = main(["run", "--out", str(tmp_path / "run"), "--quiet", *base, *sets])
    return rc, capsys.readouterr().err


def test_majority_cli_results(capsys, tmp_path, tiny_bert_dir, toy_jsonl):
    rc, err = _run(capsys, tmp_path, tiny_bert_dir, toy_jsonl, "--set", "algorithm=majority")
    assert rc == 0, err
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    assert r["algorithm"] == "majority" and r["rounds"] == 0 and "cold_start" not in r
    assert r["gm"]["accuracy"] == pytest.approx(1 / 3)  # 3 balanced test classes, one predicted
    assert r["communication"]["up_bytes"] == r["communication"]["down_bytes"] == 0


def test_centralized_end_to_end(tiny_cfg, monkeypatch):
    cfg = tiny_cfg(algorithm="centralized")
    exp = build(cfg)
    n = cfg.data.num_clients
    # the stand-in client n holds the union of the training clients' data and trains alone
    assert len(exp.clients) == n + 1 and n not in exp.train_ids
    union = np.sort(np.concatenate([exp.clients[k].train_idx for k in exp.train_ids]))
    assert np.array_equal(exp.clients[n].train_idx, union)
    assert exp.sampling == [[n]] * cfg.server.rounds and exp.global_names and not exp.private_names
    # budget: clients_per_round (2) x mean over clients of min(max_steps 2, ceil(n_k / 8))
    per = [min(2, -(-len(exp.clients[k].train_idx) // 8)) for k in exp.train_ids]
    steps = round(2 * np.mean(per))
    seen = []
    real = tasks.local_train

    def spy(model, texts, labels, **kw):
        opt, stats = real(model, texts, labels, **kw)
        seen.append((len(texts), stats["steps"], len(kw["opt_state"])))
        return opt, stats

    monkeypatch.setattr(tasks, "local_train", spy)
    from fedsplice.federation.store import make_store
    from fedsplice.runtimes.inprocess import run_rounds

    records = []
    final = run_rounds(exp, make_store("memory", None), records.append)
    assert [(t, s) for t, s, _ in seen] == [(len(union), steps)] * cfg.server.rounds
    assert seen[0][2] == 0 and seen[1][2] > 0  # the optimizer state carries over to the next round
    assert final["up_bytes"] == final["down_bytes"] == 0  # nothing is federated
    assert all(r["up_bytes"] == r["down_bytes"] == 0 and r["clients"] == [n] for r in records[1:])
    # GM: the final model on the balanced global test set; PM: the same model on each local test set
    d, size = exp.data, exp.data.global_test_size
    exp.model.load_params(final["global_params"])
    gm = float(np.mean(exp.model.predict(d.test_texts[:size], 64).numpy().argmax(1) == d.test_labels[:size]))
    assert records[-1]["gm"]["accuracy"] == pytest.approx(gm)
    pm = [float(np.mean(exp.model.predict([d.test_texts[i] for i in exp.clients[k].test_idx], 64).numpy().argmax(1)
                        == d.test_labels[exp.clients[k].test_idx])) for k in exp.train_ids]
    assert records[-1]["pm"]["accuracy"] == pytest.approx(np.mean(pm))


def test_centralized_cli_reports_no_traffic(capsys, tmp_path, tiny_bert_dir, toy_jsonl):
    rc, err = _run(capsys, tmp_path, tiny_bert_dir, toy_jsonl, "--set", "algorithm=centralized")
    assert rc == 0, err
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    assert r["algorithm"] == "centralized" and r["rounds"] == 2
    c = r["communication"]
    assert c["up_bytes"] == c["down_bytes"] == c["up_bytes_per_round"] == 0
    # GM on the balanced global test set (6 a class): every class accuracy is k/6
    assert all(abs(a * 6 - round(a * 6)) < 1e-9 for a in r["gm"]["class_accuracy"])
    assert np.mean(r["gm"]["class_accuracy"]) == pytest.approx(r["gm"]["accuracy"])
    assert len(r["cold_start"]["accuracy"]) == 2  # the held-out client adapts the central model
    # the data report counts the data's clients, not the pooled stand-in, and says it pools
    data = r["data"]
    assert [k["cid"] for k in data["clients"]] == list(range(len(data["clients"])))
    assert sum(k["train"] for k in data["clients"]) == data["train_size"]
    assert any(n.startswith("one model trains on the pooled data of the") for n in data["notes"])


@pytest.mark.parametrize("sets, needle", [
    (["algorithm=majority", "method={foo = 1}"], "method.foo"),
    (["algorithm=centralized", "method={foo = 1}"], "method.foo"),
    (["algorithm=centralized", "server.optimizer=fedyogi"], "server.optimizer = 'fedavg'"),
    (["algorithm=centralized", "server.min_replies=2"], "server.min_replies = 1"),
])
def test_invalid_uses_exit_2_in_one_line(capsys, tmp_path, tiny_bert_dir, toy_jsonl, sets, needle):
    rc, err = _run(capsys, tmp_path, tiny_bert_dir, toy_jsonl, *[a for s in sets for a in ("--set", s)])
    lines = [s for s in err.splitlines() if s.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("fedsplice: error:"), err
    assert needle in lines[0]
    assert not (tmp_path / "run" / "results.json").exists()


def test_compare_puts_the_references_in_the_table(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    from fedsplice.app import compare as C
    from fedsplice.app.rundir import write_config

    paths = []
    for algo in ("lora", "centralized", "majority", "local-prior"):
        d = tmp_path / "cfg" / algo
        d.mkdir(parents=True)
        write_config(d, cfg_factory(tiny_bert_dir, toy_jsonl, algorithm=algo, data__holdout_clients=0))
        paths.append((d / "config.toml").rename(tmp_path / "cfg" / f"{algo}.toml"))
    rows = {r["method"]: r for r in C.compare(paths, 1, [], tmp_path / "cmp", quiet=True)}
    assert set(rows) == {"lora", "centralized", "majority", "local-prior"}
    for ref in ("centralized", "majority", "local-prior"):
        assert rows[ref]["up B/round"][0] == 0 and rows[ref]["up B total"][0] == 0
    assert rows["lora"]["up B/round"][0] > 0
    assert rows["majority"]["GM acc"][0] == pytest.approx(1 / 3)
    assert rows["local-prior"]["GM acc"] == rows["majority"]["GM acc"]  # GM: the global majority
    md = (tmp_path / "cmp" / "table.md").read_text()
    assert all(f"| {ref} |" in md for ref in ("centralized", "majority", "local-prior"))


# ----------------------------------------------------------------------------- in every run (issue 26)


def test_every_runs_references_by_hand():
    from fedsplice.federation import references

    refs = references(hand_exp(None))  # a method's run: the recipe is no prior
    assert refs["majority"]["gm"]["accuracy"] == refs["local_prior"]["gm"]["accuracy"] == pytest.approx(1 / 3)
    assert refs["majority"]["gm"]["f1_macro"] == pytest.approx(1 / 6)
    assert refs["majority"]["pm"]["accuracy"] == pytest.approx(13 / 36)
    assert refs["local_prior"]["pm"]["accuracy"] == pytest.approx(5 / 9)
    assert refs["local_prior"]["pm"]["accuracy_min"] == pytest.approx(1 / 2)
    assert (refs["majority"]["gm"]["many"], refs["majority"]["gm"]["few"]) == (1.0, 0.0)
    assert not any(isinstance(v, list) for r in refs.values() for m in r.values() for v in m.values())
    exp = hand_exp(None)
    exp.caches["train_counts"] = None  # per-site data: the server holds no labels
    assert references(exp) is None


def test_a_runs_references_equal_the_reference_rows_of_compare(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    from fedsplice.app import compare as C
    from fedsplice.app.rundir import write_config

    paths = {}
    for algo in ("lora", "majority", "local-prior"):
        d = tmp_path / "cfg" / algo
        d.mkdir(parents=True)
        write_config(d, cfg_factory(tiny_bert_dir, toy_jsonl, algorithm=algo))
        paths[algo] = (d / "config.toml").rename(tmp_path / "cfg" / f"{algo}.toml")
    explicit = {r["method"]: r for r in C.compare(list(paths.values()), 2, [], tmp_path / "cmp", quiet=True)}
    assert not any("(reference" in m for m in explicit)  # the configs themselves are the references
    lora = json.loads((tmp_path / "cmp" / "runs" / "lora" / "seed-0" / "results.json").read_text())
    for key, algo in (("majority", "majority"), ("local_prior", "local-prior")):
        ref_run = json.loads((tmp_path / "cmp" / "runs" / algo / "seed-0" / "results.json").read_text())
        for side in ("gm", "pm"):
            for k, v in lora["references"][key][side].items():
                assert ref_run[side][k] == pytest.approx(v, nan_ok=True), (key, side, k)
    auto = {r["method"]: r for r in C.compare([paths["lora"]], 2, [], tmp_path / "cmp", quiet=True)}
    assert set(auto) == {"lora", "majority (reference)", "local-prior (reference)"}
    for algo in ("majority", "local-prior"):
        row = auto[f"{algo} (reference)"]
        assert row["n_seeds"] == 2
        for col in ("GM acc", "GM F1", "PM acc", "PM F1", "GM few", "PM β"):
            assert row[col] == pytest.approx(explicit[algo][col], nan_ok=True), (algo, col)
        assert row["up B total"] is None  # no traffic: "—"
    assert "| majority (reference) | 2 |" in (tmp_path / "cmp" / "table.md").read_text()


def _results(gm, pm, zs_acc, zs_auc=None, counts=(20, 20, 20)):
    refs = {"majority": {"gm": {"accuracy": 0.40}, "pm": {"accuracy": 0.50}},
            "local_prior": {"gm": {"accuracy": 0.40}, "pm": {"accuracy": 0.70}}}
    zs = {"accuracy": zs_acc, **({"auc": zs_auc} if zs_auc is not None else {})}
    return {"references": refs, "gm": {"accuracy": gm}, "pm": {"accuracy": pm}, "zero_shot_gm": zs,
            "data": {"global_test_per_class": list(counts)}}


def test_learning_warnings_fire_on_a_run_that_did_not_learn_and_only_then(tiny_cfg):
    from fedsplice.app.summary import learning_warnings

    cfg = tiny_cfg()
    method = SimpleNamespace(recipe=SimpleNamespace(prior=None, trains=True), global_names=["a"])
    said = learning_warnings(cfg, method, _results(gm=0.40, pm=0.69, zs_acc=0.35))
    assert len(said) == 3
    assert said[0].startswith("warning: GM accuracy 0.400 is not above the majority class's 0.400")
    assert said[1].startswith("warning: PM accuracy 0.690 is not above the local prior's 0.700")
    assert said[2].startswith("warning: zero-shot (round 0) is at chance on the global test set (accuracy 0.350, "
                              "not above the majority class's 0.400): the class prompt")
    assert all("usually help" in s for s in said)
    assert learning_warnings(cfg, method, _results(gm=0.41, pm=0.71, zs_acc=0.41)) == []  # it learned
    # binary: the zero-shot test is its AUC against chance, 2 null standard errors (n = 50 + 50: 0.116)
    assert "AUC 0.600" in learning_warnings(cfg, method, _results(0.9, 0.9, 0.3, 0.60, (50, 50)))[0]
    assert learning_warnings(cfg, method, _results(0.9, 0.9, 0.3, 0.62, (50, 50))) == []
    assert "is at chance" in learning_warnings(cfg, method, _results(0.9, 0.9, 0.3, 0.40, (50, 50)))[0]  # -1.7 SE
    said = learning_warnings(cfg, method, _results(0.9, 0.9, 0.3, 0.03, (50, 50)))  # far below: reversed
    assert len(said) == 1 and "ranks the two classes the wrong way round on the global test set (AUC 0.030)" in said[0]
    # a GM that still predicts as zero-shot (TKL at rounding noise) after training
    unmoved = {**_results(0.9, 0.9, 0.9), "rounds": 2}
    unmoved["gm"]["tkl"] = -6.5e-9
    said = learning_warnings(cfg, method, unmoved)
    assert len(said) == 1 and said[0].startswith("warning: after 2 rounds the global model still predicts as "
                                                 "zero-shot does (TKL to zero-shot -6.5e-09")
    unmoved["gm"]["tkl"] = 4e-6  # moved a little: not said
    assert learning_warnings(cfg, method, unmoved) == []
    # the references themselves, and a model with a new head (no zero-shot), say nothing of it
    assert learning_warnings(cfg, SimpleNamespace(recipe=SimpleNamespace(prior="global", trains=False)),
                             _results(0.4, 0.5, 0.4)) == []
    head = tiny_cfg(model__task='"encoder_head"')
    assert learning_warnings(head, method, _results(0.9, 0.9, 0.1)) == []
    assert learning_warnings(cfg, method, {**_results(0.1, 0.1, 0.1), "references": None}) == []


def test_a_run_records_and_prints_its_references(tiny_cfg, tmp_path, capsys):
    from fedsplice.app.runner import run_experiment

    res = run_experiment(tiny_cfg(), tmp_path / "run", quiet=True, echo=print)
    out = capsys.readouterr().out
    refs = res["references"]
    assert refs == json.loads((tmp_path / "run" / "results.json").read_text())["references"]
    maj, loc = refs["majority"]["gm"]["accuracy"], refs["local_prior"]["pm"]["accuracy"]
    assert f"(majority {maj:.3f})" in out and f"(local prior {loc:.3f})" in out
    fired = [w.split(" ")[1] for w in res["warnings"]]
    assert ("GM" in fired) == (res["gm"]["accuracy"] <= maj) and ("PM" in fired) == (res["pm"]["accuracy"] <= loc)
    assert all(w in out for w in res["warnings"])  # echoed: compare shows them too
