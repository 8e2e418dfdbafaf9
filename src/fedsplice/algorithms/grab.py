"""Fed-GraB (Xiao et al., NeurIPS 2023): Self-adjusting Gradient Balancer + Direct Prior Analyzer,
a switch (`[switch.grab]`) that composes with any method training on the plain cross-entropy.
This file is the whole of it: the math, its settings, its per-client state, its checks.

SGB, per client, per class c, per training step t (all vectors over the C classes):
  ΔG_c    = a·G⁺_c − b·G⁻_c                      accumulated positive / negative logit gradients
  e_t     = 0 − ΔG                               the controller error (set point 0)
  u_t     = clip(u_{t−1} + Kp(e_t − e_{t−1}) + Ki·e_t + Kd(e_t − 2e_{t−1} + e_{t−2}), ±u_max)
                                                  incremental (delta) PID, open controllers only
  w⁺ = f(u), w⁻ = f(−u),  f(x) = (1+β)/(β + exp(−λx))   (β = 1/9, λ = 0.01: f(0) = 1)
  ∂L/∂z_ic ← W_ic·(p_ic − y_ic)/N,  W_ic = w⁺_c if y_i = c else w⁻_c
  G⁺_c += Σ_i |∂L/∂z_ic|·y_ic,  G⁻_c += Σ_i |∂L/∂z_ic|·(1 − y_ic)
with p = softmax(z) (the method's own cross-entropy; default, a = b = 1) or sigmoid(z) (the
official code's one-vs-all BCE summed over classes, a = 50, b = 0.5). The controllers of head
classes stay closed (u = 0, so w⁺ = w⁻ = 1, error history zero).

DPA: the global prior P̂ is read off the global model without data: `prior_from_responses`
(mean softmax of the model's logits on content-free inputs) or `prior_from_weight_norms`
(‖w_c‖ of a linear classifier, normalized); class c is tail when P̂_c < tail_ratio / C.

The controllers' state (G⁺, G⁻, error history, PID output) is PRIVATE client state, kept
between the client's rounds (Link.state) and never sent.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from fedsplice.algorithms.recipe import Link, Switch
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.algorithms.hooks import ClientOps, Tensors
    from fedsplice.algorithms.recipe import Recipe
    from fedsplice.config import ExperimentConfig

MAP_BETA = 1.0 / 9.0  # f(x) = (1+β)/(β + exp(−λx)): the official code's (10/9)/(1/9 + e^{−0.01x})
MAP_LAMBDA = 0.01
STATE_KEYS = ("pos", "neg", "err", "out")  # what a client keeps between rounds (PRIVATE)
# (a, b) per loss: the official code's 50 / 0.5 with its one-vs-all BCE (set point G⁺/G⁻ = 0.01);
# 1 / 1 with softmax CE, whose per-sample positive and negative gradients are equal in sum
DEFAULT_SCALES = {"sigmoid": (50.0, 0.5), "softmax": (1.0, 1.0)}


@dataclass(frozen=True)
class GrabParams:
    """The [switch.grab] table (the official code's defaults)."""

    kp: float = 10.0  # PID gains
    ki: float = 0.0
    kd: float = 0.0
    # PID error = -(pos_scale * G+ - neg_scale * G-), set point 0; 0 = the loss's default:
    # sigmoid 50 / 0.5 (the official code), softmax 1 / 1 (G+ = G-, the balance CE keeps on average)
    pos_scale: float = 0.0
    neg_scale: float = 0.0
    out_limit: float = 100.0  # u_max, the |PID output| bound
    # which classes the controllers steer: all (the official code, which never runs its prior
    # analyzer), or those whose prior, estimated from the global model's response to a
    # content-free input, is below tail_ratio / num_classes (our reading of the paper's DPA)
    prior: Literal["all", "content-free"] = "all"
    tail_ratio: float = 1.0  # tail: P̂_c < tail_ratio / C
    # softmax: re-weight the method's own CE; sigmoid: the official code's one-vs-all BCE (saturates
    # on CLIP-style scaled cosine logits: every sigmoid near 1, no positive gradient)
    loss: Literal["softmax", "sigmoid"] = "softmax"

    def check(self) -> None:
        for name, lo, strict in (("kp", 0, False), ("ki", 0, False), ("kd", 0, False), ("pos_scale", 0, False),
                                 ("neg_scale", 0, False), ("out_limit", 0, True), ("tail_ratio", 0, False)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if strict else v >= lo)):
                raise ConfigError(f"switch.grab.{name} must be a finite number {'>' if strict else '>='} {lo}, "
                                  f"got {v}")
        if self.loss not in ("sigmoid", "softmax"):
            raise ConfigError(f"switch.grab.loss must be 'sigmoid' or 'softmax', got {self.loss!r}")
        if self.prior not in ("all", "content-free"):
            raise ConfigError(f"switch.grab.prior must be 'all' (every class tail, the official code) or "
                              f"'content-free' (the estimated prior), got {self.prior!r}")


