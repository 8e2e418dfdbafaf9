"""Classification metrics and the summaries of §6 (GM on the global test set, PM over clients)."""

from __future__ import annotations

from typing import Any

import numpy as np

# a JSON-able table of results: metric name -> a number, a list (per class, per client), None, or a nested table
Metrics = dict[str, Any]


def classification_metrics(labels: np.ndarray, logits: np.ndarray, num_classes: int) -> dict[str, float]:
    """Accuracy, F1 and (binary) AUC. An undefined metric is NaN here, so means over clients stay
    NaN; files write it as null (fedsplice.data.assets.strict_json)."""
    from sklearn.metrics import f1_score, roc_auc_score  # here: 1 s of import `validate` never needs

    labels = np.asarray(labels)
    pred = logits.argmax(1)
    out = {
        "accuracy": float((pred == labels).mean()) if len(labels) else float("nan"),
        # Classes absent from both labels and predictions are left out (sklearn's default), so a
        # client's local test set without some classes is not scored as 0 on them.
        "f1_macro": float(f1_score(labels, pred, average="macro", zero_division=0)),
        "f1_weighted": float(f1_score(labels, pred, average="weighted", zero_division=0)),
    }
    if num_classes == 2:
        z = logits - logits.max(1, keepdims=True)
        p1 = np.exp(z[:, 1]) / np.exp(z).sum(1)
        out["auc"] = float(roc_auc_score(labels, p1)) if len(set(labels.tolist())) == 2 else float("nan")
    return out


def summarize_clients(per_client: list[Metrics]) -> dict[str, float]:
    """Mean over ALL clients of every scalar metric, plus std/min/max of accuracy across them.
    List-valued entries (per-class counts) are left to the caller to pool."""
    acc = np.array([m["accuracy"] for m in per_client])
    out = {k: float(np.mean([m[k] for m in per_client])) for k in per_client[0]
           if isinstance(per_client[0][k], (int, float))}
    out.update(accuracy_std=float(acc.std()), accuracy_min=float(acc.min()), accuracy_max=float(acc.max()))
    return out


# ------------------------------------------------------------------ long-tailed protocol (§6)


def per_class_counts(labels: np.ndarray, pred: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(correct, total) per class; pooled across clients by summing."""
    total = np.bincount(labels, minlength=num_classes)
    correct = np.bincount(labels[pred == labels], minlength=num_classes)
    return correct, total


def balancedness(acc: np.ndarray, sigma: float) -> float:
    """β(V) = (1/C²)·Σ_ij exp(−(a_i − a_j)²/σ), per-class accuracies in [0, 1] (Kang et al.)."""
    acc = np.asarray(acc, dtype=np.float64)
    d = acc[:, None] - acc[None, :]
    return float(np.exp(-(d**2) / sigma).mean())


def shot_groups(train_counts: np.ndarray, many: int, few: int) -> dict[str, np.ndarray]:
    """Classes by global training count: many (> many), medium (few..many), few (< few)."""
    c = np.asarray(train_counts)
    return {"many": c > many, "medium": (c >= few) & (c <= many), "few": c < few}


def head_bias(train_counts: np.ndarray, acc: np.ndarray, zs_acc: np.ndarray) -> float | None:
    """Spearman rank correlation between a class's training count and its accuracy change from
    zero-shot: > 0 means fine-tuning helped frequent classes at the expense of rare ones."""
    from scipy.stats import spearmanr

    delta = np.asarray(acc) - np.asarray(zs_acc)
    if np.all(delta == delta[0]) or np.all(np.asarray(train_counts) == train_counts[0]):
        return None  # undefined for a constant input
    return float(spearmanr(train_counts, delta).statistic)


def longtail_metrics(correct: np.ndarray, total: np.ndarray, zs_correct: np.ndarray, train_counts: np.ndarray, *,
                     many: int, few: int, sigma: float, min_group: int = 1) -> dict[str, float | int | None]:
    """Group accuracies (with their test-sample counts, "<group>_n"), balancedness at σ (and at
    0.1, 0.01) and head bias, over classes that have test samples. A group with fewer than
    `min_group` test samples is None: an accuracy on 0-2 samples is noise, not a result."""
    total = np.asarray(total)
    has = total > 0
    acc = np.where(has, np.asarray(correct) / np.maximum(total, 1), 0.0)
    zs = np.where(has, np.asarray(zs_correct) / np.maximum(total, 1), 0.0)
    out: dict[str, float | int | None] = {}
    for name, mask in shot_groups(train_counts, many, few).items():
        m = mask & has
        n_group = int(total[m].sum())
        out[f"{name}_n"] = n_group
        out[name] = float(np.asarray(correct)[m].sum() / n_group) if n_group >= max(min_group, 1) else None
    a, z, n = acc[has], zs[has], np.asarray(train_counts)[has]
    out["balancedness"] = balancedness(a, sigma)
    out["balancedness_sigma"] = sigma
    out["balancedness_0.1"] = balancedness(a, 0.1)
    out["balancedness_0.01"] = balancedness(a, 0.01)
    out["head_bias"] = head_bias(n, a, z)
    return out
