"""Disjoint local test sets (data.local_test = "disjoint"), and the global test set's top-up.

The pool is every item of the training split that nothing else uses: not trained on (after the
cap and the long-tail cut), not in the global test set and not in `reserved` (the validation
hold-out; a validation run draws no disjoint sets: `federation.experiment.disjoint_tests`). Items are compared by
content, so a copy of a training text never becomes a test item. From the pool, in order:

1. data.global_test_per_class > 0: each class of the global test set is topped up to that many,
   as far as the class's pool lasts (the carve is balanced at the smallest class, so a larger
   global test set must come from here).
2. Each client's quota per class is its training distribution by largest remainder, as in
   `partition.local_test_indices`. Where the clients ask a class for more than it holds, its items
   are shared in proportion to the asks (largest remainder again); data.local_test_shortfall says
   whether the rest is cut ("cap") or asked of the client's other classes ("refill", `fill`).
   Nothing is redrawn or reused; the shortfall is reported (`data.report["local_test"]`, a warning).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import numpy as np

from fedsplice.config import DataConfig
from fedsplice.data.datasets import TextDataset, small_test_warnings
from fedsplice.data.partition import Client, largest_remainder
from fedsplice.errors import ConfigError


def client_quotas(client_labels: Sequence[np.ndarray], size: int, num_classes: int) -> np.ndarray:
    """(clients, classes) counts: each row sums to `size`, proportional to that client's labels."""
    return np.stack([largest_remainder(np.bincount(y, minlength=num_classes)[:num_classes], size)
                     for y in client_labels])


def fill(weights: np.ndarray, size: int, available: np.ndarray, refill: bool = False) -> np.ndarray:
    """(clients, classes) counts: each row `size` items in proportion to its `weights` (training
    counts) by largest remainder, as far as `available` (items per class) lasts: a class asked for
    more than it has is shared in proportion to the asks. refill: further passes give what a client
    still misses to its classes that have items left (each pass but the last empties a class)."""
    counts = np.zeros_like(weights, dtype=np.int64)
    left = np.asarray(available, dtype=np.int64).copy()
    while True:
        need = size - counts.sum(1)
        w = weights * (need > 0)[:, None] * ((left > 0) if refill else 1)
        if not w.any():
            return counts
        ask = np.stack([largest_remainder(row, int(n)) if row.any() else np.zeros_like(row, dtype=np.int64)
                        for row, n in zip(w, need)])
        for c in np.flatnonzero(ask.sum(0) > left):
            ask[:, c] = largest_remainder(ask[:, c], int(left[c])) if left[c] else 0
        counts += ask
        left -= ask.sum(0)
        if not refill:
            return counts


