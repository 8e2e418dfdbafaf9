"""Server aggregation and optimizers against hand-written scalar references (plain Python floats)."""

import math

import pytest
import torch

from fedsplice.core.server import (
    SERVER_OPTIMIZERS,
    deltas,
    fedadagrad,
    fedadam,
    fedavg,
    fedavgm,
    fedyogi,
    make_server_optimizer,
    own_weights,
    weighted_mean,
)
from fedsplice.errors import ConfigError

# Two tensors, three rounds.  Deltas mix large and small magnitudes and zeros so Yogi's
# sign(v - Δ²) takes both signs (round 1: Δ² > v, round 2 with |Δ| = 0.01 or 0: Δ² < v).
X0 = {"w": [[1.0, -2.0], [0.5, 0.0]], "b": [0.1, 0.2, -0.3]}
DELTAS = [
    {"w": [[0.5, -0.2], [0.0, 1.0]], "b": [0.3, -0.7, 0.05]},
    {"w": [[0.01, 0.4], [-0.3, -1.0]], "b": [0.0, 0.2, -0.05]},
    {"w": [[-0.6, 0.02], [0.1, 0.5]], "b": [-0.3, 0.7, 0.001]},
]


def _t(d, dtype=torch.float32):
    return {k: torch.tensor(v, dtype=dtype) for k, v in d.items()}


def _flat(v):
    return [y for x in v for y in _flat(x)] if isinstance(v, list) else [v]


# ---- hand-written references, one scalar at a time -------------------------------------------


def ref_fedavg(x, ds, lr):
    for d in ds:
        x = x + lr * d
    return x


def ref_fedavgm(x, ds, lr, mom):
    m = 0.0
    for d in ds:
        m = mom * m + d
        x = x + lr * m
    return x


def ref_adaptive(kind, x, ds, lr, b1, b2, tau, bc, v0):
    m, v = 0.0, v0
    for t, d in enumerate(ds, start=1):
        m = b1 * m + (1 - b1) * d
        if kind == "adagrad":
            v = v + d * d
        elif kind == "adam":
            v = b2 * v + (1 - b2) * d * d
        else:
            s = v - d * d
            sign = 1.0 if s > 0 else (-1.0 if s < 0 else 0.0)
            v = v - (1 - b2) * d * d * sign
        mh = m / (1 - b1**t) if bc else m
        vh = v / (1 - b2**t) if bc else v
        x = x + lr * mh / (math.sqrt(vh) + tau)
    return x


def run(opt, rounds=DELTAS, x0=X0, dtype=torch.float32):
    params = _t(x0, dtype)
    state = opt.init(params)
    for d in rounds:
        params, state = opt.update(_t(d, dtype), state, params)
    return params, state


def assert_matches_ref(params, ref_fn):
    for name in X0:
        xs, got = _flat(X0[name]), params[name].flatten().tolist()
        per_elem = [[_flat(r[name])[i] for r in DELTAS] for i in range(len(xs))]
        want = [ref_fn(x, ds) for x, ds in zip(xs, per_elem)]
        assert got == pytest.approx(want, abs=1e-6, rel=0), name


# ---- optimizers over 3 rounds ------------------------------------------------------------------


def test_fedavg_three_rounds():
    params, state = run(fedavg(lr=0.7))
    assert_matches_ref(params, lambda x, ds: ref_fedavg(x, ds, 0.7))
    assert int(state["step"]) == 3


def test_fedavgm_three_rounds():
    params, _ = run(fedavgm(lr=0.5, momentum=0.9))
    assert_matches_ref(params, lambda x, ds: ref_fedavgm(x, ds, 0.5, 0.9))


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("init_acc", [None, 0.0])
@pytest.mark.parametrize("kind,factory", [("adam", fedadam), ("yogi", fedyogi)])
def test_adam_yogi_three_rounds(kind, factory, bias_correction, init_acc):
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    opt = factory(lr=lr, beta1=b1, beta2=b2, tau=tau, bias_correction=bias_correction,
                  initial_accumulator=init_acc)
    params, state = run(opt)
    v0 = tau**2 if init_acc is None else init_acc
    assert_matches_ref(params, lambda x, ds: ref_adaptive(kind, x, ds, lr, b1, b2, tau,
                                                          bias_correction, v0))
    assert int(state["step"]) == 3


@pytest.mark.parametrize("init_acc", [None, 0.0])
@pytest.mark.parametrize("beta1", [0.0, 0.9])
def test_fedadagrad_three_rounds(init_acc, beta1):
    lr, tau = 0.1, 1e-3
    params, _ = run(fedadagrad(lr=lr, tau=tau, initial_accumulator=init_acc, beta1=beta1))
    v0 = tau**2 if init_acc is None else init_acc
    assert_matches_ref(params, lambda x, ds: ref_adaptive("adagrad", x, ds, lr, beta1, 0.0, tau,
                                                          False, v0))


