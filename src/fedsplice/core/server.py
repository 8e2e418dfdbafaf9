"""Server side of a round: aggregate client deltas, then step a server optimizer.

The server sees only name-keyed tensor dicts (``Params``) holding the GLOBAL names.  A round is::

    delta = weighted_mean([deltas(c, global_params) for c in clients], num_samples)
    global_params, state = opt.update(delta, state, global_params)

Server optimizers follow optax: ``init(params) -> state`` and
``update(pseudo_grad, state, params) -> (new_params, new_state)`` are pure functions, and the state
is itself a flat dict of tensors ("m/<name>", "v/<name>", "step") so it can be checkpointed with
safetensors as-is.

FedAvg / FedAvgM: McMahan et al. 2017, Hsu et al. 2019 (https://arxiv.org/abs/1909.06335).
FedAdagrad / FedAdam / FedYogi: Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
Algorithm 2 (https://arxiv.org/abs/2003.00295).  The pseudo-gradient Δ is the mean client delta
(client - global), i.e. it already points downhill, so every optimizer *adds* its step.

Precision: deltas, their mean, the optimizer math and its state are float64 whatever the parameter
dtype (adapter tensors are small; bf16/fp16 moments would underflow); the new parameters are cast
back to each parameter's own dtype once, so FedAvg with lr = 1 reproduces a lone client exactly.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import NamedTuple

import torch

from fedsplice.errors import ConfigError

Params = dict[str, torch.Tensor]
State = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- aggregation


def _check_same_layout(ref: Params, other: Params, what: str) -> None:
    """Raise ValueError naming the first key whose name or shape differs."""
    for name in sorted(set(ref) ^ set(other)):
        raise ValueError(f"{what}: tensor {name!r} is present in only one of the two")
    for name, t in ref.items():
        if tuple(other[name].shape) != tuple(t.shape):
            raise ValueError(
                f"{what}: tensor {name!r} has shape {tuple(other[name].shape)}, "
                f"expected {tuple(t.shape)}"
            )


# A client's own aggregation weight of a GLOBAL tensor, in the statistics it uploads (as Flower
# clients report num_examples and more in their fit metrics): "weight/<tensor name>" replaces its
# sample count for that tensor (a method's Exchange.send, e.g. HetLoRA's sparsity weights).
OWN_WEIGHT = "weight/"


def own_weights(stats: Sequence[Mapping[str, float]]) -> dict[str, list[float]]:
    """{tensor name: [weight per upload]} from the uploads' "weight/<name>" statistics, each
    normalized over the round (equal weights where all are 0). A tensor weighed by some uploads
    and not by others is an error: its mean would mix weights with sample counts."""
    keys = sorted({k for s in stats for k in s if k.startswith(OWN_WEIGHT)})
    out = {}
    for k in keys:
        if not all(k in s for s in stats):
            raise ValueError(f"statistic {k!r}: some uploads of the round weigh this tensor, others do not "
                             f"(a method's Exchange.send must report it in every upload)")
        w = [float(s[k]) for s in stats]
        z = sum(w)
        out[k[len(OWN_WEIGHT):]] = [x / z for x in w] if z > 0 else [1.0 / len(w)] * len(w)
    return out


def weighted_mean(updates: list[Params], weights: Sequence[float]) -> Params:
    """Sample-weighted mean of name-keyed tensor dicts.

    ``weights`` are sample counts (any non-negative numbers, normalized here).  Summation runs in
    float64 so the mean does not depend on client order at float32 precision, and the result stays
    float64: the server optimizer casts once, so FedAvg with lr = 1 reproduces a lone client's
    model bit for bit.
    """
    if not updates:
        raise ValueError("weighted_mean: no updates")
    if len(updates) != len(weights):
        raise ValueError(f"weighted_mean: {len(updates)} updates but {len(weights)} weights")
    w = [float(x) for x in weights]
    if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"weighted_mean: weights must be finite, >= 0 and not all 0, got {w}")
    ref = updates[0]
    for i, u in enumerate(updates[1:], start=1):
        _check_same_layout(ref, u, f"weighted_mean: update {i} vs update 0")
    total = sum(w)
    out: Params = {}
    for name, t in ref.items():
        acc = torch.zeros(t.shape, dtype=torch.float64, device=t.device)
        for u, wi in zip(updates, w):
            acc = acc + u[name].to(torch.float64) * wi
        out[name] = acc / total
    return out


def deltas(client_params: Params, global_params: Params) -> Params:
    """Per-name ``client - global`` (the client's update), in float64 (cast once, by the optimizer)."""
    _check_same_layout(global_params, client_params, "deltas: client vs global")
    return {
        name: client_params[name].to(torch.float64) - g.to(torch.float64)
        for name, g in global_params.items()
    }


# ----------------------------------------------------------------------------- optimizers


class ServerOptimizer(NamedTuple):
    """A pure ``init``/``update`` pair (optax-style)."""

    init: Callable[[Params], State]
    update: Callable[[Params, State, Params], tuple[Params, State]]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # Adapter tensors are small: float64 server math costs nothing and rounds only once.
    return torch.float64


def _zeros(params: Params, prefix: str, fill: float = 0.0) -> State:
    return {
        f"{prefix}/{n}": torch.full(p.shape, fill, dtype=_compute_dtype(p), device=p.device)
        for n, p in params.items()
    }


def _step0() -> State:
    return {"step": torch.zeros((), dtype=torch.int64)}


def _check(field: str, value: object, ok: bool, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not ok:
        raise ConfigError(f"server.{field}: must be {allowed}, got {value!r}")


def _check_lr(lr: float) -> None:
    _check("lr", lr, isinstance(lr, Real) and float(lr) > 0, "> 0")


def _check_beta(field: str, b: float) -> None:
    _check(field, b, isinstance(b, Real) and 0 <= float(b) < 1, "in [0, 1)")


def _check_update_inputs(pseudo_grad: Params, params: Params) -> None:
    _check_same_layout(params, pseudo_grad, "server update: pseudo_grad vs params")


def fedavg(lr: float = 1.0) -> ServerOptimizer:
    """FedAvg server step ``x <- x + lr * Δ``; lr = 1 replaces x by the mean client model."""
    _check_lr(lr)

    def init(params: Params) -> State:
        return _step0()

    def update(pseudo_grad: Params, state: State, params: Params) -> tuple[Params, State]:
        _check_update_inputs(pseudo_grad, params)
        new = {}
        for n, x in params.items():
            cd = _compute_dtype(x)
            new[n] = (x.to(cd) + lr * pseudo_grad[n].to(cd)).to(x.dtype)
        return new, {"step": state["step"] + 1}

    return ServerOptimizer(init, update)


def fedavgm(lr: float = 1.0, momentum: float = 0.9) -> ServerOptimizer:
    """FedAvgM (Hsu et al. 2019): ``m <- momentum * m + Δ``; ``x <- x + lr * m``."""
    _check_lr(lr)
    _check_beta("momentum", momentum)

    def init(params: Params) -> State:
        return {**_zeros(params, "m"), **_step0()}

    def update(pseudo_grad: Params, state: State, params: Params) -> tuple[Params, State]:
        _check_update_inputs(pseudo_grad, params)
        new, new_state = {}, {"step": state["step"] + 1}
        for n, x in params.items():
            cd = _compute_dtype(x)
            m = momentum * state[f"m/{n}"] + pseudo_grad[n].to(cd)
            new[n] = (x.to(cd) + lr * m).to(x.dtype)
            new_state[f"m/{n}"] = m
        return new, new_state

    return ServerOptimizer(init, update)


def _adaptive(
    kind: str,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
    bias_correction: bool,
    initial_accumulator: float | None,
) -> ServerOptimizer:
    """Reddi et al. Alg. 2; ``kind`` only changes the second-moment rule."""
    _check_lr(lr)
    _check_beta("beta1", beta1)
    _check_beta("beta2", beta2)
    _check("tau", tau, isinstance(tau, Real) and tau > 0, "> 0")
    if not isinstance(bias_correction, bool):
        raise ConfigError(f"server.bias_correction: must be true or false, got {bias_correction!r}")
    if initial_accumulator is not None:
        _check(
            "initial_accumulator",
            initial_accumulator,
            isinstance(initial_accumulator, Real) and initial_accumulator >= 0,
            ">= 0 (or null for tau**2, the paper's choice)",
        )
    # The paper requires v_{-1} >= tau^2; Flower starts from 0, hence the knob.
    v0 = tau**2 if initial_accumulator is None else float(initial_accumulator)

    def init(params: Params) -> State:
        return {**_zeros(params, "m"), **_zeros(params, "v", v0), **_step0()}

    def update(pseudo_grad: Params, state: State, params: Params) -> tuple[Params, State]:
        _check_update_inputs(pseudo_grad, params)
        step = state["step"] + 1
        t = int(step)
        # Bias correction divides by (1 - beta^t) with t counted from 1 (Kingma & Ba).
        c1 = 1 - beta1**t if bias_correction else 1.0
        c2 = 1 - beta2**t if bias_correction else 1.0
        new, new_state = {}, {"step": step}
        for n, x in params.items():
            cd = _compute_dtype(x)
            d = pseudo_grad[n].to(cd)
            d2 = d * d
            m = beta1 * state[f"m/{n}"] + (1 - beta1) * d
            v_prev = state[f"v/{n}"]
            if kind == "adagrad":
                v = v_prev + d2
            elif kind == "adam":
                v = beta2 * v_prev + (1 - beta2) * d2
            else:  # yogi: additive, sign-controlled change keeps v from growing as fast as Adam's
                v = v_prev - (1 - beta2) * d2 * torch.sign(v_prev - d2)
            step_dir = (m / c1) / (torch.sqrt(v / c2) + tau)
            new[n] = (x.to(cd) + lr * step_dir).to(x.dtype)
            new_state[f"m/{n}"] = m
            new_state[f"v/{n}"] = v
        return new, new_state

    return ServerOptimizer(init, update)


def fedadam(
    lr: float = 1e-2,
    beta1: float = 0.9,
    beta2: float = 0.99,
    tau: float = 1e-3,
    bias_correction: bool = False,
    initial_accumulator: float | None = None,
) -> ServerOptimizer:
    """FedAdam (Reddi et al. 2021, Alg. 2).

    ``m = b1*m + (1-b1)*Δ``; ``v = b2*v + (1-b2)*Δ²``; ``x += lr * m / (sqrt(v) + tau)``.
    ``bias_correction=True`` uses ``m/(1-b1^t)``, ``v/(1-b2^t)`` (not in the paper; default off).
    ``initial_accumulator=None`` starts v at tau² (the paper); 0.0 matches Flower.
    """
    return _adaptive("adam", lr, beta1, beta2, tau, bias_correction, initial_accumulator)


def fedyogi(
    lr: float = 1e-2,
    beta1: float = 0.9,
    beta2: float = 0.99,
    tau: float = 1e-3,
    bias_correction: bool = False,
    initial_accumulator: float | None = None,
) -> ServerOptimizer:
    """FedYogi (Reddi et al. 2021, Alg. 2): as FedAdam but
    ``v = v - (1-b2) * Δ² * sign(v - Δ²)``.  Same flags as :func:`fedadam`."""
    return _adaptive("yogi", lr, beta1, beta2, tau, bias_correction, initial_accumulator)


def fedadagrad(
    lr: float = 1e-2,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
    beta1: float = 0.0,
) -> ServerOptimizer:
    """FedAdagrad (Reddi et al. 2021, Alg. 2): ``m = b1*m + (1-b1)*Δ``; ``v = v + Δ²``;
    ``x += lr * m / (sqrt(v) + tau)``.

    ``beta1`` is honoured as in Alg. 2, which gives FedAdagrad the same momentum on the
    pseudo-gradient as FedAdam/FedYogi.  Its default is 0.0 (``m = Δ``, plain Adagrad), not
    FedAdam's 0.9, on purpose: that is the FedAdagrad the paper analyses (its FedAdagrad theorem
    takes β1 = 0) and the one its experiment code ran (the server optimizer is Keras' Adagrad,
    which has no momentum term); Flower's FedAdagrad fixes beta_1 = 0 too.  So a config that
    does not set beta1 keeps those results, and one that does gets Alg. 2 with momentum.
    No bias correction: the Adagrad accumulator is a sum, not a moving average.
    """
    return _adaptive("adagrad", lr, beta1, 0.0, tau, False, initial_accumulator)


SERVER_OPTIMIZERS: dict[str, Callable[..., ServerOptimizer]] = {
    "fedavg": fedavg,
    "fedavgm": fedavgm,
    "fedadam": fedadam,
    "fedyogi": fedyogi,
    "fedadagrad": fedadagrad,
}


def make_server_optimizer(name: str, **kwargs: float | bool | None) -> ServerOptimizer:
    """Build a server optimizer from its config name and hyperparameters."""
    if name not in SERVER_OPTIMIZERS:
        raise ConfigError(
            f"server.optimizer: unknown {name!r}; choose one of {', '.join(SERVER_OPTIMIZERS)}"
        )
    factory = SERVER_OPTIMIZERS[name]
    allowed = list(inspect.signature(factory).parameters)
    for key in kwargs:
        if key not in allowed:
            raise ConfigError(
                f"server.{key}: not an option of {name!r}; choose from {', '.join(allowed)}"
            )
    return factory(**kwargs)
