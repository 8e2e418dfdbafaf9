"""A ledger of what left each site: one JSON line per tensor sent, per client, per round.

Each client appends to `site-<cid>.jsonl` in its own ledger folder (the run's `ledger/` in a
simulation; the SuperNode's state folder on Flower) the rows of every upload it makes; the
server appends to `server.jsonl` the rows of every upload it accepted, and writes `split.json`
(the run's GLOBAL and PRIVATE names). A row: round, client, tensor name, shape, dtype, bytes
(the tensor's data, without the envelope), the SHA-256 of those bytes, the ε spent after that
round (null without [privacy]) and whether it went through secure aggregation (`secagg`).

Under Flower's SecAgg+ (privacy.secure_aggregation) nothing leaves a site in the clear: the site
writes the rows of the update it contributed (`secagg: true`; they never reach the server) and
the rows of the masked vector it sent (`masked: true`: one per array as Flower serialized it, the
weight first, named SECAGG_WEIGHT), and the server writes the rows of the masked vectors it
received, which are all it ever sees. `check` compares the two views and the split: `fedsplice
audit RUN`.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsplice.core import wire
from fedsplice.data.assets import atomic_write_json

SPLIT, SERVER = "split.json", "server.jsonl"
SECAGG_WEIGHT = "secagg.weight"  # a SecAgg+ masked vector's first array: the client's masked weight
Row = dict[str, Any]  # one ledger line (JSON): round, client, name, shape, dtype, bytes, sha256, epsilon, ...


def rows(payload: bytes, rnd: int, cid: int, epsilon: float | None, local_epsilon: float | None = None,
         secagg: bool = False) -> list[Row]:
    """The ledger rows of one upload: its tensors as serialized, in name order; `epsilon`: the
    client-level ε spent so far ([privacy] mode), `local_epsilon`: this client's DP-SGD ε;
    `secagg`: the upload is summed by SecAgg+ (what travels is its masked vector, `masked_rows`)."""
    out = []
    for name, t in sorted(wire.decode(payload).items()):
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append({"round": rnd, "client": cid, "name": name, "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."), "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(), "epsilon": epsilon, "local_epsilon": local_epsilon,
                    "secagg": secagg})
    return out


def masked_rows(arrays: list[bytes], names: list[str], rnd: int, cid: int, epsilon: float | None,
                local_epsilon: float | None = None) -> list[Row]:
    """The rows of one SecAgg+ masked vector as it travels: Flower's serialized arrays (numpy's
    .npy bytes), the weight first, then one per GLOBAL tensor in the order sent (`names`)."""
    out = []
    for name, data in zip([SECAGG_WEIGHT, *names], arrays, strict=True):
        a = np.load(io.BytesIO(data), allow_pickle=False)
        out.append({"round": rnd, "client": cid, "name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                    "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "epsilon": epsilon,
                    "local_epsilon": local_epsilon, "secagg": True, "masked": True})
    return out


def site_masked(folder: Path, cid: int, rnd: int, arrays: list[bytes], names: list[str], epsilon: float | None,
                local_epsilon: float | None = None) -> None:
    """A SecAgg+ client's record of the masked vector it sent."""
    append(site_file(folder, cid), masked_rows(arrays, names, rnd, cid, epsilon, local_epsilon))


def sent(row: Row) -> bool:
    """Whether the row is of bytes that left the site: a SecAgg+ client's own update does not."""
    return bool(row.get("masked")) or not row.get("secagg")


def append(path: Path, new: list[Row]) -> None:
    """Append rows as JSON lines, in one write (a killed process leaves whole lines only)."""
    if not new:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in new))


def site_file(folder: Path, cid: int) -> Path:
    return Path(folder) / f"site-{cid}.jsonl"


def site_upload(folder: Path, cid: int, rnd: int, payload: bytes, epsilon: float | None,
                local_epsilon: float | None = None, secagg: bool = False) -> None:
    """A client's own record of an upload, written before it leaves."""
    append(site_file(folder, cid), rows(payload, rnd, cid, epsilon, local_epsilon, secagg))


def write_split(folder: Path, global_names: list[str], private_names: list[str]) -> None:
    atomic_write_json(folder / SPLIT, {"global": sorted(global_names), "private": sorted(private_names)})
    (folder / SERVER).touch(exist_ok=True)  # a run that sends nothing (local-only) has an empty ledger


def read(path: Path) -> list[Row]:
    """The rows of a ledger file; a line that is not a JSON object is an error naming it."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: not a ledger row (a JSON object per line)")
        out.append(row)
    return out


_KEY = ("round", "client", "name", "masked")
_SAME = ("shape", "dtype", "bytes", "sha256")


def check(split: dict[str, list[str]], server: list[Row], sites: dict[str, list[Row]]
          ) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """(every mismatch, a summary per site) of the server's view against the sites' ledgers and
    the split: no PRIVATE name, nor any name outside the GLOBAL ones, in any row; every row the
    server received equal to a row its client wrote. A row a client wrote and the server never
    accepted (a dropped or late reply) is counted, not a mismatch. A redone round (a resumed run)
    leaves a client's row more than once: the server's row must equal one of them."""
    private, allowed = set(split["private"]), set(split["global"])
    bad: list[str] = []
    out: dict[tuple[object, ...], list[Row]] = defaultdict(list)  # what the sites sent, by _key
    summary: dict[int, dict[str, Any]] = {}
    for where, rs in [*sites.items(), ("server", server)]:
        for r in rs:
            if r["name"] == SECAGG_WEIGHT and r.get("masked"):
                continue
            if r["name"] in private:
                bad.append(f"{where}: round {r['round']} client {r['client']}: PRIVATE tensor {r['name']} "
                           f"left the site")
            elif r["name"] not in allowed:
                bad.append(f"{where}: round {r['round']} client {r['client']}: {r['name']} is not a GLOBAL tensor")
    for where, rs in sites.items():
        for r in rs:
            s = summary.setdefault(r["client"], {"rounds": set(), "tensors": 0, "bytes": 0, "epsilon": None,
                                                 "received": 0, "file": where})
            if not sent(r):
                continue
            out[_key(r)].append(r)
            s["rounds"].add(r["round"])
            s["tensors"] += 1
            s["bytes"] += r["bytes"]
            if r.get("epsilon") is not None:
                s["epsilon"] = max(s["epsilon"] or 0.0, r["epsilon"])
    for r in server:
        mine = out.get(_key(r))
        if r.get("secagg") and not r.get("masked"):
            bad.append(f"server: round {r['round']} client {r['client']}: {r['name']} received unmasked from a "
                       f"SecAgg+ client")
        elif not mine:
            bad.append(f"server: round {r['round']} client {r['client']}: {r['name']} received, but the "
                       f"client's ledger has no such row")
        elif not any(all(m[k] == r[k] for k in _SAME) for m in mine):
            diff = [k for k in _SAME if mine[-1][k] != r[k]]
            bad.append(f"server: round {r['round']} client {r['client']}: {r['name']} differs from what the "
                       f"client sent ({', '.join(diff)})")
        else:
            summary[r["client"]]["received"] += 1
    for s in summary.values():
        s["rounds"] = len(s["rounds"])
    return bad, dict(sorted(summary.items()))


def _key(row: Row) -> tuple[object, ...]:
    return tuple(bool(row.get(k)) if k == "masked" else row[k] for k in _KEY)