def test_fedadam_first_round_literal():
    # By hand: m = 0.1*0.5 = 0.05; v = 0.01*0.25 = 0.0025; step = 0.05/(0.05+0.001) = 0.98039215...
    opt = fedadam(lr=1.0, initial_accumulator=0.0)
    params = {"x": torch.tensor([2.0])}
    new, _ = opt.update({"x": torch.tensor([0.5])}, opt.init(params), params)
    assert new["x"].item() == pytest.approx(2.0 + 0.05 / 0.051, abs=1e-6)


def test_fedadagrad_default_is_plain_adagrad():
    # beta1 defaults to 0, so round 1 is x + lr*Δ/(sqrt(tau² + Δ²) + tau).
    opt = fedadagrad(lr=0.1, tau=1e-3)
    params = {"x": torch.tensor([0.0])}
    new, _ = opt.update({"x": torch.tensor([0.5])}, opt.init(params), params)
    assert new["x"].item() == pytest.approx(0.1 * 0.5 / (math.sqrt(1e-6 + 0.25) + 1e-3), abs=1e-7)


def test_fedadagrad_momentum_two_steps_by_hand():
    # Alg. 2 with beta1 = 0.5, lr = 1, tau = 0.5, v starting at 0; Δ = 0.6, then 0.8:
    #   step 1: m = 0.5·0.6 = 0.3;             v = 0.36;        x = 0.3 / (0.6 + 0.5)  = 3/11
    #   step 2: m = 0.5·0.3 + 0.5·0.8 = 0.55;  v = 0.36 + 0.64 = 1;  x += 0.55 / (1 + 0.5) = 11/30
    opt = make_server_optimizer("fedadagrad", lr=1.0, tau=0.5, initial_accumulator=0.0, beta1=0.5)
    params = {"x": torch.tensor([0.0], dtype=torch.float64)}
    state = opt.init(params)
    params, state = opt.update({"x": torch.tensor([0.6], dtype=torch.float64)}, state, params)
    assert params["x"].item() == pytest.approx(3 / 11, rel=1e-15)
    params, state = opt.update({"x": torch.tensor([0.8], dtype=torch.float64)}, state, params)
    assert params["x"].item() == pytest.approx(3 / 11 + 11 / 30, rel=1e-15)
    assert state["m/x"].item() == pytest.approx(0.55, rel=1e-15)
    assert state["v/x"].item() == pytest.approx(1.0, rel=1e-15)
    # the default (beta1 = 0, plain Adagrad) on the same deltas: 6/11 + 8/15
    opt0 = make_server_optimizer("fedadagrad", lr=1.0, tau=0.5, initial_accumulator=0.0)
    p0 = {"x": torch.tensor([0.0], dtype=torch.float64)}
    s0 = opt0.init(p0)
    for d in (0.6, 0.8):
        p0, s0 = opt0.update({"x": torch.tensor([d], dtype=torch.float64)}, s0, p0)
    assert p0["x"].item() == pytest.approx(6 / 11 + 8 / 15, rel=1e-15)


