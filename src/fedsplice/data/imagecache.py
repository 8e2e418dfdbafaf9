"""A parsed built-in image set (`ImageSet`) and its cache.

A built-in set is parsed once into `cache_dir()/datasets/<name>.npz` (stacked uint8 images, no
pickle) beside `<name>.json` (class names, texts, source, parser version), and handed to
`fedsplice.data.datasets` as per-class lists of `Sample`s (a str key `<name>/<split>/<index>`
carrying `.image` / `.text`). The parsers themselves are `fedsplice.data.imagesets`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedsplice.data.assets import atomic_write_bytes, atomic_write_json, cache_dir
from fedsplice.data.samples import Sample

# Bump when a parser's output changes: parsed caches with another version are rebuilt.
PARSER_VERSION = 1


@dataclass
class ImageSet:
    """A parsed data set. Samples are stored in file order; images once each."""
    class_names: list[str]
    images: np.ndarray  # uint8 [M, H, W] (grey) or [M, H, W, 3]: every distinct image once
    image_of: np.ndarray  # int64 [N]: the row of `images` of each sample (easy-VQA: one image,
    #                       many questions)
    labels: np.ndarray  # int64 [N], values in [0, C)
    split: np.ndarray  # uint8 [N]: 0 = train (or all samples), 1 = official test split
    texts: list[str] | None  # N texts, or None for an image-only set
    source: str
    has_test: bool  # whether `split` carries an official test split
    item: str = ""  # prefix of the index in keys ("q": easy-VQA counts questions, not images)

    def keys(self, name: str) -> list[str]:
        """`<name>/<split>/<item><index within the split>`, unique within the set."""
        names = ("train", "test") if self.has_test else ("all", "all")
        counters = [0, 0]
        out = []
        for s in self.split.tolist():
            out.append(f"{name}/{names[s]}/{self.item}{counters[s]}")
            counters[s] += 1
        return out

    def pools(self, name: str) -> tuple[list[list[Sample]], list[list[Sample]] | None]:
        """(train pool, official test pool or None): per-class lists of Samples. Samples of
        one image share one array view (no copies)."""
        views = list(self.images)
        C = len(self.class_names)
        pools: tuple[list[list[Sample]], list[list[Sample]]] = ([[] for _ in range(C)], [[] for _ in range(C)])
        texts: Sequence[str | None] = self.texts or [None] * len(self.labels)
        for key, k, y, s, t in zip(self.keys(name), self.image_of.tolist(),
                                   self.labels.tolist(), self.split.tolist(), texts):
            pools[s][y].append(Sample(key, views[k], t))
        return pools[0], (pools[1] if self.has_test else None)


def _cache_paths(name: str) -> tuple[Path, Path]:
    folder = cache_dir() / "datasets"
    return folder / f"{name}.npz", folder / f"{name}.json"


def save_parsed(name: str, s: ImageSet) -> None:
    """Write the arrays (npz) then the json that vouches for them, each atomically; the json is
    written last, so a reader never pairs it with a half-written npz."""
    npz, meta = _cache_paths(name)
    buf = io.BytesIO()
    np.savez(buf, images=s.images, image_of=s.image_of, labels=s.labels, split=s.split)
    atomic_write_bytes(npz, buf.getvalue())
    atomic_write_json(meta, {
        "name": name, "parser_version": PARSER_VERSION, "class_names": s.class_names,
        "source": s.source, "has_test": s.has_test, "item": s.item,
        "n_samples": len(s.labels), "images_shape": list(s.images.shape), "texts": s.texts})


def load_parsed(name: str) -> ImageSet | None:
    """The cached parse, or None when absent, stale (parser version) or inconsistent."""
    npz, meta = _cache_paths(name)
    try:
        m = json.loads(meta.read_text(encoding="utf-8"))
        if m.get("parser_version") != PARSER_VERSION:
            return None
        with np.load(npz, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("images", "image_of", "labels", "split")}
    except (OSError, ValueError, KeyError):
        return None
    if list(arrays["images"].shape) != m["images_shape"] or len(arrays["labels"]) != m["n_samples"]:
        return None
    return ImageSet(class_names=m["class_names"], texts=m["texts"], source=m["source"],
                    has_test=m["has_test"], item=m["item"], **arrays)


def stack_set(images, labels, split, texts=None, **kw) -> ImageSet:
    """An ImageSet whose samples each have their own image (a list of arrays, or stacked)."""
    return ImageSet(images=np.stack(images) if isinstance(images, list) else images,
                    image_of=np.arange(len(labels), dtype=np.int64),
                    labels=np.asarray(labels, dtype=np.int64),
                    split=np.asarray(split, dtype=np.uint8), texts=texts, **kw)
