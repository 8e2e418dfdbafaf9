"""Per-site data (Flower deployments, data.dataset = "sites"): each SuperNode brings its own file.

Nothing is partitioned: a site's file is its one client's data (`load_site`), over the classes the
config lists (data.labels), and the server holds only its optional evaluation file
(`load_server_test`, data.test). See docs/data.md.
"""

from __future__ import annotations

import numpy as np

from fedsplice.config import SITES
from fedsplice.data.datasets import TextDataset, rename_classes, small_test_warnings, split_given, split_report
from fedsplice.data.userdata import load_user
from fedsplice.errors import ConfigError


def _user_spec(spec: str, field: str) -> tuple[str, str]:
    kind, _, path = spec.partition(":")
    if kind not in ("csv", "jsonl", "images") or not path:
        raise ConfigError(f"{field} = {spec!r}: give csv:PATH, jsonl:PATH or images:DIR")
    return kind, path


def load_site(spec: str, labels: list[str], *, seed: int = 0, local_test_size: int = 40,
              max_per_class: int | None = None, skip_bad_images: bool = False,
              class_names: list[str] | None = None) -> TextDataset:
    """One site's own file (Flower per-site data, data.dataset = "sites"): its training rows and
    its local test set, over the classes `labels` (data.labels) in that order. The file's `split`
    column is used as given; without one, `local_test_size` random rows (at most half) are the
    site's local test."""
    kind, path = _user_spec(spec, "node config data-path")
    parsed = load_user(kind, path, skip_bad_images=skip_bad_images, labels=labels)
    rng = np.random.default_rng(seed)
    if not parsed["split"]:
        flat = [(x, c) for c, t in enumerate(parsed["texts"]) for x in t]
        n_test = min(local_test_size, len(flat) // 2)
        if n_test == 0:
            raise ConfigError(f"{path}: {len(flat)} row(s) leave no local test set; a site needs at least 2 rows")
        perm = rng.permutation(len(flat))
        parsed["texts"], parsed["test_texts"] = (
            [[x for x, c in (flat[i] for i in part) if c == k] for k in range(len(labels))]
            for part in (perm[n_test:], perm[:n_test]))
        parsed["split"] = f"carved at the site: {n_test} random rows as its local test (data.local_test_size)"
    tr_x, tr_y, te_x, te_y = split_given(parsed["texts"], parsed["test_texts"], rng, max_per_class)
    ds = TextDataset(name=SITES, class_names=rename_classes(list(labels), class_names), train_texts=tr_x,
                     train_labels=tr_y, test_texts=te_x, test_labels=te_y, source=parsed["source"])
    ds.report = split_report(parsed, 0, seed, ds)
    return ds


def load_server_test(spec: str, labels: list[str], *, skip_bad_images: bool = False,
                     class_names: list[str] | None = None) -> TextDataset:
    """The server's own evaluation file in per-site mode (data.test; "": none, GM is then
    evaluated on the sites): every row is a global test sample. No training data."""
    names = rename_classes(list(labels), class_names)
    if not spec:
        return TextDataset(SITES, names, [], np.empty(0, np.int64), [], np.empty(0, np.int64),
                           "per-site data (data.dataset = 'sites')",
                           report={"split": "per site: none on the server; GM is evaluated on the sites"})
    kind, path = _user_spec(spec, "data.test")
    parsed = load_user(kind, path, skip_bad_images=skip_bad_images, labels=labels)
    rows = parsed["test_texts"] if parsed["split"] else parsed["texts"]
    _, _, te_x, te_y = split_given([[] for _ in labels], rows, np.random.default_rng(0))
    ds = TextDataset(SITES, names, [], np.empty(0, np.int64), te_x, te_y, parsed["source"],
                     report={"split": f"per site; the server's evaluation file data.test = {spec!r}",
                             "dropped": parsed["dropped"], "notes": parsed["notes"]})
    ds.report["warnings"] = small_test_warnings(ds)
    return ds
