"""One LoRA Linear of a batched round, forward and backward: the grouped forms of s·B_k A_k x
against the frozen base Linear beside them (issue 50; `fedsplice.model.grouped`).

    python benchmarks/grouped_lora.py [--quick] [--reps N] [--threads N]

Rows of m clients (16 texts of 32 tokens each, MiniLM's width 384 in) pass through
  - segments (fedsplice's `Rows.apply`): each owner's rows as one segment through two plain
    matmuls with its own factors; "ordered": the rows come sorted by owner (views, no copy);
    "interleaved": owners alternate row by row (sorted, then put back: two copies);
  - gathered (fedsplice's form before this benchmark): each row's factors gathered (A[own],
    B[own]) and applied as a batched matmul of r-wide slices (`einsum`);
  - dense, masked: every client's A at once (x · [A_1; ...; A_m]^T), the other owners' columns
    zeroed, then every B at once; as fast for small m·r, but one client's inf reaches the other
    clients' gradients (0·inf is NaN), so fedsplice does not use it;
  - the frozen base Linear alone (d_in 384 -> d_out; its weight takes no gradient).
Each cell: the median of `--reps` timed calls (forward, sum, backward; the input takes a gradient,
as a layer inside the model's stack does) after a warm-up, all forms interleaved. `--quick`: two
shapes, 3 reps (a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._common import report  # noqa: E402
from fedsplice.model.grouped import Rows  # noqa: E402

SHAPES = ((2, 8, 384), (4, 8, 384), (4, 8, 1536), (8, 8, 384), (8, 16, 384), (8, 64, 384), (8, 64, 1536))
ROWS, TOKENS, D_IN, SCALE = 16, 32, 384, 2.0


def gathered(x, a, b, own):
    h = torch.einsum("bld,brd->blr", x, a[own])
    return torch.einsum("blr,bor->blo", h, b[own]) * SCALE


def masked(x, a, b, own):
    m, r, d = a.shape
    h = (x.reshape(-1, d) @ a.reshape(m * r, d).t()).view(x.shape[0], -1, m, r)
    h = h * torch.nn.functional.one_hot(own, m).to(x.dtype).view(-1, 1, m, 1)
    bc = b.permute(1, 0, 2).reshape(b.shape[1], m * r)
    return (h.reshape(-1, m * r) @ bc.t()).view(x.shape[0], x.shape[1], -1) * SCALE


def timed(f, x, a, b) -> float:
    t0 = time.perf_counter()
    f(x, a, b).sum().backward()
    return time.perf_counter() - t0


def shape_row(m: int, r: int, d_out: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = ROWS * m
    x = torch.randn(n, TOKENS, D_IN, generator=g, requires_grad=True)
    a = torch.randn(m, r, D_IN, generator=g, requires_grad=True)
    b = torch.randn(m, d_out, r, generator=g, requires_grad=True)
    base = torch.nn.Linear(D_IN, d_out).requires_grad_(False)
    inter = torch.arange(n) % m
    ordered, mixed = Rows(inter.sort().values), Rows(inter)
    forms = {"segments, ordered": lambda x, a, b: ordered.apply(x, a, b, SCALE),
             "segments, interleaved": lambda x, a, b: mixed.apply(x, a, b, SCALE),
             "gathered": lambda x, a, b: gathered(x, a, b, inter),
             "dense, masked": lambda x, a, b: masked(x, a, b, inter),
             "base Linear": lambda x, a, b: base(x)}
    assert torch.allclose(mixed.apply(x, a, b, SCALE), gathered(x, a, b, inter), rtol=1e-4, atol=1e-3)
    times: dict[str, list[float]] = {k: [] for k in forms}
    for rep in range(reps + 1):
        for k, f in forms.items():
            t = timed(f, x, a, b)
            if rep:  # the first round is a warm-up
                times[k].append(t)
    row: dict[str, object] = {"clients": m, "rank": r, "d_out": d_out}
    row.update({f"{k} ms": statistics.median(v) * 1e3 for k, v in times.items()})
    ratio = statistics.median(times["gathered"]) / statistics.median(times["segments, interleaved"])
    row["gathered / interleaved"] = f"{ratio:.2f}x"
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two shapes, 3 reps (a smoke run)")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shapes, reps = (SHAPES[:2], 3) if args.quick else (SHAPES, args.reps)
    rows = [shape_row(m, r, d_out, reps) for m, r, d_out in shapes]
    cols = ["clients", "rank", "d_out", "segments, ordered ms", "segments, interleaved ms", "gathered ms",
            "dense, masked ms", "base Linear ms", "gathered / interleaved"]
    report("grouped_lora", rows, cols, args.quick,
           [f"{ROWS} rows of {TOKENS} tokens a client, d_in {D_IN}, fp32, {args.threads} threads; forward + backward, "
            f"median of {reps} interleaved calls after a warm-up",
            "segments: fedsplice.model.grouped.Rows.apply; the other forms as the script's docstring says"])


if __name__ == "__main__":
    main()
