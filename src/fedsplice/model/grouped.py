"""Many clients through one base model (issue 50): each row of a batch passes through the frozen
base weights together with every other row, and through its own client's LoRA factors.

A row's client travels with its text: an `Owned` text is a `str` (token, prefix and feature
caches key on its content, and sorting or unpadding moves it with its row) that also carries
its owner, an index into the stacked factors. `TextEncoder.encode` reads the owners of the rows
of each backbone call (`rows_of`), and inside `grouped(model, factors)` every named peft LoRA
Linear adds, for row b, s·B_k A_k x_b with k = owner(b), from `factors[name] = (A [m, r, d_in],
B [m, d_out, r])`: the rows of each owner as one segment, through two plain matmuls with its
factors (the same on CUDA). Modules not named keep their own adapter (the GLOBAL LoRA every
client shares).

Why segments: gathering each row's factors and applying them as a batched matmul of r-wide
slices took 1.5-5.5x the time of ordered segments a layer, and 1.4-6x that of the frozen base
Linear beside it (`python benchmarks/grouped_lora.py`).
A dense form (every client's A at once, the other owners' columns masked) was as fast for small
m·r but lets one client's non-finite values reach the other clients' rows (0·inf is NaN in the
backward); segments keep every client's numbers its own, as when it trains alone.

The result for each row is the same function of its tokens as the client's own forward, so
logits agree with scoring each client apart within float rounding (tests/test_grouped.py). A
causal LM's verbalizer (`model.verbalizer`) lays out its calls' rows itself (a prompt pass, its
continuations, or a prompt per answer) and names their owners with `owned_rows`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import cast

import torch
from torch import nn


class Owned(str):
    """A text and the index of the client whose adapters score it."""

    owner: int

    def __new__(cls, text: str, owner: int) -> Owned:
        s = super().__new__(cls, text)
        s.owner = owner
        return s


class Rows:
    """One backbone call's row owners, with their segments worked out once for all its layers:
    `counts[k]` rows of owner k; `perm` orders the rows by owner (stable; None: they are already)
    and `inv` puts them back."""

    def __init__(self, own: torch.Tensor):
        self.own = own
        self.counts = torch.bincount(own).tolist() if own.numel() else []
        ordered = bool((own[1:] >= own[:-1]).all()) if own.numel() > 1 else True
        self.perm = None if ordered else torch.argsort(own, stable=True)
        self.inv = None if self.perm is None else torch.argsort(self.perm)

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
        """s·B_k A_k x_b for each row b of `x` [rows, ..., d_in], k its owner: [rows, ..., d_out]."""
        if len(self.counts) > a.shape[0]:
            raise IndexError(f"grouped LoRA: a row's owner {len(self.counts) - 1} has no factors (m = {a.shape[0]})")
        if not self.counts:
            return x.new_zeros(*x.shape[:-1], b.shape[1])
        xs = x if self.perm is None else x.index_select(0, self.perm.to(x.device))
        parts = [(xk @ a[k].t().to(xk.dtype)) @ b[k].t().to(xk.dtype)
                 for k, xk in enumerate(xs.split(self.counts)) if self.counts[k]]
        d = torch.cat(parts) * s
        return d if self.inv is None else d.index_select(0, self.inv.to(d.device))


_ROWS: ContextVar[Rows | None] = ContextVar("fedsplice_grouped_rows", default=None)


def owners_of(texts: Sequence[object]) -> torch.Tensor | None:
    """The owners of `texts` in order (None where they are not `Owned`)."""
    owned = [t for t in texts if isinstance(t, Owned)]
    if not owned:
        return None
    if len(owned) != len(texts):
        raise ValueError("grouped LoRA: some texts of one call have an owner and some do not")
    return torch.tensor([t.owner for t in owned], dtype=torch.long)


@contextmanager
def owned_rows(own: torch.Tensor | None) -> Iterator[None]:
    """The owners of one backbone call's rows, as given (None: no owners, nothing changes). A
    causal LM's verbalizer sets them for each of its calls, whose rows it lays out itself."""
    if own is None:
        yield
        return
    token = _ROWS.set(Rows(own))
    try:
        yield
    finally:
        _ROWS.reset(token)


def owner_order(texts: Sequence[object]) -> torch.Tensor | None:
    """The stable permutation that orders `texts` by owner (None: they are in order already, or
    not Owned). A call whose rows come in this order runs each LoRA layer's segments as views of
    its input, without the two copies an interleaved call costs per layer (Rows.apply)."""
    own = owners_of(texts)
    if own is None or own.numel() < 2 or bool((own[1:] >= own[:-1]).all()):
        return None
    return torch.argsort(own, stable=True)


def rows_of(texts: Sequence[object]) -> AbstractContextManager[None]:
    """The owners of one backbone call's rows, one per text (texts not `Owned`: nothing changes)."""
    return owned_rows(owners_of(texts))


def _grouped_forward(mod: nn.Module, a: torch.Tensor, b: torch.Tensor):
    base = cast(nn.Module, mod.base_layer)  # peft's LoRA Linear
    drop, s = cast(nn.ModuleDict, mod.lora_dropout)["default"], float(cast(dict, mod.scaling)["default"])

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if mod.disable_adapters:  # peft's disable_adapter(): the frozen model (e.g. class embeddings
            return base(x, *args, **kwargs)  # recomputed with runtime.cache = false), as peft's own forward
        rows = _ROWS.get()
        if rows is None or rows.own.shape[0] != x.shape[0]:
            raise RuntimeError("grouped LoRA: a forward whose rows have no owners (the texts must be Owned)")
        out = base(x, *args, **kwargs)
        delta = rows.apply(drop(x), a, b, s)
        return out + delta.reshape(out.shape).to(out.dtype)

    return forward


def lora_modules(names: Iterable[str]) -> list[str]:
    """The LoRA Linear modules that tensors `names` ("<module>.lora_A.default.weight", ...) sit in."""
    return sorted({n.rsplit(".lora_", 1)[0] for n in names})


Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]  # {LoRA module: (A [m, r, d_in], B [m, d_out, r])}


def stacked(mods: list[str], tensors: Sequence[Mapping[str, torch.Tensor]]) -> Factors:
    """`grouped`'s factors: for each module, (A, B) of every tensor dict in `tensors`, stacked in
    that order (owner k's are tensors[k]'s; torch.stack: gradients reach each dict's own)."""
    return {m: (torch.stack([t[f"{m}.lora_A.default.weight"] for t in tensors]),
                torch.stack([t[f"{m}.lora_B.default.weight"] for t in tensors])) for m in mods}


@contextmanager
def grouped(model: nn.Module, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Inside: each peft LoRA Linear named in `factors` ({module name: (A [m, r, d_in], B [m,
    d_out, r])}) adds its row owner's s·B A x instead of its own adapter's (restored on exit)."""
    mods = dict(model.named_modules())
    missing = [n for n in factors if not isinstance(getattr(mods.get(n), "scaling", None), dict)]
    if missing:
        raise ValueError(f"grouped LoRA: {missing[:3]} are not LoRA layers of the model")
    done = []
    try:
        for name, (a, b) in factors.items():
            mods[name].forward = _grouped_forward(mods[name], a, b)
            done.append(mods[name])
        yield
    finally:
        for mod in done:
            del mod.forward  # the class's forward again
