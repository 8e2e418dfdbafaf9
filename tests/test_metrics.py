"""Metrics against hand-computed values."""

import numpy as np
import pytest

from fedsplice.federation.metrics import classification_metrics, summarize_clients


def test_accuracy_and_f1_by_hand():
    labels = np.array([0, 0, 1, 1, 2, 2])
    pred = np.array([0, 1, 1, 1, 2, 0])
    logits = np.eye(3)[pred]
    m = classification_metrics(labels, logits, 3)
    assert m["accuracy"] == pytest.approx(4 / 6)
    # per class: P/R = c0 1/2,1/2 -> F1 .5; c1 2/3,1 -> .8; c2 1,1/2 -> 2/3
    assert m["f1_macro"] == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    assert m["f1_weighted"] == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)  # equal support
    assert "auc" not in m


def test_f1_macro_ignores_classes_absent_from_a_local_test_set():
    labels = np.array([0, 0, 1])
    logits = np.eye(5)[np.array([0, 0, 1])]  # 5 classes, only 0 and 1 occur
    assert classification_metrics(labels, logits, 5)["f1_macro"] == 1.0


def test_binary_auc_by_hand():
    labels = np.array([0, 0, 1, 1])
    # P(class 1) ranks: 0.2, 0.6 (neg) vs 0.4, 0.9 (pos): pairs won 3 of 4 -> AUC 0.75
    p1 = np.array([0.2, 0.6, 0.4, 0.9])
    logits = np.log(np.stack([1 - p1, p1], 1))
    assert classification_metrics(labels, logits, 2)["auc"] == pytest.approx(0.75)


def test_summarize_clients_mean_std_min_over_all():
    per = [{"accuracy": 0.5, "f1_macro": 0.4}, {"accuracy": 1.0, "f1_macro": 1.0},
           {"accuracy": 0.0, "f1_macro": 0.1}]
    s = summarize_clients(per)
    assert s["accuracy"] == pytest.approx(0.5)
    assert s["f1_macro"] == pytest.approx(0.5)
    assert s["accuracy_std"] == pytest.approx(np.std([0.5, 1.0, 0.0]))
    assert s["accuracy_min"] == 0.0 and s["accuracy_max"] == 1.0
