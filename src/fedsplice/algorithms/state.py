"""A method's own client state (Recipe.state), typed where the method works with it and flat
name-keyed tensors only where the client's state is stored (the store, checkpoints, a Flower
SuperNode): `pack` on the way in, `unpack` on the way out, so a resumed or remote client
continues with exactly the state it had.

A state is a dataclass whose every field has a default that says its kind: an int, a float or a
bool (stored as a 0-d int64 / float64 / bool tensor, so it reads back exactly), a dict of tensors
(stored as "<field>/<key>"), or None for a tensor (absent until set). A method that declares none
keeps a plain tensor dict (Recipe.state = dict).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import torch

Tensors = dict[str, torch.Tensor]
KINDS = (bool, int, float, dict, type(None))  # bool before int: a bool is an int


def _default(f: dataclasses.Field[object]) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"method state field {f.name!r} needs a default (0, 0.0, False, a dict or None)")


def check(kind: type) -> None:
    """A state type fedsplice can store: dict, or a dataclass of the kinds above."""
    if kind is dict:
        return
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise TypeError(f"Recipe.state must be dict or a dataclass, got {kind!r}")
    for f in dataclasses.fields(kind):
        if not isinstance(_default(f), KINDS):
            raise TypeError(f"method state field {f.name!r}: its default must be an int, float, bool, dict or "
                            f"None (a tensor), got {_default(f)!r}")


def fresh(kind: type) -> object:
    """The state of a client that has none yet."""
    return {} if kind is dict else kind()


def pack(state: object) -> Tensors:
    """The state as flat tensors (a tensor dict as it is)."""
    if isinstance(state, dict):
        return dict(state)
    out: Tensors = {}
    for f in dataclasses.fields(state):  # type: ignore[arg-type]  # a dataclass instance (check)
        v = getattr(state, f.name)
        if isinstance(v, dict) and all(torch.is_tensor(t) for t in v.values()):
            out.update({f"{f.name}/{k}": t for k, t in v.items()})
        elif isinstance(v, (bool, np.bool_)):
            out[f.name] = torch.tensor(bool(v))
        elif isinstance(v, numbers.Integral):
            out[f.name] = torch.tensor(int(v), dtype=torch.int64)
        elif isinstance(v, numbers.Real):
            out[f.name] = torch.tensor(float(v), dtype=torch.float64)
        elif torch.is_tensor(v):
            out[f.name] = v
        elif v is not None:
            raise TypeError(f"method state field {f.name!r} holds {type(v).__name__}; a state stores ints, floats, "
                            f"bools, tensors and dicts of tensors")
    return out


def unpack(kind: type, flat: Tensors) -> object:
    """`pack`'s inverse: the state of type `kind` (fields absent from `flat` keep their defaults).
    A key of no field is an error, but where `kind` has exactly one dict field: there it is the
    layout before method states were typed (FedPuReL's branch tensors at the top), read into it."""
    if kind is dict:
        return dict(flat)
    fields = dataclasses.fields(kind)
    dicts = [f.name for f in fields if isinstance(_default(f), dict)]
    stray = [k for k in flat if k not in {f.name for f in fields} and k.split("/", 1)[0] not in dicts]
    if stray and len(dicts) == 1:
        flat = {(f"{dicts[0]}/{k}" if k in stray else k): t for k, t in flat.items()}
    elif stray:
        raise ValueError(f"method state keys {sorted(stray)[:3]} are no field of {kind.__name__}; a store written "
                         f"by another fedsplice version?")
    values: dict[str, object] = {}
    for f in fields:
        default = _default(f)
        if isinstance(default, dict):
            values[f.name] = {k[len(f.name) + 1:]: t for k, t in flat.items() if k.startswith(f.name + "/")}
        elif f.name in flat:
            t = flat[f.name]
            values[f.name] = (bool(t) if isinstance(default, bool) else int(t) if isinstance(default, int)
                              else float(t) if isinstance(default, float) else t)
    return kind(**values)
