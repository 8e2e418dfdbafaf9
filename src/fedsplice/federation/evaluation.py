"""Scoring: one client's metrics on its test samples, PM pooled over clients, and GM.

GM runs where the global test set is (the server in a deployment); per-client scoring runs in
the client tasks, where the client's data is (`fedsplice.federation.tasks`).
"""

from __future__ import annotations

import numpy as np
import torch

from fedsplice.core.tkl import tkl
from fedsplice.federation.metrics import classification_metrics, longtail_metrics, per_class_counts, summarize_clients


def score(exp, labels: np.ndarray, logits: np.ndarray, test_idx: np.ndarray) -> dict:
    """Metrics of logits on test samples `test_idx`, with what pooling needs: per-class counts of
    the model and of the zero-shot model on the same samples, and TKL to zero-shot."""
    c = len(exp.data.class_names)
    m = classification_metrics(labels, logits, c)
    zs = exp.caches["zero_shot_test"][torch.as_tensor(test_idx)]
    correct, total = per_class_counts(labels, logits.argmax(1), c)
    zs_correct, _ = per_class_counts(labels, zs.numpy().argmax(1), c)
    m["tkl"] = float(tkl(torch.as_tensor(logits), zs).mean())
    m.update(class_correct=correct.tolist(), class_total=total.tolist(), zs_class_correct=zs_correct.tolist())
    return m


def with_longtail(exp, m: dict, correct, total, zs_correct) -> dict:
    e = exp.cfg.eval
    out = {k: v for k, v in m.items() if not isinstance(v, list)}
    out.update(longtail_metrics(correct, total, zs_correct, exp.caches["train_counts"],
                                many=e.many_threshold, few=e.few_threshold, sigma=e.balancedness_sigma))
    # per class, in class order (None: no test sample of that class): the head-to-tail plots
    out["class_accuracy"] = [float(c / t) if t else None for c, t in zip(correct, total)]
    return out


def summarize_pm(exp, per_client: list[dict]) -> dict:
    """PM: scalar metrics averaged over ALL clients (accuracy also std/min/max); the long-tail
    metrics pool the clients' local test predictions (per-class counts summed)."""
    pooled = [np.sum([m[k] for m in per_client], axis=0) for k in ("class_correct", "class_total",
                                                                  "zs_class_correct")]
    return with_longtail(exp, summarize_clients(per_client), *pooled)


def evaluate_global(exp, global_params: dict) -> dict:
    """GM: GLOBAL tensors + fresh PRIVATE ones on the balanced global test set (the first
    global_test_size test samples; a scenario's transformed local test copies follow it)."""
    d = exp.data
    size = d.global_test_size
    fresh = {n: exp.init_params[n] for n in exp.private_names}
    exp.model.load_params({**global_params, **fresh})
    logits = exp.model.predict(d.test_texts[:size], exp.cfg.eval.batch_size).numpy()
    m = score(exp, d.test_labels[:size], logits, np.arange(size))
    return with_longtail(exp, m, m["class_correct"], m["class_total"], m["zs_class_correct"])
