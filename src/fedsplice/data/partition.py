"""Seeded partitioners: split a labelled training set among federated clients.

Everything is numpy and takes an explicit `np.random.Generator`; nothing touches global
random state, so the same generator state always yields the same partition. Each partitioner
returns one sorted int64 index array per client, and every index lands in exactly one client.
A `Client` is one client's share: its training indices and its local test indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedsplice.errors import ConfigError

MAX_DIRICHLET_ATTEMPTS = 100


@dataclass
class Client:
    cid: int
    train_idx: np.ndarray  # into dataset.train_*
    test_idx: np.ndarray  # into dataset.test_* (local test set, matching its label distribution)


def _check_clients(labels: np.ndarray, num_clients: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {labels.shape}")
    if int(num_clients) != num_clients or num_clients < 1:
        raise ConfigError(f"data.num_clients must be an integer >= 1 (got {num_clients})")
    if num_clients > len(labels):
        raise ConfigError(f"data.num_clients = {num_clients} is more than the {len(labels)} "
                          f"training samples; use fewer clients or more data")
    return labels


def _finish(parts) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def iid_partition(labels: np.ndarray, num_clients: int,
                  rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and deal out near-equal shares (sizes differ by at most one)."""
    labels = _check_clients(labels, num_clients)
    return _finish(np.array_split(rng.permutation(len(labels)), num_clients))


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float,
                        rng: np.random.Generator, min_per_client: int = 2) -> list[np.ndarray]:
    """Label skew: for each class, client shares ~ Dir(alpha); the class's shuffled indices are
    cut at those proportions. Small alpha -> each client sees few classes; large alpha -> IID.
    Redrawn (at most MAX_DIRICHLET_ATTEMPTS times) until every client has min_per_client."""
    labels = _check_clients(labels, num_clients)
    if not (isinstance(alpha, (int, float, np.number)) and math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"data.alpha must be > 0 and finite (got {alpha}); small values "
                          f"(0.1) give strong label skew, large ones (100) nearly IID clients")
    if min_per_client * num_clients > len(labels):
        raise ConfigError(f"data.num_clients = {num_clients} clients cannot each get "
                          f"{min_per_client} of {len(labels)} samples; use fewer clients")
    classes = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(MAX_DIRICHLET_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in classes:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            if not np.all(np.isfinite(p)):  # tiny alpha can underflow: all mass on one client
                p = np.eye(num_clients)[rng.integers(num_clients)]
            cuts = np.floor(np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        sizes = [sum(len(c) for c in part) for part in parts]
        if min(sizes) >= min_per_client:
            return _finish(np.concatenate(part) for part in parts)
    raise ConfigError(f"data.alpha = {alpha}: after {MAX_DIRICHLET_ATTEMPTS} draws some of the "
                      f"{num_clients} clients still had fewer than {min_per_client} samples; "
                      f"use fewer clients (data.num_clients) or a larger data.alpha")


def shard_partition(labels: np.ndarray, num_clients: int, shards_per_client: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """Pathological non-IID (McMahan et al.): sort by label, cut into num_clients *
    shards_per_client contiguous shards, give each client shards_per_client random shards."""
    labels = _check_clients(labels, num_clients)
    if int(shards_per_client) != shards_per_client or shards_per_client < 1:
        raise ConfigError(f"data.shards_per_client must be an integer >= 1 "
                          f"(got {shards_per_client})")
    n_shards = num_clients * shards_per_client
    if n_shards > len(labels):
        raise ConfigError(f"data.num_clients × data.shards_per_client = {n_shards} shards is "
                          f"more than the {len(labels)} samples; lower either")
    perm = rng.permutation(len(labels))  # random order within each label
    order = perm[np.argsort(labels[perm], kind="stable")]
    shards = np.array_split(order, n_shards)
    owner = rng.permutation(n_shards)
    return _finish(np.concatenate([shards[s] for s in owner[k::num_clients]])
                   for k in range(num_clients))


def largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to `total`, proportional to `weights` (Hamilton's method: floor,
    then one extra to the largest remainders; ties go to the lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError("weights must have a positive sum")
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def local_test_indices(client_train_labels: np.ndarray, test_labels: np.ndarray, size: int,
                       num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """`size` indices into the global test set whose class proportions follow the client's
    training label distribution (largest-remainder rounding) over the classes the test set has
    (a user's given test split may lack some). Drawn without replacement per class, with
    replacement only for a class with fewer test samples than its quota."""
    if int(size) != size or size < 1:
        raise ConfigError(f"data.local_test_size must be an integer >= 1 (got {size})")
    train_counts = np.bincount(np.asarray(client_train_labels, dtype=np.int64),
                               minlength=num_classes)[:num_classes]
    if train_counts.sum() == 0:
        raise ValueError("client_train_labels is empty: the client has no training data")
    test_labels = np.asarray(test_labels)
    train_counts = train_counts * (np.bincount(test_labels, minlength=num_classes)[:num_classes] > 0)
    if train_counts.sum() == 0:
        raise ConfigError("a client trains only on classes the global test set lacks, so it has no local "
                          "test set; add test rows of those classes")
    quotas = largest_remainder(train_counts, int(size))
    picks = []
    for c in np.flatnonzero(quotas):
        pool = np.flatnonzero(test_labels == c)
        picks.append(rng.choice(pool, size=int(quotas[c]), replace=len(pool) < quotas[c]))
    return np.sort(np.concatenate(picks)).astype(np.int64)


def long_tail_counts(num_classes: int, n_max: int, imbalance: float) -> list[int]:
    """Per-class sizes of a long-tailed set: n_c = floor(n_max * IF**(-c/(C-1))), c = 0..C-1,
    so class 0 has n_max and the last n_max / IF (never fewer than 1)."""
    if int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be an integer >= 1 (got {num_classes})")
    if int(n_max) != n_max or n_max < 1:
        raise ConfigError(f"data.n_max must be an integer >= 1 (got {n_max})")
    if not (math.isfinite(imbalance) and imbalance >= 1):
        raise ConfigError(f"data.imbalance must be >= 1 (got {imbalance}); it is the ratio of "
                          f"the largest class to the smallest (1 = balanced, 100 = long tail)")
    if num_classes == 1:
        return [int(n_max)]
    # The 1e-9 guards exact powers against float round-off (100 * 100**-0.5 = 9.999…).
    return [max(1, math.floor(n_max * imbalance ** (-c / (num_classes - 1)) + 1e-9))
            for c in range(num_classes)]


def permuted_order(counts: np.ndarray, imbalance: float, n_max: int, rng: np.random.Generator,
                   class_names: list[str], tries: int = 10_000) -> tuple[np.ndarray, int]:
    """(ranks head first, n_max) of a permuted long tail that keeps the profile and the IF exactly.

    n_max = 0: one seeded permutation and the largest n_max that it fits. n_max > 0: seeded
    permutations are drawn until one fits (every class holds the count its rank asks for), so a
    class too small for a head rank never draws one; an error when none of `tries` fits."""
    c = len(counts)
    ratio = np.array([imbalance ** (-r / (c - 1)) if c > 1 else 1.0 for r in range(c)])
    if n_max == 0:
        order = rng.permutation(c)
        return order, int(min(math.floor(counts[k] / ratio[r] + 1e-9) for r, k in enumerate(order)))
    need = np.array(long_tail_counts(c, n_max, imbalance))
    for _ in range(tries):
        order = rng.permutation(c)
        if np.all(counts[order] >= need):
            return order, n_max
    short = [class_names[k] for k in np.argsort(counts)[:3]]
    raise ConfigError(f"data.n_max = {n_max}: with data.long_tail_order = 'permuted' no permutation of the "
                      f"classes in {tries} draws gives every class the count its rank asks for (smallest: "
                      f"{', '.join(short)} with {sorted(counts)[:3]}); lower data.n_max or set it to 0")


def long_tail_subsample(labels: np.ndarray, n_max: int, imbalance: float,
                        rng: np.random.Generator,
                        class_order: np.ndarray | None = None) -> np.ndarray:
    """Sorted indices of a long-tailed subsample: the class ranked r keeps a random
    long_tail_counts(...)[r] of its samples (all of them when it has fewer). The rank is the
    class index (class 0 is the head) unless class_order lists the classes head first."""
    labels = np.asarray(labels, dtype=np.int64)
    num_classes = int(labels.max()) + 1 if len(labels) else 0
    order = np.arange(num_classes) if class_order is None else np.asarray(class_order)
    if sorted(order.tolist()) != list(range(num_classes)):
        raise ValueError(f"class_order must be a permutation of 0..{num_classes - 1}")
    counts = long_tail_counts(num_classes, n_max, imbalance)
    picks = []
    for rank, c in enumerate(order):
        pool = np.flatnonzero(labels == c)
        picks.append(rng.choice(pool, size=min(counts[rank], len(pool)), replace=False))
    return np.sort(np.concatenate(picks)).astype(np.int64)


def validation_indices(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted training indices of a balanced validation set: `per_class` samples of each class,
    at most half of the class (so that training keeps the other half), drawn at random."""
    labels = np.asarray(labels, dtype=np.int64)
    picks = [rng.choice(pool, size=min(per_class, len(pool) // 2), replace=False)
             for c in range(int(labels.max()) + 1 if len(labels) else 0) if len(pool := np.flatnonzero(labels == c))]
    return np.sort(np.concatenate(picks)).astype(np.int64) if picks else np.empty(0, np.int64)
