"""Caches of frozen work (docs/design.md §7): per-text arrays the frozen backbone computes the same way
every time — hidden states below the first adapted layer, frozen input features.

A cache is addressed by a namespace (what computed it: backbone fingerprint, PEFT placement,
tokenizer settings) and, inside it, by the text itself, so an entry can only be found by the
exact computation that made it. The frozen-prefix cache can outgrow memory, so it has a byte
budget (past it, entries are computed afresh each time, never evicted: a run's speed does not
depend on access order) and may live on disk as memory-mapped .npy files.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import cast

import numpy as np
import torch

from fedsplice.data.assets import atomic_write_bytes


def fingerprint(tensors) -> str:
    """sha256 of the bytes of frozen tensors (the weights a cached computation depends on)."""
    h = hashlib.sha256()
    for t in tensors:
        # the raw bytes (numpy has no bf16; for fp32 these are the bytes hashed before)
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def split_rows(flat: torch.Tensor, shapes: list[tuple]) -> list[torch.Tensor]:
    """Views of consecutive pieces of a flat tensor, one per shape."""
    out, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        out.append(flat[at:at + n].view(shape))
        at += n
    return out


class FrozenCache:
    def __init__(self, namespace: dict, budget_bytes: int, root: str | Path = "", device: torch.device | str = "cpu"):
        """Entries are kept in host memory (or on disk) as float32 arrays and come back from
        `rows` on `device`: a cache may outgrow an accelerator's memory, never the budget."""
        self.device = torch.device(device)
        blob = json.dumps(namespace, sort_keys=True).encode()
        self.key = hashlib.sha256(blob).hexdigest()[:20]
        self.budget, self.used = budget_bytes, 0
        self.hits = self.misses = 0
        self._mem: dict[str, np.ndarray] = {}
        self.dir = Path(root) / self.key if root else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.dir / "namespace.json", json.dumps(namespace, indent=1, sort_keys=True).encode())
            self.used = sum(p.stat().st_size for p in self.dir.glob("*.npy"))

    def _path(self, text: str) -> Path:
        assert self.dir is not None  # only called on a cache on disk
        return self.dir / (hashlib.sha256(text.encode()).hexdigest() + ".npy")

    def get(self, text: str) -> np.ndarray | None:
        a = self._mem.get(text)
        if a is None and self.dir is not None:
            p = self._path(text)
            if p.exists():
                a = self._mem[text] = np.load(p, mmap_mode="r")  # paged in by the OS, not held
        if a is None:
            self.misses += 1
        else:
            self.hits += 1
        return a

    def put(self, text: str, value: torch.Tensor) -> bool:
        """Keep `value` if the budget allows; False when it did not fit."""
        a = value.detach().float().cpu().numpy()  # float32 whatever autocast computed it in
        if self.used + a.nbytes > self.budget:
            return False
        self.used += a.nbytes
        if self.dir is None:
            self._mem[text] = a.copy()
        else:
            buf = io.BytesIO()
            np.save(buf, a)
            atomic_write_bytes(self._path(text), buf.getvalue())
            self._mem[text] = np.load(self._path(text), mmap_mode="r")
        return True

    def rows(self, texts: list[str], compute) -> list[torch.Tensor]:
        """One tensor per text: cached, or from `compute(missing texts)` (one row per text) and
        kept if the budget allows."""
        # a row is a cached array or None, then a tensor once computed or moved to the device
        rows: list[np.ndarray | torch.Tensor | None] = [self.get(t) for t in texts]
        miss = [i for i, r in enumerate(rows) if r is None]
        if miss:
            for i, v in zip(miss, compute([texts[i] for i in miss])):
                rows[i] = v.float()  # as a cached row comes back: a batch is the same either way
                self.put(texts[i], v)
        cached = [i for i, r in enumerate(rows) if not torch.is_tensor(r)]
        # the rows that are not tensors yet are the cached arrays (every miss was filled above)
        for i, t in zip(cached, self._to_device(cast(list[np.ndarray], [rows[i] for i in cached]))):
            rows[i] = t
        return cast(list[torch.Tensor], rows)  # every row is a tensor now

    def _to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Cached rows as tensors on the device: on the CPU a copy each (the arrays may be
        read-only memory maps); elsewhere one pinned host buffer, copied once without blocking."""
        if self.device.type == "cpu" or not arrays:
            return [torch.from_numpy(np.array(a)) for a in arrays]
        flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.float32).reshape(-1) for a in arrays]))
        if self.device.type == "cuda":
            flat = flat.pin_memory()
        return split_rows(flat.to(self.device, non_blocking=True), [a.shape for a in arrays])

    def stats(self) -> dict:
        return {"entries": len(self._mem), "bytes": self.used, "hits": self.hits, "misses": self.misses}


class TokenCache:
    """Tokenized inputs, per text: padding a batch from them gives the tokenizer's own batch."""

    def __init__(self, tokenizer, max_length: int, enabled: bool = True, device: torch.device | str = "cpu"):
        self.tok, self.max_length, self.enabled = tokenizer, max_length, enabled
        self.device = torch.device(device)  # where the padded batches go (the model's device)
        self._ids: dict[str, dict] = {}

    def __call__(self, texts: list[str]):
        if not self.enabled:
            enc = self.tok(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
            return enc.to(self.device)
        self._fill(texts)
        return self.tok.pad([self._ids[t] for t in texts], padding=True, return_tensors="pt").to(self.device)

    def lengths(self, texts: list[str]) -> list[int]:
        """Each text's number of tokens (after truncation), as a batch of it would hold."""
        if not self.enabled:
            return [len(ids) for ids in self.tok(texts, truncation=True, max_length=self.max_length)["input_ids"]]
        self._fill(texts)
        return [len(self._ids[t]["input_ids"]) for t in texts]

    def _fill(self, texts: list[str]) -> None:
        new = [t for t in dict.fromkeys(texts) if t not in self._ids]
        if new:
            enc = self.tok(new, truncation=True, max_length=self.max_length)
            for i, t in enumerate(new):
                self._ids[t] = {k: v[i] for k, v in enc.items()}
