"""Fed-GraB (Xiao et al., NeurIPS 2023): Self-adjusting Gradient Balancer + Direct Prior Analyzer.

Pure math (torch only); the client loop reaches it through `ctx.grab` (a `Balancer`, fedsplice.core.context).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAP_BETA = 1.0 / 9.0  # f(x) = (1+β)/(β + exp(−λx)): the official code's (10/9)/(1/9 + e^{−0.01x})
MAP_LAMBDA = 0.01
STATE_KEYS = ("pos", "neg", "err", "out")  # what a client keeps between rounds (PRIVATE)
# (a, b) per loss: the official code's 50 / 0.5 with its one-vs-all BCE (set point G⁺/G⁻ = 0.01);
# 1 / 1 with softmax CE, whose per-sample positive and negative gradients are equal in sum
DEFAULT_SCALES = {"sigmoid": (50.0, 0.5), "softmax": (1.0, 1.0)}


@dataclass(frozen=True)
class GrabParams:
    kp: float = 10.0
    ki: float = 0.0
    kd: float = 0.0
    pos_scale: float = 0.0  # a in ΔG = a·G⁺ − b·G⁻; 0: the loss's default (DEFAULT_SCALES)
    neg_scale: float = 0.0  # b
    out_limit: float = 100.0  # u_max
    tail_ratio: float = 1.0  # tail: P̂_c < tail_ratio / C
    loss: str = "softmax"  # "softmax" (the method's CE) or "sigmoid" (the official code's BCE)


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
