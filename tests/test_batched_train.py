"""A round's clients trained together (federation/batched_train.py): the same tensors, optimizer
state and statistics as one client after another, within rounding, for FedAvg-LoRA, PFAdapter
(its orthogonality term per client; on a text encoder and on a causal LM's verbalizer) and
PromptFL (a CoOp context: every client's class side in one forward), with clients of different
sizes (a client whose steps are done drops out of the batch); and where it cannot apply, "on" is
refused with the reason."""

import json

import pytest
import torch

from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.inprocess import run_rounds

# Measured on the tiny BERT in fp32 after 2 rounds. With SGD the tensors are at most 4.8e-7
# relative apart (the union's sub-batches round otherwise than each client's own). AdamW's first
# steps are close to lr·sign(g), so a coordinate whose gradient is near zero moves by ±lr on a
# rounding difference: 2.9e-3 apart here, and 3.8e-4 between two sequential runs that differ only
# in padding (runtime.unpad on / off).
# The tiny Llama with SGD at lr 0.5 amplifies rounding to 8e-4 after one round, and two sequential
# runs that differ only in padding are as far apart; at lr 0.1 both are within 1.2e-6.
RTOL = {"sgd": 1e-5, "adamw": 1e-2}


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


LM = dict(algorithm='"pfadapter"', model__task='"causal_lm"')  # the tiny Llama (text_cfg), verbalizer scoring


def _run(text_cfg, together: bool, **kw):
    n = len(build(text_cfg(**kw)).train_ids)
    exp = build(text_cfg(**kw, server__rounds=2, server__clients_per_round=n, runtime__precision='"fp32"',
                         runtime__batch_train='"on"' if together else '"off"', runtime__batch_eval='"off"'))
    assert exp.batch_train == together
    store, records = MemoryStore(), []
    state = run_rounds(exp, store, records.append)
    return exp, store, state, records


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("algo", [dict(algorithm='"pfadapter"'), dict(algorithm='"lora"', method="{}"),
                                  dict(algorithm='"promptfl"', method="{}", peft__type='"prompt"'), LM])
def test_training_together_equals_one_client_after_another(text_cfg, algo, opt):
    lr = {"client__lr": 0.1 if "model__task" in algo else 0.5} if opt == "sgd" else {}
    kw = dict(**algo, data__partition='"dirichlet"', data__alpha=0.3, client__max_steps=0,
              client__optimizer=f'"{opt}"', **lr)
    tol = RTOL[opt]
    exp, st_a, apart, rec_a = _run(text_cfg, False, **kw)
    _, st_b, together, rec_b = _run(text_cfg, True, **kw)
    sizes = {len(exp.clients[c].train_idx) for c in exp.train_ids}
    assert len(sizes) > 1  # clients of different sizes: some finish their steps before others
    for n, t in apart["global_params"].items():
        assert _rel(together["global_params"][n], t) < tol, n
    assert _rel(apart["global_params"][n], exp.init_params[n]) > 10 * tol  # and the model trained
    for c in exp.train_ids:
        a, b = st_a.get(c), st_b.get(c)  # PRIVATE tensors, optimizer moments, the method's state
        assert sorted(a) == sorted(b), c
        for k in a:
            assert _rel(b[k], a[k]) < tol, (c, k)
    for ra, rb in zip(rec_a, rec_b):
        assert ra.keys() == rb.keys()
        stats = [k for k, v in ra.items() if isinstance(v, float) and k != "time_s"]  # losses, diagnostics
        assert "orthogonality_grad_ratio_global" in ra or "pfadapter" not in algo["algorithm"] or ra["round"] == 0
        for k in stats:
            assert rb[k] == pytest.approx(ra[k], rel=tol), k
        if "pm" in ra:
            assert rb["pm"]["accuracy"] == pytest.approx(ra["pm"]["accuracy"], abs=0.02)
    json.dumps(rec_b)  # the records stay plain JSON


