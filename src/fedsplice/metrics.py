"""Classification metrics and the summaries of §6 (GM on the global test set, PM over clients)."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import f1_score, roc_auc_score


def classification_metrics(labels: np.ndarray, logits: np.ndarray, num_classes: int) -> dict:
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


def summarize_clients(per_client: list[dict]) -> dict:
    """Mean over ALL clients, plus std/min/max of accuracy across them."""
    acc = np.array([m["accuracy"] for m in per_client])
    out = {k: float(np.mean([m[k] for m in per_client])) for k in per_client[0]}
    out.update(accuracy_std=float(acc.std()), accuracy_min=float(acc.min()), accuracy_max=float(acc.max()))
    return out