def test_low_precision_params_keep_dtype_state_is_float64():
    params, state = run(fedadam(lr=0.1), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    assert state["m/w"].dtype == torch.float64 and state["v/b"].dtype == torch.float64


def test_state_is_flat_name_keyed_tensors():
    opt = fedyogi()
    state = opt.init(_t(X0))
    assert set(state) == {"m/w", "m/b", "v/w", "v/b", "step"}
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert state["step"].dtype == torch.int64 and state["step"].dim() == 0
    assert torch.all(state["v/w"] == 1e-6) and torch.all(state["m/b"] == 0)
    import safetensors.torch as safetensors_torch  # required: the checkpoints are safetensors

    back = safetensors_torch.load(safetensors_torch.save(state))
    assert all(torch.equal(back[k], state[k]) for k in state)


# ---- FedAvg identity and weighted mean ---------------------------------------------------------


def test_weighted_mean_of_copies_is_the_copy():
    g = torch.Generator().manual_seed(0)
    c = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    out = weighted_mean([c, c, c], [3, 7, 1])
    assert all(torch.equal(out[k], c[k]) for k in c)


def test_fedavg_of_identical_clients_reaches_client_params():
    # Values in [1, 2): client - global is exact in float32 (Sterbenz), so the round trip is exact.
    g = torch.Generator().manual_seed(1)
    glob = {"w": 1 + torch.rand(4, 3, generator=g), "b": 1 + torch.rand(5, generator=g)}
    client = {"w": 1 + torch.rand(4, 3, generator=g), "b": 1 + torch.rand(5, generator=g)}
    delta = weighted_mean([deltas(client, glob) for _ in range(4)], [10, 20, 30, 5])
    opt = fedavg(lr=1.0)
    new, _ = opt.update(delta, opt.init(glob), glob)
    assert all(torch.equal(new[k], client[k]) for k in client)


def test_weighted_mean_weights():
    a = {"x": torch.tensor([1.0, -2.0]), "y": torch.tensor([[0.5]])}
    b = {"x": torch.tensor([2.0, 6.0]), "y": torch.tensor([[4.0]])}
    out = weighted_mean([a, b], [1, 3])
    assert torch.equal(out["x"], torch.tensor([1.75, 4.0]))  # (1+6)/4, (-2+18)/4
    assert torch.equal(out["y"], torch.tensor([[3.125]]))  # (0.5+12)/4
    g = torch.Generator().manual_seed(2)
    a, b = {"x": torch.randn(7, generator=g)}, {"x": torch.randn(7, generator=g)}
    want = (a["x"].double() + 3 * b["x"].double()) / 4  # kept in float64 for the optimizer
    got = weighted_mean([a, b], [1, 3])["x"]
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_own_weights_are_normalized_per_tensor_over_the_round():
    """A client's "weight/<tensor>" statistics (a method's Exchange.send): normalized per tensor,
    equal where all are 0; other statistics are ignored; a tensor weighed by some uploads only is
    an error naming it."""
    stats = [{"loss": 1.0, "weight/a": 1.0, "weight/b": 0.0}, {"loss": 2.0, "weight/a": 3.0, "weight/b": 0.0}]
    assert own_weights(stats) == {"a": [0.25, 0.75], "b": [0.5, 0.5]}
    assert own_weights([{"loss": 1.0}, {"loss": 2.0}]) == {}
    with pytest.raises(ValueError, match="'weight/a'.*some uploads"):
        own_weights([{"weight/a": 1.0}, {"loss": 2.0}])


def test_weighted_mean_mismatch_raises_naming_key():
    a = {"x": torch.zeros(2), "y": torch.zeros(3)}
    with pytest.raises(ValueError, match="'y'"):
        weighted_mean([a, {"x": torch.zeros(2)}], [1, 1])
    with pytest.raises(ValueError, match="'z'"):
        weighted_mean([a, {**a, "z": torch.zeros(1)}], [1, 1])
    with pytest.raises(ValueError, match="'y'.*shape"):
        weighted_mean([a, {"x": torch.zeros(2), "y": torch.zeros(4)}], [1, 1])
    with pytest.raises(ValueError):
        weighted_mean([a, a], [1])
    with pytest.raises(ValueError):
        weighted_mean([a, a], [0, 0])
    with pytest.raises(ValueError, match="'y'"):
        deltas({"x": torch.zeros(2)}, a)


def test_update_rejects_mismatched_pseudo_grad():
    opt = fedadam()
    params = _t(X0)
    with pytest.raises(ValueError, match="'b'"):
        opt.update({"w": params["w"]}, opt.init(params), params)


# ---- purity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SERVER_OPTIMIZERS))
def test_update_does_not_mutate_inputs(name):
    opt = make_server_optimizer(name)
    params, state = _t(X0), None
    state = opt.init(params)
    for d in DELTAS:
        grad = _t(d)
        snap = [{k: v.clone() for k, v in x.items()} for x in (grad, state, params)]
        new_params, new_state = opt.update(grad, state, params)
        for before, after in zip(snap, (grad, state, params)):
            assert before.keys() == after.keys()
            assert all(torch.equal(before[k], after[k]) for k in before)
        # outputs never alias inputs, so mutating them later cannot corrupt the previous round
        inputs = {id(t) for x in (grad, state, params) for t in x.values()}
        assert not any(id(t) in inputs for x in (new_params, new_state) for t in x.values())
        params, state = new_params, new_state


# ---- configuration errors ----------------------------------------------------------------------


def test_unknown_optimizer_name():
    with pytest.raises(ConfigError, match=r"server\.optimizer: unknown 'sgd'; choose one of .*fedyogi"):
        make_server_optimizer("sgd")


def test_unknown_option_names_field():
    with pytest.raises(ConfigError, match=r"server\.momentum"):
        make_server_optimizer("fedadam", momentum=0.9)


@pytest.mark.parametrize(
    "name,kwargs,field",
    [
        ("fedavg", {"lr": 0.0}, "lr"),
        ("fedavg", {"lr": "0.1"}, "lr"),
        ("fedavgm", {"momentum": 1.0}, "momentum"),
        ("fedavgm", {"momentum": -0.1}, "momentum"),
        ("fedadam", {"lr": -1e-2}, "lr"),
        ("fedadam", {"beta1": 1.0}, "beta1"),
        ("fedyogi", {"beta2": -0.5}, "beta2"),
        ("fedyogi", {"tau": 0.0}, "tau"),
        ("fedadam", {"initial_accumulator": -1.0}, "initial_accumulator"),
        ("fedadam", {"bias_correction": "yes"}, "bias_correction"),
        ("fedadagrad", {"tau": float("nan")}, "tau"),
        ("fedadagrad", {"beta1": 1.5}, "beta1"),
    ],
)
def test_bad_hyperparameter(name, kwargs, field):
    with pytest.raises(ConfigError, match=rf"server\.{field}"):
        make_server_optimizer(name, **kwargs)
