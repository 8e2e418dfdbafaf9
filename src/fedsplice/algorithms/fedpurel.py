"""FedPuReL (../shared/papers/fedpurel.md; DESIGN §3.2): gradient purification and residual learning.

Phase 1 trains the GLOBAL PEFT with the task gradient purified against the gradient of a
temperature-aligned KL (TKL) toward the zero-shot predictions. Phase 2 freezes it and trains,
per client, a fresh private PEFT of the same type whose logits are added to the frozen global
logits: l = l_G + l_P.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

TAU_MIN, TAU_MAX, BISECTION_STEPS = 0.05, 20.0, 30


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) per row."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def temperature_for_entropy(logits: torch.Tensor, target: torch.Tensor, steps: int = BISECTION_STEPS,
                            lo: float = TAU_MIN, hi: float = TAU_MAX) -> torch.Tensor:
    """Per-row τ with H(softmax(a/τ)) = target, by vectorized bisection on [lo, hi].

    The entropy grows monotonically with τ, so bisection converges; we bisect geometrically
    (τ spans 2.6 decades) and clamp to the interval when the target lies outside it.
    """
    a = logits.detach().double()
    t = target.detach().double()
    lo_t = torch.full(t.shape, lo, dtype=torch.float64, device=a.device)
    hi_t = torch.full(t.shape, hi, dtype=torch.float64, device=a.device)
    for _ in range(steps):
        mid = (lo_t * hi_t).sqrt()
        too_cold = entropy(a / mid.unsqueeze(-1)) < t
        lo_t = torch.where(too_cold, mid, lo_t)
        hi_t = torch.where(too_cold, hi_t, mid)
    return (lo_t * hi_t).sqrt().to(logits.dtype)


def aligned_temperatures(f: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """τ_f, τ_z bringing both predictions to H* = ½(H(softmax f) + H(softmax z)); no gradient."""
    with torch.no_grad():
        h_star = 0.5 * (entropy(f.detach()) + entropy(z.detach()))
    return temperature_for_entropy(f, h_star), temperature_for_entropy(z, h_star)


def tkl(f: torch.Tensor, z: torch.Tensor, aligned: bool = True) -> torch.Tensor:
    """Per-sample KL(softmax(z/τ_z) ‖ softmax(f/τ_f)); τ's carry no gradient. aligned=False
    gives the plain KL (τ = 1), the paper's Table 6 ablation."""
    if aligned:
        tf, tz = aligned_temperatures(f, z)
        f, z = f / tf.unsqueeze(-1), z / tz.unsqueeze(-1)
    log_pz, log_pf = F.log_softmax(z.detach(), -1), F.log_softmax(f, -1)
    return (log_pz.exp() * (log_pz - log_pf)).sum(-1)


def project(g_task: torch.Tensor, g_align: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Remove the component of g_task opposing g_align (only when ⟨g_task, g_align⟩ < 0)."""
    dot = (g_task * g_align).sum()
    nrm = (g_align * g_align).sum()
    if dot < 0 and nrm > 0:
        return g_task - (dot / nrm) * g_align, True
    return g_task, False


def purification(granularity: str = "tensor"):
    """The grad transform: step with the purified task gradient only.

    granularity "tensor" projects each parameter tensor separately (the official code);
    "flat" projects the concatenation of all tensors (the paper's Eq. 5).
    """

    def transform(grads: dict[str, list[torch.Tensor]]):
        gt, ga = grads["task"], grads["align"]
        if granularity == "flat":
            flat_t = torch.cat([g.reshape(-1) for g in gt])
            flat_a = torch.cat([g.reshape(-1) for g in ga])
            out, hit = project(flat_t, flat_a)
            parts, i = [], 0
            for g in gt:
                parts.append(out[i:i + g.numel()].view_as(g))
                i += g.numel()
            return parts, {"purified_steps": float(hit), "purified_tensors": float(hit)}
        res = [project(a, b) for a, b in zip(gt, ga)]
        hits = [h for _, h in res]
        return [g for g, _ in res], {"purified_steps": float(any(hits)),
                                     "purified_tensors": float(np.mean(hits)) if hits else 0.0}

    return transform


@torch.no_grad()
def zero_shot_logits(model, texts: list[str]) -> torch.Tensor:
    was = model.training
    model.eval()  # as the cached logits are computed (predict): no dropout
    with model.zero_shot():
        z = model(texts)
    model.train(was)
    return z


def align_objective(aligned: bool = True):
    """Phase 1: from ONE forward, the task CE and the alignment loss toward zero-shot logits."""

    def objective(model, texts, y, ids, ctx):
        f = model(texts)
        if "zero_shot" in ctx:  # frozen work, cached once per run
            z = ctx["zero_shot"][torch.as_tensor(ids)]
        else:  # runtime.cache = false: an extra frozen forward every step, as the caches' reference
            z = zero_shot_logits(model, texts)
        return {"task": F.cross_entropy(f + ctx.get("logit_offset", 0.0), y),
                "align": tkl(f, z, aligned).mean()}

    return objective


def residual_objective(lam: float):
    """Phase 2: (1−λ)·CE(y, l_G + l_P) + λ·CE(y, l_P), l_G the frozen, cached global logits."""

    def objective(model, texts, y, ids, ctx):
        l_p = model(texts)
        l_g = ctx["global_logits"][torch.as_tensor(ids)]
        return {"task": (1 - lam) * F.cross_entropy(l_g + l_p, y) + lam * F.cross_entropy(l_p, y)}

    return objective


def personalize(exp, global_params: dict, lam: float, steps: int) -> list[dict]:
    """Phase 2 for every training client: cache l_G (the frozen global branch) on its data once,
    train a fresh PEFT of the same type as φ_k on the residual loss, and score l_G + l_P on its
    local test set. Nothing is communicated."""
    import dataclasses

    from fedsplice.federation.experiment import STREAM_CLIENT, rng
    from fedsplice.federation.simulation import _client_seed, score, train_context
    from fedsplice.federation.train import local_train

    model, d, bs = exp.model, exp.data, exp.cfg.eval.batch_size
    ccfg = dataclasses.replace(exp.cfg.client, max_steps=steps, local_epochs=max(steps, 1))
    fresh = {n: t.clone() for n, t in exp.init_params.items()}
    out = []
    for cid in exp.train_ids:
        c = exp.clients[cid]
        texts = [d.train_texts[i] for i in c.train_idx]
        test = [d.test_texts[i] for i in c.test_idx]
        model.load_params(global_params)
        l_g = torch.zeros(len(d.train_texts), len(d.class_names))
        l_g[torch.as_tensor(c.train_idx)] = model.predict(texts, bs)
        l_g_test = model.predict(test, bs)
        model.load_params(fresh)
        _client_seed(exp, -(10**6), cid)
        if steps > 0:  # 0: l_P stays at its fresh init (client.max_steps = 0 would mean "no cap")
            local_train(model, texts, d.train_labels[c.train_idx], cfg=ccfg, loss_terms=[],
                        objective=residual_objective(lam), ids=c.train_idx, keep_opt=set(), opt_state={},
                        rng=rng(exp.cfg, STREAM_CLIENT, 10**7, cid),
                        ctx=train_context(exp, cid, global_params, global_logits=l_g))
        logits = (l_g_test + model.predict(test, bs)).numpy()
        out.append(score(exp, d.test_labels[c.test_idx], logits, c.test_idx))
    model.load_params(global_params)
    return out
