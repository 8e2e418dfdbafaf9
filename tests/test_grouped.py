"""Many clients through one base model (model/grouped.py, federation/batched.py): each row
through its own client's LoRA factors gives the logits of that client's model scored alone, and
the batched PM evaluation equals the per-client one."""

import pytest
import torch

from fedsplice.core import wire
from fedsplice.federation import tasks
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.model.grouped import Owned, Rows, grouped, lora_modules, owners_of, stacked

PF = dict(algorithm='"pfadapter"')
LM = dict(model__task='"causal_lm"')  # text_cfg: the tiny Llama (its toy answers are one token: the prompt pass)
# measured: at most 1.4e-7 relative apart on the tiny BERT (other rows in each padded sub-batch)
RTOL = 1e-5
TKL_ATOL = 1e-6  # measured: TKL differs by at most 4e-8 (a KL of near-equal distributions: absolute)


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / b.norm())


def _client_params(exp, k: int) -> dict[str, torch.Tensor]:
    """Client k's model: the init with every LoRA factor (and head) drawn anew, seeded by k."""
    g = torch.Generator().manual_seed(100 + k)
    return {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in exp.init_params.items()}


def test_owned_text_is_its_string_with_an_owner():
    t = Owned("a text", 3)
    assert t == "a text" and hash(t) == hash("a text") and t.owner == 3 and isinstance(t, str)
    assert sorted([Owned("bb", 1), Owned("a", 0)], key=len)[0].owner == 0
    assert owners_of(["a", "b"]) is None and owners_of([Owned("a", 2), Owned("b", 0)]).tolist() == [2, 0]
    with pytest.raises(ValueError, match="some texts of one call have an owner"):
        owners_of([Owned("a", 0), "b"])