def test_a_round_of_more_clients_than_a_chunk_trains_them_a_chunk_at_a_time(tiny_cfg, monkeypatch):
    """CHUNK clients per joint pass (a pass's activations grow with its clients): with CHUNK = 2
    a round of more clients trains in passes of at most 2, each client as it trains alone."""
    from fedsplice.federation import batched_train

    kw = dict(algorithm='"pfadapter"', client__max_steps=0, client__optimizer='"sgd"', client__lr=0.5)
    _, _, apart, _ = _run(tiny_cfg, False, **kw)
    sizes: list[int] = []
    orig = batched_train.train_together

    def counted(exp, fits, done=None):
        sizes.append(len(fits))
        return orig(exp, fits, done)

    monkeypatch.setattr(batched_train, "CHUNK", 2)
    monkeypatch.setattr(batched_train, "train_together", counted)
    exp, _, together, _ = _run(tiny_cfg, True, **kw)
    assert max(sizes) == 2 and len(sizes) == 2 * -(-len(exp.train_ids) // 2)  # 2 rounds of ceil(n / 2) passes
    for n, t in apart["global_params"].items():
        assert _rel(together["global_params"][n], t) < RTOL["sgd"], n


@pytest.mark.parametrize("sets,match", [
    (["algorithm=\"fedpurel\"", "method={}"], "objective, gradient rule or phases of its own"),
    (["algorithm=\"fedotp\"", "method={}", "peft.type=\"prompt\""], "CoOp context alone"),
    (["peft.dropout=0.1"], "LoRA dropout draws its masks"),
    (["model.task=\"encoder_head\""], "this run also trains head"),
    (["runtime.workers=2"], "every client in one process"),
    (["model.gradient_checkpointing=true"], "recomputes the forward in backward"),
])
def test_batch_train_on_where_it_cannot_apply_is_refused(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(algorithm='"pfadapter"'), ["runtime.batch_train=\"on\"", *sets], match)


def test_auto_says_what_applies_and_why_not(tiny_cfg, text_cfg):
    """"auto" (the default) batches where nothing is in the way and (training) it measured faster:
    LoRA under bf16, not fp32; a line each in the run's header says what batches, or why not
    (what is in the way, or the measurement); "off" has none."""
    pf = build(tiny_cfg(algorithm='"pfadapter"'))  # the tiny BERT is 32 wide: "auto" precision is fp32
    assert pf.cfg.runtime.batch_eval == pf.cfg.runtime.batch_train == "auto"
    assert pf.batch_eval and not pf.batch_train
    assert pf.batch_notes == ("runtime.batch_eval = 'auto': the clients' PM scored together",
                              "runtime.batch_train = 'auto': one client at a time, as batched LoRA training measured "
                              "no faster than one client after another in fp32; 'on' batches anyway")
    bf16 = build(tiny_cfg(algorithm='"pfadapter"', runtime__precision='"bf16"'))
    assert bf16.batch_train
    assert bf16.batch_notes[1] == "runtime.batch_train = 'auto': a round's clients trained together"
    assert build(tiny_cfg(algorithm='"pfadapter"', runtime__batch_train='"on"')).batch_train  # "on" batches anyway
    purel = build(tiny_cfg(algorithm='"fedpurel"', method="{}"))
    assert not purel.batch_train and not purel.batch_eval and purel.batch_notes == (
        "runtime.batch_eval = 'auto': one client at a time, as algorithm 'fedpurel' scores its PM with a rule of "
        "its own",
        "runtime.batch_train = 'auto': one client at a time, as algorithm 'fedpurel' trains with an objective, "
        "gradient rule or phases of its own")
    lm = build(text_cfg(**LM, runtime__precision='"bf16"'))  # a causal LM measured slower together, either way
    assert lm.batch_eval and not lm.batch_train and lm.batch_notes[1] == (
        "runtime.batch_train = 'auto': one client at a time, as batched LoRA training of a causal LM measured "
        "slower than one client after another; 'on' batches anyway")
    off = build(tiny_cfg(algorithm='"pfadapter"', runtime__batch_eval='"off"', runtime__batch_train='"off"'))
    assert not off.batch_eval and not off.batch_train and off.batch_notes == ()
