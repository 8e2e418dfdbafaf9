"""What happened to the data: sizes per class and per client, the split, what was dropped and why.

`data_report` is results.json's "data" table (and data.json beside it); `summary_lines` is what
`fedsplice run` and `fedsplice validate` print. Drops are counted by reason:

    duplicates         exact copies (same label, same content) in a user's training data
    cap                training samples beyond data.max_per_class
    long_tail          training samples cut to the long-tail profile (data.imbalance)
    test_pool_unused   an official test split's samples beyond the balanced test set
    unused_split_rows  rows whose `split` is val / valid / validation / dev
    blank_lines        blank lines of a JSONL file
    bad_images         images that did not decode (data.skip_bad_images = true)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsplice.data.datasets import TextDataset
from fedsplice.data.partition import Client

# how a drop reads in the console, with the field that controls it
REASONS = {"duplicates": "exact duplicates", "cap": "over data.max_per_class", "long_tail": "cut by data.imbalance",
           "test_pool_unused": "official test samples beyond data.test_per_class",
           "unused_split_rows": "val/dev rows", "blank_lines": "blank lines", "bad_images": "bad images"}


def _counts(labels: np.ndarray, c: int) -> list[int]:
    return np.bincount(np.asarray(labels, dtype=np.int64), minlength=c)[:c].tolist()


def data_report(data: TextDataset, clients: list[Client], holdout_ids: Sequence[int] = ()) -> dict:
    """Sizes of everything a run trains and tests on, the split and the drops (JSON-ready)."""
    c = data.num_classes
    g = data.global_test_size
    held = set(holdout_ids)
    rep = data.report or {}
    return {
        "source": rep.get("source", data.source),
        "split": rep.get("split", ""),
        "class_names": list(data.class_names),
        "train_size": len(data.train_texts),
        "global_test_size": g,
        "train_per_class": _counts(data.train_labels, c),
        "global_test_per_class": _counts(data.test_labels[:g], c),
        "clients": [{"cid": k.cid, "role": "holdout" if k.cid in held else "train",
                     "train": len(k.train_idx), "local_test": len(k.test_idx),
                     "train_per_class": _counts(data.train_labels[k.train_idx], c),
                     "local_test_per_class": _counts(data.test_labels[k.test_idx], c)} for k in clients],
        "dropped": {k: v for k, v in rep.get("dropped", {}).items() if v},
        # instruction records (model.task = "generate"): "group", grouped by data.group_field
        **({"unit": rep["unit"]} if "unit" in rep else {}),
        "notes": list(rep.get("notes", [])),
        "warnings": list(rep.get("warnings", [])) + _held_out_warning(clients, held),
        # data.local_test = "disjoint" only: the pool, the top-up, what ran out (fedsplice.data.testsets)
        **({"local_test": rep["local_test"]} if "local_test" in rep else {}),
    }


def _held_out_warning(clients: list[Client], held: set[int]) -> list[str]:
    """Held-out clients train only in the cold start. With skewed client sizes they can hold far
    more of the data than their number suggests: said when it is over 1.5x their share of clients."""
    sizes = {k.cid: len(k.train_idx) for k in clients}
    total = sum(sizes.values())
    if not held or not total:
        return []
    share, fair = sum(sizes[c] for c in held) / total, len(held) / len(sizes)
    if share <= 1.5 * fair:
        return []
    return [f"the held-out clients ({', '.join(map(str, sorted(held)))}) hold {share:.0%} of the training data, "
            f"{share / fair:.1f}x their {fair:.0%} share of the clients; the rounds train on the other "
            f"{1 - share:.0%}. data.holdout_clients = 0 trains on all of it (and skips the cold start)"]


def summary_lines(rep: dict) -> list[str]:
    """A few lines a person reads before the rounds start; warnings last, prefixed."""
    te = rep["global_test_per_class"]
    n, unit = len(rep["class_names"]), rep.get("unit", "class")
    units = unit + ("" if n == 1 else "es" if unit == "class" else "s")
    lines = [f"data: {rep['source']}; {n} {units}", f"  split: {rep['split']}"]
    test = (f"global test {rep['global_test_size']}"
            + (f" ({min(te)}-{max(te)} per {unit})" if rep["global_test_size"] else ""))
    if rep["train_size"] is None:  # per-site data, on the server
        lines.append(f"  {test}")
    else:
        tr = rep["train_per_class"]
        lines.append(f"  train {rep['train_size']} ({min(tr)}-{max(tr)} per {unit}); {test}")
    if rep["clients"]:
        sizes = [k["train"] for k in rep["clients"]]
        tests = [k["local_test"] for k in rep["clients"]]
        lines.append(f"  {len(sizes)} clients: train {min(sizes)}-{max(sizes)} each, "
                     f"local test {min(tests)}-{max(tests)} each")
        held = [k for k in rep["clients"] if k["role"] == "holdout"]
        if held:  # they train only in the cold start: a share of the data the rounds never see
            share = sum(k["train"] for k in held) / max(sum(sizes), 1)
            lines.append(f"  held out of the rounds (cold start only): client{'s' if len(held) > 1 else ''} "
                         f"{', '.join(str(k['cid']) for k in held)}, {share:.0%} of the clients' training data")
    if rep["dropped"]:
        lines.append("  dropped: " + ", ".join(f"{v} {REASONS.get(k, k)}" for k, v in rep["dropped"].items()))
    lines += [f"  note: {n}" for n in rep["notes"]]
    lines += [f"warning: {w}" for w in rep["warnings"]]
    return lines