@pytest.mark.parametrize("own", [[2, 0, 2, 0, 0], [0, 0, 2, 2, 2], [1]], ids=["interleaved", "ordered", "one"])
def test_rows_apply_each_owners_factors_to_its_rows_alone(own):
    """Rows.apply: row b gets s·B_k A_k x_b for its owner k (float64, against a loop over rows),
    owners absent from the call (1 above) are skipped, and one client's non-finite factors reach
    neither another client's rows nor its gradients (a client that diverges diverges alone, as it
    would trained apart)."""
    g = torch.Generator().manual_seed(0)
    m, r, d_in, d_out, s = 3, 2, 5, 4, 0.5
    x = torch.randn(len(own), 3, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(m, r, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(m, d_out, r, generator=g, dtype=torch.float64, requires_grad=True)
    got = Rows(torch.tensor(own)).apply(x, a, b, s)
    want = torch.stack([s * (x[i] @ a[k].T @ b[k].T) for i, k in enumerate(own)])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)  # float64: rounding only
    bad = own[0]
    a2 = a.detach().clone()
    a2[bad, 0, 0] = float("inf")
    a2.requires_grad_(True)
    out = Rows(torch.tensor(own)).apply(x, a2, b, s)
    out.sum().backward()
    mine = torch.tensor([k == bad for k in own])
    assert not torch.isfinite(out[mine]).all() and torch.isfinite(out[~mine]).all()
    assert torch.isfinite(x.grad[~mine]).all()
    others = [k for k in range(m) if k != bad]
    assert torch.isfinite(a2.grad[others]).all() and torch.isfinite(b.grad[others]).all()
    with pytest.raises(IndexError, match="owner 3 has no factors"):
        Rows(torch.tensor([3, 0])).apply(x[:2], a, b, s)


@pytest.mark.parametrize("model", [{}, LM], ids=["encoder", "causal_lm"])
def test_each_row_through_its_clients_factors_equals_each_client_alone(text_cfg, model):
    """Three clients whose PRIVATE LoRA factors differ (PFAdapter: value/output), their GLOBAL
    ones shared: one predict over the union, each text Owned by its client, against each
    client's model loaded and scored alone; a text scored by two clients gets two answers."""
    exp = build(text_cfg(**PF, **model))
    m = exp.model
    texts = exp.data.test_texts[:12]
    glob = {n: t for n, t in _client_params(exp, 0).items() if n in exp.global_names}
    clients = [{**glob, **{n: t for n, t in _client_params(exp, k).items() if n in exp.private_names}}
               for k in range(3)]
    alone = []
    for p in clients:
        m.load_params(p)
        alone.append(m.predict(texts, 5))
    m.load_params(clients[0])
    factors = {}
    for mod in sorted({n.split(".lora_")[0] for n in exp.private_names if ".lora_" in n}):
        a = torch.stack([p[f"{mod}.lora_A.default.weight"] for p in clients])
        b = torch.stack([p[f"{mod}.lora_B.default.weight"] for p in clients])
        factors[mod] = (a, b)
    owned = [Owned(t, k) for k in range(3) for t in texts]
    with grouped(m, factors):
        union = m.predict(owned, 5)
    for k in range(3):
        got = union[k * len(texts):(k + 1) * len(texts)]
        assert _rel(got, alone[k]) < RTOL, k
    assert _rel(alone[1], alone[0]) > 1e-2  # the clients' models do differ: the grouping matters
    m.load_params(clients[2])
    assert _rel(m.predict(texts, 5), alone[2]) == 0  # restored: the model's own LoRA again
    with grouped(m, factors), pytest.raises(RuntimeError, match="no owners"):
        m.predict(texts, 5)


@pytest.mark.parametrize("cache,model", [("true", {}), ("false", {}), ("true", LM)],
                         ids=["encoder", "encoder-no-cache", "causal_lm"])
def test_batched_pm_equals_each_client_alone(text_cfg, cache, model):
    """After a trained round (every client's PRIVATE factors its own), the in-process runtime's
    batched evaluate gives each client the metrics tasks.evaluate gives it alone; round 0's PM
    (the zero-shot cache, no forward) too. Without caches the frozen class side is recomputed
    inside the grouped pass, with peft's adapters disabled: grouped LoRA must step aside too."""
    from fedsplice.runtimes.inprocess import InProcess, run_rounds

    n = len(build(text_cfg(**PF, **model)).train_ids)
    exp = build(text_cfg(**PF, **model, server__rounds=1, server__clients_per_round=n, runtime__batch_eval='"auto"',
                         runtime__cache=cache))
    assert exp.batch_eval  # runtime.batch_eval = "auto" applies to PFAdapter on a text dual encoder
    store = MemoryStore()
    g = run_rounds(exp, store, lambda r: None)["global_params"]
    down = wire.encode(g)
    batched = InProcess(exp, store).run("evaluate", exp.train_ids, down)
    alone = {c: tasks.evaluate(exp, store, c, g) for c in exp.train_ids}
    assert sorted(batched) == sorted(alone)
    for c in exp.train_ids:
        for k, v in alone[c].items():
            if k == "tkl":  # a KL of near-equal distributions: rounding of the logits, not relative to it
                assert batched[c][k] == pytest.approx(v, abs=TKL_ATOL), (c, k)
            elif isinstance(v, float):
                assert batched[c][k] == pytest.approx(v, rel=RTOL, abs=1e-9), (c, k)
            else:
                assert batched[c][k] == v, (c, k)
    fresh = build(text_cfg(**PF, **model, runtime__batch_eval='"auto"', runtime__cache=cache))
    zero = InProcess(fresh, MemoryStore()).run("evaluate", fresh.train_ids, wire.encode(
        {n_: fresh.init_params[n_] for n_ in fresh.global_names}))
    one = tasks.evaluate(fresh, MemoryStore(), 0, {n_: fresh.init_params[n_] for n_ in fresh.global_names})
    if cache == "true" and not model:  # both from the zero-shot cache (a causal LM has none: zero_shot_cached)
        assert zero[0] == one
    else:  # both computed: TKL to zero-shot is then rounding, ~1e-8
        assert zero[0]["tkl"] == pytest.approx(one["tkl"], abs=TKL_ATOL)
        assert {k: v for k, v in zero[0].items() if k != "tkl"} == {k: v for k, v in one.items() if k != "tkl"}


@pytest.mark.parametrize("sets,match", [
    (["runtime.workers=2"], "every client in one process"),
    (["algorithm=\"pfedlora\"", "method={}"], "adds LoRA parts of its own"),
    (["algorithm=\"hetlora\"", "method={r_min = 1, ranks = [1, 2]}"], "scores its PM with a rule of its own"),
    (["peft.type=\"prompt\"", "model.task=\"dual_encoder\""], "groups the LoRA factors of a text model"),
])
def test_batch_eval_on_where_it_cannot_apply_is_refused(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(**PF), ["runtime.batch_eval=\"on\"", *sets], match)


def test_batch_eval_off_and_where_refused_scores_each_client_alone(tiny_cfg):
    assert not build(tiny_cfg(**PF, runtime__batch_eval='"off"')).batch_eval
    assert not build(tiny_cfg(algorithm='"fedpurel"', method="{}", runtime__batch_eval='"auto"')).batch_eval


@pytest.mark.parametrize("method", ["cache", "full"])
def test_a_causal_lms_verbalizer_names_each_rows_owner_in_every_call(text_cfg, method, monkeypatch):
    """model.verbalizer under model.grouped, both ways it lays out rows: the prompt pass and the
    continuations on the gathered KV cache (a continuation is its prompt's owner's), or one row
    per prompt and answer (row b·C + c is prompt b's): each client's scores equal its model's alone.
    Every call's rows arrive ordered by owner (the grouped layers' segments are slices)."""
    import fedsplice.model.grouped as G
    from fedsplice.model.verbalizer import tokenize_answers, verbalizer_logits

    seen: list[list[int]] = []

    class Spy(G.Rows):
        def __init__(self, own):
            super().__init__(own)
            seen.append(own.tolist())

    monkeypatch.setattr(G, "Rows", Spy)

    exp = build(text_cfg(**PF, **LM))
    m = exp.model
    lm, tok, names = m.backbone, m.tokenizer, m.class_names
    # one single-token answer, three of two tokens: three continuations a prompt (rows b·M + j)
    answers = [f" {names[0]}"] + [f" {c} {c}" for c in names[1:]] + [f" {names[0]} {names[1]}"]
    assert [len(a) for a in tokenize_answers(tok, answers)].count(2) >= 3
    prompts = [f"q: {t} a:" for t in exp.data.test_texts[:5]]
    clients = [_client_params(exp, k) for k in range(2)]
    alone = []
    for p in clients:
        m.load_params(p)
        with torch.no_grad():
            alone.append(verbalizer_logits(lm, tok, prompts, answers, method=method))
    owners = [(i % 5 + i // 5) % 2 for i in range(10)]  # interleaved: 0 1 0 1 0, then 1 0 1 0 1 (each prompt twice)
    mixed = [Owned(prompts[i % 5], k) for i, k in enumerate(owners)]
    with torch.no_grad(), grouped(m, stacked(lora_modules(exp.model.trainable()), clients)):
        union = verbalizer_logits(lm, tok, mixed, answers, method=method)
    for i, k in enumerate(owners):
        assert _rel(union[i], alone[k][i % 5]) < RTOL, (i, k)
    assert _rel(alone[1], alone[0]) > 1e-2
    assert len(seen) >= (2 if method == "cache" else 1) and all(o == sorted(o) and len(set(o)) == 2 for o in seen)
