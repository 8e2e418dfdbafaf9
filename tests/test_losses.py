"""Loss terms: PFAdapter orthogonality (rank-space forms vs the d×d product) and FedProx."""

import pytest
import torch

from fedsplice.algorithms.baselines import FedProxState, Proximal
from fedsplice.core.context import TrainContext
from fedsplice.core.losses import Orthogonality, ortho_column, ortho_naive, ortho_row, proximal
from fedsplice.core.split import ParamInfo
from fedsplice.errors import ConfigError


def _lora(out, inp, r, gen, dtype=torch.float64):
    """(A: r×in, B: out×r) with non-zero B (a trained adapter, not a fresh one)."""
    return (torch.randn(r, inp, generator=gen, dtype=dtype),
            torch.randn(out, r, generator=gen, dtype=dtype))


def _rel(a, b):
    return abs(float(a) - float(b)) / max(abs(float(b)), 1e-30)


# ----------------------------------------------------------------------------- the two forms


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_column_and_row_forms_equal_naive_square(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    a_g, b_g = _lora(16, 16, 4, gen, dtype)
    a_p, b_p = _lora(16, 16, 4, gen, dtype)
    s_g, s_p = 2.0, 0.5
    col = ortho_column(a_g, b_g, a_p, b_p, s_g, s_p)
    row = ortho_row(a_g, b_g, a_p, b_p, s_g, s_p)
    naive_col = ortho_naive(a_g, b_g, a_p, b_p, s_g, s_p, form="column")
    naive_row = ortho_naive(a_g, b_g, a_p, b_p, s_g, s_p, form="row")
    assert float(naive_col) > 1.0 and float(naive_row) > 1.0  # not a vacuous 0 == 0
    assert _rel(col, naive_col) < 1e-4
    assert _rel(row, naive_row) < 1e-4
    # the two forms measure different things (ΔW_gᵀΔW_p vs ΔW_gΔW_pᵀ): they must not coincide
    assert _rel(col, row) > 1e-3


def test_naive_reference_is_the_frobenius_norm_of_the_dxd_product():
    gen = torch.Generator().manual_seed(5)
    a_g, b_g = _lora(16, 16, 4, gen)
    a_p, b_p = _lora(16, 16, 4, gen)
    dw_g, dw_p = 3.0 * b_g @ a_g, 3.0 * b_p @ a_p
    assert _rel(ortho_naive(a_g, b_g, a_p, b_p, 3.0, 3.0, "column"),
                torch.linalg.matrix_norm(dw_g.T @ dw_p) ** 2) < 1e-12
    assert _rel(ortho_naive(a_g, b_g, a_p, b_p, 3.0, 3.0, "row"),
                torch.linalg.matrix_norm(dw_g @ dw_p.T) ** 2) < 1e-12


def test_row_form_handles_gqa_rectangular_outputs():
    # q: 32 outputs, v: 16 outputs (grouped-query attention), same 32-wide input.
    gen = torch.Generator().manual_seed(3)
    a_q, b_q = _lora(32, 32, 4, gen)
    a_v, b_v = _lora(16, 32, 4, gen)
    row = ortho_row(a_q, b_q, a_v, b_v, 2.0, 2.0)
    naive = ortho_naive(a_q, b_q, a_v, b_v, 2.0, 2.0, form="row")
    assert float(naive) > 1.0
    assert _rel(row, naive) < 1e-4
    with pytest.raises(RuntimeError):  # the column form has no meaning here: shapes don't chain
        ortho_naive(a_q, b_q, a_v, b_v, 2.0, 2.0, form="column")


def test_rank_one_case_by_hand():
    # r = 1: ΔW = s·b·aᵀ. Column: ‖ΔW_gᵀΔW_p‖² = (s_g s_p)²(b_g·b_p)²‖a_g‖²‖a_p‖²
    #   a_g=[1,2], b_g=[1,0,1], a_p=[3,-1], b_p=[2,1,0], s=2:  16 · 2² · 5 · 10 = 3200.
    # Row: ‖ΔW_gΔW_pᵀ‖² = (s_g s_p)²(a_g·a_p)²‖b_g‖²‖b_p‖² = 16 · 1² · 2 · 5 = 160.
    a_g = torch.tensor([[1.0, 2.0]])
    b_g = torch.tensor([[1.0], [0.0], [1.0]])
    a_p = torch.tensor([[3.0, -1.0]])
    b_p = torch.tensor([[2.0], [1.0], [0.0]])
    assert float(ortho_column(a_g, b_g, a_p, b_p, 2.0, 2.0)) == pytest.approx(3200.0, rel=1e-6)
    assert float(ortho_naive(a_g, b_g, a_p, b_p, 2.0, 2.0, "column")) == pytest.approx(3200.0, rel=1e-6)
    assert float(ortho_row(a_g, b_g, a_p, b_p, 2.0, 2.0)) == pytest.approx(160.0, rel=1e-6)
    assert float(ortho_naive(a_g, b_g, a_p, b_p, 2.0, 2.0, "row")) == pytest.approx(160.0, rel=1e-6)
    # orthogonal B columns: the updates write to orthogonal output spaces -> exactly 0
    b_p0 = torch.tensor([[0.0], [5.0], [0.0]])
    assert float(ortho_column(a_g, b_g, a_p, b_p0, 2.0, 2.0)) == 0.0


def test_scaling_enters_to_the_fourth_power():
    gen = torch.Generator().manual_seed(11)
    a_g, b_g = _lora(16, 16, 4, gen)
    a_p, b_p = _lora(16, 16, 4, gen)
    for f in (ortho_column, ortho_row):
        base = float(f(a_g, b_g, a_p, b_p, 1.0, 1.0))
        assert _rel(f(a_g, b_g, a_p, b_p, 2.0, 2.0), 16.0 * base) < 1e-12  # s⁴
        assert _rel(f(a_g, b_g, a_p, b_p, 3.0, 0.5), (1.5**2) * base) < 1e-12  # (s_g s_p)²


def test_rank_space_forms_are_differentiable_like_naive():
    gen = torch.Generator().manual_seed(2)
    a_g, b_g = _lora(16, 16, 4, gen)
    a_p, b_p = _lora(16, 16, 4, gen)
    grads = []
    for f in (lambda *t: ortho_column(*t, 2.0, 2.0), lambda *t: ortho_naive(*t, 2.0, 2.0, "column")):
        ts = [t.clone().requires_grad_(True) for t in (a_g, b_g, a_p, b_p)]
        f(*ts).backward()
        grads.append([t.grad for t in ts])
    for g1, g2 in zip(*grads):
        assert torch.allclose(g1, g2, rtol=1e-8, atol=1e-8)


# ----------------------------------------------------------------------------- Orthogonality


def _task_model(cfg_factory, model_dir, toy_jsonl, **kw):
    from fedsplice.model.taskmodel import TaskModel

    cfg = cfg_factory(model_dir, toy_jsonl, **kw)
    return TaskModel(cfg, ["sports", "science", "music"])


@pytest.fixture(scope="module")
def llama_model(cfg_factory, tiny_llama_dir, toy_jsonl):
    return _task_model(cfg_factory, tiny_llama_dir, toy_jsonl, model__task='"causal_lm"')


def test_orthogonality_on_gqa_llama_picks_forms_and_matches_naive(llama_model):
    m = llama_model
    infos = m.param_infos()
    params = {n: p.detach().clone() for n, p in m.trainable().items()}
    shapes = {n: p.shape for n, p in params.items()}
    scal = m.scalings()
    assert set(scal) == set(params)
    assert all(s == 2.0 for s in scal.values())  # alpha 8 / r 4

    # GQA: q and o 32 outputs, k and v 16; every input is 32 wide
    role_out = {}
    for n, i in infos.items():
        if i.factor == "B":
            role_out.setdefault(i.role, set()).add(shapes[n][0])
    assert role_out == {"q": {32}, "k": {16}, "v": {16}, "o": {32}}

    fresh = Orthogonality(infos, shapes, scal, ["q", "k"], 0.1)
    assert float(fresh(params)) == 0.0  # fresh LoRA: B = 0

    gen = torch.Generator().manual_seed(0)
    for n, i in infos.items():
        if i.factor == "B":
            params[n] = torch.randn(shapes[n], generator=gen) * 0.1
    lam = 0.25
    term = Orthogonality(infos, shapes, scal, ["q", "k"], lam)
    layers = sorted({i.layer for i in infos.values()})
    assert len(layers) == 2
    assert len(term.pairs) == 2 * 4  # layers × {q,k}×{v,o}

    forms = {}
    for pr in term.pairs:
        forms[(infos[pr.a_g].role, infos[pr.a_p].role)] = pr.form
        assert infos[pr.a_g].layer == infos[pr.b_g].layer == infos[pr.a_p].layer == infos[pr.b_p].layer
        assert (infos[pr.a_g].factor, infos[pr.b_g].factor) == ("A", "B")
    assert forms == {("q", "v"): "row", ("k", "o"): "row", ("q", "o"): "column", ("k", "v"): "column"}

    # by hand: λ · Σ_layers Σ_{g∈{q,k}} Σ_{p∈{v,o}} naive d×d product, forms as above
    by = {(i.layer, i.role, i.factor): n for n, i in infos.items()}
    expected = 0.0
    for layer in layers:
        for g in ("q", "k"):
            for p in ("v", "o"):
                form = forms[(g, p)]
                expected += float(ortho_naive(params[by[layer, g, "A"]].double(), params[by[layer, g, "B"]].double(),
                                              params[by[layer, p, "A"]].double(), params[by[layer, p, "B"]].double(),
                                              2.0, 2.0, form))
    got = float(term(params))
    assert expected > 0
    assert _rel(got, lam * expected) < 1e-4


def test_orthogonality_on_bert_is_all_column_and_respects_global_roles(cfg_factory, tiny_bert_dir, toy_jsonl):
    m = _task_model(cfg_factory, tiny_bert_dir, toy_jsonl)
    infos = m.param_infos()
    shapes = {n: p.shape for n, p in m.trainable().items()}
    term = Orthogonality(infos, shapes, m.scalings(), ["q"], 1.0)
    assert len(term.pairs) == 2 * 3  # q vs k, v, o in each of 2 layers
    assert {pr.form for pr in term.pairs} == {"column"}
    assert {infos[pr.a_g].role for pr in term.pairs} == {"q"}
    assert {infos[pr.a_p].role for pr in term.pairs} == {"k", "v", "o"}


def test_orthogonality_refuses_when_no_size_matches():
    infos = {
        "l0.q.A": ParamInfo("q", "A", "l0", "lora"), "l0.q.B": ParamInfo("q", "B", "l0", "lora"),
        "l0.v.A": ParamInfo("v", "A", "l0", "lora"), "l0.v.B": ParamInfo("v", "B", "l0", "lora"),
    }
    shapes = {"l0.q.A": torch.Size([4, 32]), "l0.q.B": torch.Size([32, 4]),
              "l0.v.A": torch.Size([4, 24]), "l0.v.B": torch.Size([16, 4])}
    scal = {n: 2.0 for n in infos}
    with pytest.raises(ConfigError, match="ortho_lambda"):
        Orthogonality(infos, shapes, scal, ["q"], 0.1)
    # input sizes match: accepted, in the row form
    shapes["l0.v.A"] = torch.Size([4, 32])
    assert [p.form for p in Orthogonality(infos, shapes, scal, ["q"], 0.1).pairs] == ["row"]


def test_orthogonality_in_float64_keeps_float64_scales():
    """Scalings that are not float32 numbers ((0.3·0.3)² = 0.0081 is off by 4e-8 in float32):
    a float64 run must match the float64 d×d reference to rounding, in both forms."""
    infos = {f"l0.{r}.{f}": ParamInfo(r, f, "l0", "lora") for r in ("q", "v", "o") for f in ("A", "B")}
    # q: 6 out x 4 in; v: 3 out x 4 in (row form with q); o: 6 out x 5 in (column form with q)
    dims = {"q": (6, 4), "v": (3, 4), "o": (6, 5)}
    scal = {"q": 0.3, "v": 0.7, "o": 1.3}
    gen = torch.Generator().manual_seed(4)
    params = {}
    for r, (out, inp) in dims.items():
        params[f"l0.{r}.A"], params[f"l0.{r}.B"] = _lora(out, inp, 2, gen)
    shapes = {n: t.shape for n, t in params.items()}
    scalings = {n: scal[n.split(".")[1]] for n in params}
    term = Orthogonality(infos, shapes, scalings, ["q"], 0.1)
    assert sorted((infos[pr.a_p].role, pr.form) for pr in term.pairs) == [("o", "column"), ("v", "row")]
    want = 0.1 * sum(float(ortho_naive(params["l0.q.A"], params["l0.q.B"], params[f"l0.{p}.A"], params[f"l0.{p}.B"],
                                       scal["q"], scal[p], form))
                     for p, form in (("v", "row"), ("o", "column")))
    got = term(params)
    assert got.dtype == torch.float64
    assert _rel(got, want) < 1e-13  # the float32 scale of before gave 2e-8
    # rank one by hand (as test_rank_one_case_by_hand) at s = 0.3:
    # (0.3·0.3)²·(b_g·b_p)²·‖a_g‖²·‖a_p‖² = 0.0081 · 4 · 5 · 10 = 1.62
    one = {n: ParamInfo(n[0], n[1], "l0", "lora") for n in ("qA", "qB", "vA", "vB")}
    p1 = {"qA": torch.tensor([[1.0, 2.0]]), "qB": torch.tensor([[1.0], [0.0], [1.0]]),
          "vA": torch.tensor([[3.0, -1.0]]), "vB": torch.tensor([[2.0], [1.0], [0.0]])}
    p1 = {n: t.double() for n, t in p1.items()}
    t1 = Orthogonality(one, {n: t.shape for n, t in p1.items()}, {n: 0.3 for n in one}, ["q"], 1.0)
    assert _rel(t1(p1), 1.62) < 1e-14


def test_orthogonality_without_private_roles_is_zero():
    infos = {"l0.q.A": ParamInfo("q", "A", "l0", "lora"), "l0.q.B": ParamInfo("q", "B", "l0", "lora")}
    shapes = {"l0.q.A": torch.Size([2, 4]), "l0.q.B": torch.Size([4, 2])}
    term = Orthogonality(infos, shapes, {n: 1.0 for n in infos}, ["q"], 0.1)
    assert term.pairs == []
    assert float(term({"l0.q.A": torch.ones(2, 4), "l0.q.B": torch.ones(4, 2)})) == 0.0


# ----------------------------------------------------------------------------- Proximal


def test_proximal_by_hand():
    params = {"x": torch.tensor([1.0, 2.0]), "y": torch.tensor([[3.0]]), "priv": torch.tensor([100.0])}
    ref = {"x": torch.tensor([0.0, 0.0]), "y": torch.tensor([[1.0]]), "priv": torch.tensor([0.0])}
    # ‖x - x0‖² = 1 + 4 = 5, ‖y - y0‖² = 4 -> 9; μ/2 · 9 with μ = 0.5 -> 2.25; PRIVATE not counted
    at = TrainContext(state=FedProxState(ref))
    assert float(Proximal(["x", "y"], 0.5)(params, at)) == pytest.approx(2.25)
    assert float(Proximal(["x", "y"], 0.5)(ref, at)) == 0.0
    assert float(proximal(params, ref, ["x", "y"], 0.5)) == pytest.approx(2.25)


def test_proximal_gradient_is_mu_times_difference():
    x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    ref = torch.tensor([0.5, 0.0, 0.5])
    Proximal(["x"], 0.2)({"x": x}, TrainContext(state=FedProxState({"x": ref}))).backward()
    assert torch.allclose(x.grad, 0.2 * (x.detach() - ref))
