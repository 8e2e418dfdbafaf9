"""The one local training loop. Algorithms change it only through loss terms and grad transforms."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedsplice.config import ClientConfig


def make_optimizer(params: list[torch.nn.Parameter], cfg: ClientConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def export_opt_state(opt, names_by_param: dict, keep: set[str]) -> dict[str, torch.Tensor]:
    """Optimizer state of the `keep` parameters, as name-keyed tensors ("<param>/<slot>")."""
    out = {}
    for p, st in opt.state.items():
        name = names_by_param[p]
        if name in keep:
            for slot, v in st.items():
                if torch.is_tensor(v):
                    out[f"{name}/{slot}"] = v.detach().clone()
    return out


def import_opt_state(opt, params: dict[str, torch.nn.Parameter], state: dict[str, torch.Tensor]) -> None:
    for key, v in state.items():
        name, slot = key.rsplit("/", 1)
        opt.state[params[name]][slot] = v.clone()


def local_train(model, texts: list[str], labels: np.ndarray, *, cfg: ClientConfig, loss_terms,
                grad_transforms, keep_opt: set[str], opt_state: dict, rng: np.random.Generator,
                ctx: dict, epochs: int | None = None) -> tuple[dict, dict]:
    """Train the model's trainable tensors in place on one client's data.

    Returns the optimizer state of the `keep_opt` names (PRIVATE tensors: their Adam moments
    persist across rounds; GLOBAL tensors start each round fresh, as they are replaced by the
    server's) and training statistics.
    """
    params = model.trainable()
    names = sorted(params)
    opt = make_optimizer([params[n] for n in names], cfg)
    import_opt_state(opt, params, opt_state)
    by_param = {params[n]: n for n in names}
    y_all = torch.as_tensor(labels, dtype=torch.long)
    steps, loss_sum, task_sum, term_sums = 0, 0.0, 0.0, [0.0] * len(loss_terms)
    model.train()
    for _ in range(epochs or cfg.local_epochs):
        order = rng.permutation(len(texts))
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            logits = model([texts[j] for j in idx])
            task = F.cross_entropy(logits, y_all[idx])
            loss = task
            for t, term in enumerate(loss_terms):
                v = term(params, ctx)
                term_sums[t] += float(v.detach())
                loss = loss + v
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for transform in grad_transforms:
                transform(params, ctx)
            opt.step()
            steps += 1
            loss_sum += float(loss.detach())
            task_sum += float(task.detach())
            if cfg.max_steps and steps >= cfg.max_steps:
                break
        if cfg.max_steps and steps >= cfg.max_steps:
            break
    stats = {"steps": steps, "loss": loss_sum / max(steps, 1), "task_loss": task_sum / max(steps, 1)}
    for t, term in enumerate(loss_terms):
        stats[type(term).__name__.lower()] = term_sums[t] / max(steps, 1)
    return export_opt_state(opt, by_param, keep_opt), stats