def map_weight(x: torch.Tensor) -> torch.Tensor:
    """f(x) = (1+β)/(β + exp(−λx)): 1 at 0, rising to (1+β)/β = 10, falling to 0."""
    return (1.0 + MAP_BETA) / (MAP_BETA + torch.exp(-MAP_LAMBDA * x))


def fresh_state(num_classes: int) -> dict[str, torch.Tensor]:
    z = torch.zeros(num_classes)
    return {"pos": z.clone(), "neg": z.clone(), "err": torch.zeros(3, num_classes), "out": z.clone()}


def pid_step(err: torch.Tensor, out: torch.Tensor, e_new: torch.Tensor, open_mask: torch.Tensor,
             kp: float, ki: float, kd: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One incremental PID step per class. err: [3, C] = (e_{t−1}, e_{t−2}, e_{t−3}) before the
    step; returns (new err history (e_t, e_{t−1}, e_{t−2}), new output u_t). Closed classes
    (open_mask False) get u = 0 and a zero history."""
    e1, e2 = err[0], err[1]
    delta = kp * (e_new - e1) + ki * e_new + kd * (e_new - 2.0 * e1 + e2)
    new_out = torch.clamp(out + delta, -limit, limit)
    m = open_mask.to(out.dtype)
    new_err = torch.stack([e_new, e1, e2]) * m
    return new_err, new_out * m


def class_weights(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w⁺, w⁻) = (f(u), f(−u))."""
    return map_weight(out), map_weight(-out)


def logit_grad(logits: torch.Tensor, y: torch.Tensor, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(base loss, ∂loss/∂logits) of the unweighted loss: mean CE, or one-vs-all BCE summed over
    classes and averaged over the batch (as in the official code)."""
    n, c = logits.shape
    target = F.one_hot(y, c).to(logits.dtype)
    if loss == "softmax":
        return F.cross_entropy(logits, y), (torch.softmax(logits.detach(), -1) - target) / n
    base = F.binary_cross_entropy_with_logits(logits, target, reduction="sum") / n
    return base, (torch.sigmoid(logits.detach()) - target) / n


def prior_from_responses(logits: torch.Tensor) -> torch.Tensor:
    """P̂ = mean over content-free inputs of softmax(z): the global model's own class prior."""
    return torch.softmax(logits.detach().double(), -1).mean(0).float()


def prior_from_weight_norms(weight: torch.Tensor) -> torch.Tensor:
    """P̂_c = ‖w_c‖ / Σ_j ‖w_j‖ for a linear classifier W [C, D]."""
    n: torch.Tensor = weight.detach().double().norm(dim=1)
    return (n / n.sum()).float()


def tail_mask(prior: torch.Tensor, tail_ratio: float) -> torch.Tensor:
    """Classes whose estimated prior is below tail_ratio · (1/C): their controllers open."""
    return prior < tail_ratio / prior.numel()


class Balancer:
    """One client's SGB: state (G⁺, G⁻, error history, PID output) + the tail mask of this round."""

    def __init__(self, params: GrabParams, state: dict[str, torch.Tensor], open_mask: torch.Tensor):
        self.p = params
        self.state = {k: state[k].clone() for k in STATE_KEYS}
        self.open = open_mask.clone().bool()
        closed = ~self.open  # a class leaving the tail: its controller is reset
        self.state["out"][closed] = 0.0
        self.state["err"][:, closed] = 0.0

    def scales(self) -> tuple[float, float]:
        a, b = DEFAULT_SCALES[self.p.loss]
        return self.p.pos_scale or a, self.p.neg_scale or b

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance the PID one step on ΔG and return this step's (w⁺, w⁻)."""
        s, p = self.state, self.p
        a, b = self.scales()
        diff = a * s["pos"] - b * s["neg"]
        s["err"], s["out"] = pid_step(s["err"], s["out"], -diff, self.open, p.kp, p.ki, p.kd, p.out_limit)
        return class_weights(s["out"])

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A loss whose value is the unweighted base loss and whose gradient w.r.t. the logits is
        W ⊙ (p − y)/N; accumulates the weighted |gradient| into G⁺ / G⁻."""
        w_pos, w_neg = self.weights()
        base, g = logit_grad(logits, y, self.p.loss)
        target = F.one_hot(y, logits.shape[1]).to(g.dtype)
        w = target * w_pos.to(g) + (1.0 - target) * w_neg.to(g)  # the state may live on the CPU
        gw = (w * g).detach()
        a = gw.abs()
        self.state["pos"] = self.state["pos"] + (a * target).sum(0).to(self.state["pos"])
        self.state["neg"] = self.state["neg"] + (a * (1.0 - target)).sum(0).to(self.state["neg"])
        surrogate = (gw * logits).sum()
        return base.detach() + surrogate - surrogate.detach()


def start(p: GrabParams, ops: ClientOps, kept: Tensors, received: Tensors) -> Link:
    """The client's balancer for one local training: the PID controllers of the tail classes
    open: every class (prior = "all", the official code), or those the Direct Prior Analyzer
    calls tail from the global model's class prior (GLOBAL + fresh PRIVATE tensors, its mean
    softmax on a content-free input "", no data); its state from what the client kept."""
    if p.prior == "all":
        mask = torch.ones(ops.num_classes, dtype=torch.bool)
    else:
        mask = tail_mask(prior_from_responses(ops.logits({**ops.fresh(), **received}, [""])), p.tail_ratio)
    state = {k: kept[k] for k in STATE_KEYS} if "pos" in kept else fresh_state(ops.num_classes)
    balancer = Balancer(p, state, mask)
    return Link(wrap=lambda inner: balancer.loss, state=lambda: dict(balancer.state))


def check_config(p: GrabParams, cfg: ExperimentConfig) -> None:
    if cfg.model.task == "generate":
        raise ConfigError("switch.grab: model.task = 'generate' answers in free text; Fed-GraB balances classes: "
                          "remove [switch.grab]")
    if cfg.privacy.local == "dpsgd":
        raise ConfigError("switch.grab: Fed-GraB re-weights the gradients of a whole batch, and privacy.local = "
                          "'dpsgd' clips each example's: remove [switch.grab] or set privacy.local = 'off'")


def check_recipe(p: GrabParams, cfg: ExperimentConfig, recipe: Recipe) -> None:
    if recipe.objective is not None:
        raise ConfigError(f"switch.grab re-weights the plain cross-entropy, and algorithm {cfg.algorithm!r} trains "
                          f"on an objective of its own: remove [switch.grab]")


# the settings before [switch.grab], as an earlier version wrote them
OLD_DEFAULTS: dict[str, Any] = {"enabled": False, **dataclasses.asdict(GrabParams())}


def moved(table: dict[str, Any]) -> None:
    """[grab] (enabled = true and its settings), and before it client.grab / client.grab_KEY, read
    as [switch.grab]; a setting at its old default is dropped (a saved run's config.toml wrote
    every default), one set while enabled was false is refused as before."""
    old = table.pop("grab", None)
    if old is not None and not isinstance(old, dict):
        raise ConfigError("grab: expected a table; Fed-GraB is now [switch.grab] (its presence turns it on)")
    client = table.get("client")
    legacy = {("enabled" if k == "grab" else k[5:]): client.pop(k) for k in list(client)
              if k == "grab" or k.startswith("grab_")} if isinstance(client, dict) else {}
    if old is None and not legacy:
        return
    old = {**legacy, **(old or {})}
    enabled = old.pop("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"grab.enabled must be true or false, got {enabled!r}")
    changed = {k: v for k, v in old.items() if k not in OLD_DEFAULTS or v != OLD_DEFAULTS[k]}
    if not enabled and changed:
        shown = ", ".join(f"grab.{k} = {v!r}" for k, v in changed.items())
        raise ConfigError(f"{shown} does nothing while grab.enabled = false: write [switch.grab] to turn Fed-GraB "
                          f"on, or remove it")
    switches = table.setdefault("switch", {})
    if isinstance(switches, dict) and "grab" in switches:  # a saved config never has both
        raise ConfigError(f"grab.enabled = {str(enabled).lower()} and [switch.grab] are both set: Fed-GraB is now "
                          f"[switch.grab] alone (switch.grab = false turns it off)")
    if enabled and isinstance(switches, dict):
        switches["grab"] = changed


GRAB = Switch(GrabParams, start, "Fed-GraB: PID-steered per-class re-weighting of the logit gradients",
              "Fed-GraB: Federated Long-tailed Learning with Self-Adjusting Gradient Balancer (NeurIPS 2023)",
              label="+grab", check_config=check_config, check_recipe=check_recipe, moved=moved)
