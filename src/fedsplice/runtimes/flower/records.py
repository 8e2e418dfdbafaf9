"""Name-keyed torch tensors <-> Flower ArrayRecords, what a Flower message weighs, and the
runtime's JSON-lines logs (`JsonLog`: events.jsonl, wire.jsonl).

Tensors travel as Flower `Array`s (NumPy `.npy` bytes, loaded with `allow_pickle=False`).
NumPy has no bfloat16, so bf16 tensors are widened to fp32 for the wire (exact) and narrowed
back to the receiver's own parameter dtype on arrival; fp32 and fp16 travel as they are.

`message_bytes` measures a message the way Flower 1.42 moves it: a message is a tree of
content-addressed objects (Message -> RecordDict -> ArrayRecord -> Array -> ArrayChunk), each
pushed/pulled as its serialized ("deflated") bytes under its 64-character object id, plus the
object tree itself. HTTP/TLS framing is not counted (it depends on the transport, not on us).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

WIRE_DTYPE = {torch.bfloat16: torch.float32}  # what numpy cannot hold travels widened (exactly)


def to_record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    rec = ArrayRecord()
    for name, t in tensors.items():
        t = t.detach().cpu()
        t = t.to(WIRE_DTYPE.get(t.dtype, t.dtype)).contiguous()
        rec[name] = Array(t.numpy())
    return rec


def wire_dtype(dtype: torch.dtype) -> str:
    """The numpy dtype name a tensor of `dtype` travels as."""
    return str(torch.empty(0, dtype=WIRE_DTYPE.get(dtype, dtype)).numpy().dtype)


class RecordError(ValueError):
    """An ArrayRecord that does not match what was expected (names, shapes, dtypes, values)."""


def decode(rec: ArrayRecord, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of `rec`, unchecked (the round loop validates uploads itself): a tensor that
    travelled widened (bf16 as fp32) is narrowed back to its `like` dtype. Only an Array that
    cannot be read at all is a RecordError."""
    out = {}
    for name in rec:
        arr = rec[name]
        if arr.stype != "numpy.ndarray":
            raise RecordError(f"{name}: serialization {arr.stype!r}, expected numpy.ndarray")
        try:
            a = arr.numpy()  # np.load(..., allow_pickle=False)
            t = torch.from_numpy(np.array(a, copy=True))
        except Exception as e:  # noqa: BLE001 - any malformed payload is a refusal, not a crash
            raise RecordError(f"{name}: unreadable array ({type(e).__name__}: {e})") from None
        ref = like.get(name)
        if ref is not None and ref.dtype in WIRE_DTYPE and t.dtype == WIRE_DTYPE[ref.dtype]:
            t = t.to(ref.dtype)
        out[name] = t
    return out


def from_record(rec: ArrayRecord, like: dict[str, torch.Tensor], *,
                private: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The tensors of `rec`, which must be exactly `like`'s names, shapes and (wire) dtypes,
    finite, and free of PRIVATE names; else RecordError (the SuperNode's check of what the
    server sent)."""
    names = set(rec.keys())
    leaked = sorted(names & private)
    if leaked:
        raise RecordError(f"carries PRIVATE tensor {leaked[0]}")
    unknown = sorted(names - set(like))
    if unknown:
        raise RecordError(f"carries unknown tensor {unknown[0]}")
    missing = sorted(set(like) - names)
    if missing:
        raise RecordError(f"lacks tensor {missing[0]}")
    out = decode(rec, like)
    for name, t in out.items():
        ref = like[name]
        if t.dtype != ref.dtype:
            raise RecordError(f"{name}: dtype {t.dtype}, expected {ref.dtype} (on the wire: {wire_dtype(ref.dtype)})")
        if tuple(t.shape) != tuple(ref.shape):
            raise RecordError(f"{name}: shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise RecordError(f"{name}: non-finite values")
    return out


@dataclass
class Weighed:
    """A message's serialized size and, for the audit, its serialized bytes."""

    total: int  # every object's id + deflated bytes, plus the object tree
    per_record: dict[str, int]  # RecordDict key -> bytes of the objects under it (not shared)
    blob: bytes  # all deflated objects, concatenated (what the wire audit scans)


def weigh(msg: Message) -> Weighed:
    objs = get_all_nested_objects(msg)
    blob = b"".join(o.deflate() for o in objs.values())
    total = len(blob) + sum(len(i) for i in objs) + get_object_tree(msg).ByteSize()
    per = {}
    if msg.has_content():
        for key, rec in msg.content.items():
            sub = get_all_nested_objects(rec)
            per[key] = sum(len(i) + len(o.deflate()) for i, o in sub.items())
    return Weighed(total, per, blob)


def scan(blob: bytes, names: set[str]) -> list[str]:
    """The names (e.g. PRIVATE tensor names) whose bytes occur anywhere in `blob`."""
    return sorted(n for n in names if n.encode() in blob)


def split_bytes(total: int, parts: int) -> list[int]:
    """`total` bytes shared by `parts` clients (integers that add up to total)."""
    base = total // parts
    return [base + (1 if i < total - base * parts else 0) for i in range(parts)]


def wire_scalar(x):
    """json.dumps default for the wire: numpy / torch scalars as Python numbers. A NaN metric
    stays NaN there (Python's json reads it back), so the server's summaries over clients equal
    the simulation's; files go through strict_record instead."""
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def strict_record(x):
    """`x` as strict JSON values for a file (events.jsonl, wire.jsonl): scalars as wire_scalar
    gives them, non-finite floats as None (null). The runtime's copy of
    fedsplice.data.assets.strict_json, which runtimes may not import."""
    if isinstance(x, dict):
        return {k: strict_record(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_record(v) for v in x]
    if isinstance(x, np.generic) or (isinstance(x, torch.Tensor) and x.numel() == 1):
        x = wire_scalar(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class JsonLog:
    """Append-only JSON lines (events.jsonl, wire.jsonl); a fresh file per run."""

    def __init__(self, path: Path, echo: Callable[[str], None] | None = None, keep: int | None = 0):
        """`keep`: lines of an earlier start to keep (a resumed run; None: all); 0: a fresh file."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        old = self.path.read_text().splitlines(keepends=True) if keep != 0 and self.path.is_file() else []
        old = old[:keep] if keep is not None else old
        self.path.write_text("".join(old))
        self.echo = echo
        self.count = len(old)

    def __call__(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(strict_record(record), allow_nan=False) + "\n")  # NaN -> null
        self.count += 1
        if self.echo:
            self.echo(f"[fedsplice] {record.get('event', '')}: " +
                      ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("time", "event")))
