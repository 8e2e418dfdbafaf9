"""A results group's setting, as text generated from the configs its runs used (never written
by hand, so that the page cannot say T_p = 10 while the runs used 2).

Each aspect (model, data, clients, budget, optimizers, FedPuReL's phase 2, evaluation) is read
from every run's resolved config. A value all experiments share is stated once. Where they
differ, the most common value is stated and the others are listed with their experiments.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from fedsplice.algorithms import method_params
from fedsplice.algorithms.fedpurel import FedPuReLParams
from fedsplice.config import ExperimentConfig


def _g(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _peft(c: ExperimentConfig) -> str:
    p = c.peft
    if p.type == "lora":
        s = f"LoRA r={p.r} α={_g(p.alpha)} on {','.join(p.roles)}" + (" (rsLoRA)" if p.use_rslora else "")
        return s
    if p.type == "prompt":
        return f"{p.n_ctx or 4} {p.prompt_init} context tokens"
    return p.type


def _data(c: ExperimentConfig) -> str:
    d = c.data
    s = d.dataset + (f", ≤{d.max_per_class} a class" if d.max_per_class else "")
    if d.imbalance > 1:
        s += f", long tail IF={_g(d.imbalance)} from n_max={d.n_max}, ranks by {d.long_tail_order}"
    return s


def _client_opt(c: ExperimentConfig) -> str:
    k = c.client
    s = f"{k.optimizer.upper() if k.optimizer == 'sgd' else 'AdamW'} lr {_g(k.lr)}"
    if k.optimizer == "sgd" and k.momentum:
        s += f" momentum {_g(k.momentum)}"
    if k.weight_decay:
        s += f" wd {_g(k.weight_decay)}"
    if k.max_grad_norm:
        s += f" grad norm ≤ {_g(k.max_grad_norm)}"
    sched: str = k.schedule
    if k.schedule == "cosine" and (k.lr_min or k.cosine_at != "round_start"):
        sched += f" to {_g(k.lr_min)}" + (" (read at each round's end)" if k.cosine_at == "round_end" else "")
    return s + f", {sched} lr, optimizer state {k.optimizer_state}"


def _server(c: ExperimentConfig) -> str:
    s = c.server
    if s.optimizer == "fedavg" and s.lr in (0.0, 1.0):
        return "FedAvg"
    extra = f" τ {_g(s.tau)}" if s.optimizer in ("fedadam", "fedyogi", "fedadagrad") else ""
    return f"{s.optimizer} η {_g(s.lr) if s.lr else 'default'}{extra}"


def _method(c: ExperimentConfig) -> str | None:
    """The algorithm's resolved [method] table (its defaults filled in), e.g. "promptfolio theta=0.2"."""
    params = dataclasses.asdict(method_params(c))
    return f"{c.algorithm} " + ", ".join(f"{k}={_g(v)}" for k, v in params.items()) if params else None


def _phase2(c: ExperimentConfig) -> str | None:
    if c.algorithm != "fedpurel":
        return None
    m, default = c.method, FedPuReLParams()
    if m.get("phase2", default.phase2) == "persistent":
        return "persistent (the branch trained in every round a client is sampled)"
    return f"after the rounds, T_p = {m.get('personal_rounds', default.personal_rounds)} rounds of the local budget"


ASPECTS = [
    ("model", lambda c: f"{c.model.name} ({c.model.task}), inputs cut at {c.model.max_length} tokens"),
    ("PEFT", _peft),
    ("data", _data),
    ("clients", lambda c: f"{c.data.num_clients} {c.data.partition}"
                          + (f"(α={_g(c.data.alpha)})" if c.data.partition == "dirichlet" else "")
                          + (f", {c.data.holdout_clients} held out" if c.data.holdout_clients else "")
                          + f", {c.server.clients_per_round} a round"),
    ("budget", lambda c: f"{c.server.rounds} rounds × {c.client.local_epochs} local epoch(s), "
                         f"batch {c.client.batch_size}"
                         + (f", at most {c.client.max_steps} steps" if c.client.max_steps else "")),
    ("client optimizer", _client_opt),
    ("server", _server),
    ("method settings", _method),
    ("FedPuReL phase 2", _phase2),
    ("evaluation", lambda c: f"every {c.eval.every} rounds; " + _tests(c)),
]


def _tests(c: ExperimentConfig) -> str:
    """Where the test sets come from: the local ones redrawn from the global set, or disjoint."""
    d = c.data
    if d.local_test == "disjoint":
        return (f"GM on {max(d.test_per_class, d.global_test_per_class)} test samples a class (at most: a class's "
                f"unused items may run out), PM on up to {d.local_test_size} local test samples a client, disjoint "
                f"from each other, the global test set and training")
    return (f"GM on {d.test_per_class} test samples a class, PM on {d.local_test_size} local test samples a client "
            f"redrawn from the global test set")


def setting_text(cfgs: dict[str, ExperimentConfig], label=lambda n: n) -> str:
    """One line per aspect over experiments {name: config} (one seed's config each)."""
    parts = []
    for aspect, read in ASPECTS:
        by = {n: v for n, c in cfgs.items() if (v := read(c)) is not None}
        if not by:
            continue
        common, _ = Counter(by.values()).most_common(1)[0]
        others: dict[str, list[str]] = {}
        for n, v in by.items():
            if v != common:
                others.setdefault(v, []).append(label(n))
        text = f"{aspect}: {common}"
        if others:
            text += " (" + "; ".join(f"{', '.join(ns)}: {v}" for v, ns in others.items()) + ")"
        parts.append(text)
    return "; ".join(parts)
