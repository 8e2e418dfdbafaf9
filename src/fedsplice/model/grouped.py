"""Many clients through one base model (issue 50): each row of a batch passes through the frozen
base weights together with every other row, and through its own client's LoRA factors.

A row's client travels with its text: an `Owned` text is a `str` (token, prefix and feature
caches key on its content, and sorting or unpadding moves it with its row) that also carries
its owner, an index into the stacked factors. `TextEncoder.encode` reads the owners of the rows
of each backbone call (`rows_of`), and inside `grouped(model, factors)` every named peft LoRA
Linear adds, for row b, s·B_k A_k x_b with k = owner(b), from `factors[name] = (A [m, r, d_in],
B [m, d_out, r])` gathered per row and applied as one batched matmul (the same on CUDA). Modules
not named keep their own adapter (the GLOBAL LoRA every client shares).

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


_ROWS: ContextVar[torch.Tensor | None] = ContextVar("fedsplice_grouped_rows", default=None)


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
    token = _ROWS.set(own)
    try:
        yield
    finally:
        _ROWS.reset(token)


def rows_of(texts: Sequence[object]) -> AbstractContextManager[None]:
    """The owners of one backbone call's rows, one per text (texts not `Owned`: nothing changes)."""
    return owned_rows(owners_of(texts))


def _grouped_forward(mod: nn.Module, a: torch.Tensor, b: torch.Tensor):
    base = cast(nn.Module, mod.base_layer)  # peft's LoRA Linear
    drop, s = cast(nn.ModuleDict, mod.lora_dropout)["default"], float(cast(dict, mod.scaling)["default"])

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if mod.disable_adapters:  # peft's disable_adapter(): the frozen model (e.g. class embeddings
            return base(x, *args, **kwargs)  # recomputed with runtime.cache = false), as peft's own forward
        own = _ROWS.get()
        if own is None or own.shape[0] != x.shape[0]:
            raise RuntimeError("grouped LoRA: a forward whose rows have no owners (the texts must be Owned)")
        out = base(x, *args, **kwargs)
        own = own.to(x.device)
        xs = drop(x).reshape(x.shape[0], -1, x.shape[-1])
        h = torch.einsum("bld,brd->blr", xs, a[own].to(xs.dtype))
        delta = torch.einsum("blr,bor->blo", h, b[own].to(h.dtype)) * s
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