def deal(counts: np.ndarray, pool_labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Per client, sorted indices into the pool: counts[k, c] of class c each, no index twice."""
    picks: list[list[np.ndarray]] = [[] for _ in range(len(counts))]
    for c in range(counts.shape[1]):
        idx = rng.permutation(np.flatnonzero(pool_labels == c))
        ends = np.cumsum(counts[:, c])
        for k, chunk in enumerate(np.split(idx[:ends[-1]], ends[:-1])):
            picks[k].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in picks]


def top_up(have: np.ndarray, pool_labels: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted pool indices that bring each class from have[c] to per_class, as far as the pool lasts."""
    picks = [rng.choice(pool := np.flatnonzero(pool_labels == c), min(max(per_class - int(n), 0), len(pool)),
                        replace=False) for c, n in enumerate(have)]
    return np.sort(np.concatenate(picks)).astype(np.int64)


def _short(names: list[str], short: np.ndarray) -> str:
    worst = np.argsort(-short, kind="stable")[:4]
    more = ", ..." if (short > 0).sum() > 4 else ""
    return ", ".join(f"{names[c]} {int(short[c])}" for c in worst if short[c]) + more


def disjoint_clients(dc: DataConfig, data: TextDataset, parts: list[np.ndarray], reserved: Collection[str],
                     rng: np.random.Generator) -> list[Client]:
    """The clients (training indices `parts`) with disjoint local test sets; `data`'s test set
    becomes the global test set (topped up) followed by the clients' local sets, in client order."""
    if data.pool_texts is None or data.pool_labels is None:
        raise ValueError("data.local_test = 'disjoint' needs the training split: load_dataset(keep_pool=True)")
    c, k, size = data.num_classes, len(parts), dc.local_test_size
    n_glob = data.global_test_size
    used = set(data.train_texts) | set(data.test_texts[:n_glob]) | set(reserved)
    keep = np.array([i for i, t in enumerate(data.pool_texts) if t not in used], dtype=np.int64)
    px, py = [data.pool_texts[i] for i in keep], data.pool_labels[keep]
    gx, gy = list(data.test_texts[:n_glob]), data.test_labels[:n_glob]
    top = np.empty(0, np.int64)
    if dc.global_test_per_class:
        if data.given_split:
            raise ConfigError("data.global_test_per_class: this data set's test split is given (data.test, a `split` "
                              "column or data.hf_test_split) and used as it is; remove data.global_test_per_class")
        top = top_up(np.bincount(gy, minlength=c), py, dc.global_test_per_class, rng)
        gx, gy = gx + [px[i] for i in top], np.concatenate([gy, py[top]])
        # the load's warning on a small global test set is about the carve: said again of the new one
        stale = small_test_warnings(data)
        data.report["warnings"] = ([w for w in data.report.get("warnings", []) if w not in stale]
                                   + small_test_warnings(replace(data, test_labels=gy)))
    rest = np.setdiff1d(np.arange(len(px)), top)
    if len(rest) < k * size:
        raise ConfigError(f"data.local_test_size = {size}: {k} disjoint local test sets need {k * size} unused "
                          f"training items, but {len(rest)} are left (of {len(px)} unused, {len(top)} topping up the "
                          f"global test set); lower it to at most {len(rest) // k}, or data.global_test_per_class")
    ry = py[rest]
    weights = np.stack([np.bincount(data.train_labels[p], minlength=c)[:c] for p in parts])
    quotas = client_quotas([data.train_labels[p] for p in parts], size, c)
    counts = fill(weights, size, np.bincount(ry, minlength=c), refill=dc.local_test_shortfall == "refill")
    empty = [i for i in range(k) if counts[i].sum() == 0]
    if empty:
        raise ConfigError(f"data.local_test = 'disjoint': client {empty[0]} trains only on classes whose unused items "
                          f"are all taken, so its local test set would be empty; lower data.global_test_per_class or "
                          f"free items (data.max_per_class, data.imbalance), or use data.local_test = 'global'")
    clients, tx, ty = [], list(gx), [gy]
    for cid, (part, pick) in enumerate(zip(parts, deal(counts, ry, rng))):
        clients.append(Client(cid, part, np.arange(len(tx), len(tx) + len(pick), dtype=np.int64)))
        tx.extend(px[i] for i in rest[pick])
        ty.append(ry[pick])
    data.test_texts, data.test_labels, data.n_global_test = tx, np.concatenate(ty), len(gx)
    data.pool_texts = data.pool_labels = None  # drawn: not carried into workers (image sets hold pixels)
    _report(dc, data, len(px), len(top), weights, quotas, counts)
    if (low := np.maximum(dc.global_test_per_class - np.bincount(gy, minlength=c), 0)).any():  # 0: none
        data.report.setdefault("warnings", []).append(
            f"global test set: {int((low > 0).sum())} classes below data.global_test_per_class = "
            f"{dc.global_test_per_class} ({_short(data.class_names, low)} short): their unused items ran out; GM "
            f"accuracy weights classes by their counts, the per-class metrics do not")
    return clients


def _report(dc: DataConfig, data: TextDataset, n_pool: int, n_top: int, weights: np.ndarray, quotas: np.ndarray,
            counts: np.ndarray) -> None:
    """results.json's data.local_test section, and a warning when a class ran out."""
    short = np.maximum(quotas - counts, 0).sum(0)
    # total variation between each client's local test labels and its training labels
    shares = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    tv = 0.5 * np.abs(shares - weights / weights.sum(1, keepdims=True)).sum(1)
    data.report["local_test"] = {
        "mode": "disjoint", "pool": n_pool, "global_top_up": n_top, "requested": int(quotas.sum()),
        "drawn": int(counts.sum()), "short_per_class": short.tolist(),
        "short_per_client": (quotas.sum(1) - counts.sum(1)).tolist(), "tv_from_train": np.round(tv, 4).tolist()}
    sizes = counts.sum(1)
    data.report.setdefault("notes", []).append(
        f"disjoint local test sets: {sizes.min()}-{sizes.max()} items a client, from {n_pool} unused training items "
        f"({n_top} of them top up the global test set)")
    warn = data.report.setdefault("warnings", [])
    if short.any():
        rule = ("given to the same clients' other classes" if dc.local_test_shortfall == "refill"
                else "cut (data.local_test_shortfall = 'cap')")
        warn.append(f"disjoint local test sets: {int((short > 0).sum())} classes ran out of unused items "
                    f"({_short(data.class_names, short)} short), their quotas {rule}, nothing reused: "
                    f"{int(counts.sum())} of {int(quotas.sum())} items, label distributions off the clients' training "
                    f"ones by total variation {tv.mean():.2f} on average (at most {tv.max():.2f})")
