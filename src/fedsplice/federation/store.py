"""Client state store: PRIVATE tensors and their optimizer state, per client, across rounds.

Clients are not live model copies: one backbone is in memory, and each client's state is a
name-keyed tensor dict loaded before its update and saved after. The disk store keeps memory
flat as the number of clients grows (one safetensors file per client, written atomically).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedsplice.data.assets import atomic_write_bytes


@runtime_checkable
class Store(Protocol):
    """Each client's PRIVATE state between its tasks, by client id: MemoryStore, DiskStore (also
    a SuperNode's), or a user's own (a database, an object store)."""

    def get(self, cid: int) -> dict[str, torch.Tensor] | None: ...

    def put(self, cid: int, state: dict[str, torch.Tensor]) -> None: ...

    def clients(self) -> list[int]: ...


class MemoryStore:
    def __init__(self) -> None:
        self._d: dict[int, dict[str, torch.Tensor]] = {}

    def get(self, cid: int) -> dict[str, torch.Tensor] | None:
        s = self._d.get(cid)
        return None if s is None else {k: v.clone() for k, v in s.items()}

    def put(self, cid: int, state: dict[str, torch.Tensor]) -> None:
        self._d[cid] = {k: v.detach().clone() for k, v in state.items()}

    def clients(self) -> list[int]:
        return sorted(self._d)


class DiskStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, cid: int) -> Path:
        """The file holding client `cid`'s state (replaced, never edited: safe to hard-link)."""
        return self.root / f"client-{cid:05d}.safetensors"

    def get(self, cid: int) -> dict[str, torch.Tensor] | None:
        p = self.path(cid)
        return st_load(p.read_bytes()) if p.exists() else None

    def put(self, cid: int, state: dict[str, torch.Tensor]) -> None:
        atomic_write_bytes(self.path(cid), st_save({k: v.detach().contiguous() for k, v in state.items()}))

    def clients(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in self.root.glob("client-*.safetensors"))


def make_store(kind: str, root: Path) -> DiskStore | MemoryStore:
    return DiskStore(root) if kind == "disk" else MemoryStore()
