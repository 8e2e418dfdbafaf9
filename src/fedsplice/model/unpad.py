"""Unpadded batches: a batch runs as a few sub-batches of similar length, so the linear layers
see (almost) only real tokens and attention runs over each sequence's own length.

A padded batch pushes B x (its longest member) token rows through every layer: on the fortunes
texts (MiniLM tokenizer, cap 64) that is 1.93x the real tokens. Sorting the batch by length and
cutting it where the padding saved outweighs a forward call's fixed cost (`overhead`, in token
rows) keeps 1.19x for 2-3 calls, and a PFAdapter training step on this CPU runs 1.3-1.4x faster in
fp32 (benchmarks/unpad.py). Each sequence's result is the same function of its own tokens either way
(padding is masked), so outputs, losses and gradients agree within float rounding; the rows come
back in the batch's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# A forward + backward call's fixed cost in token rows, from benchmarks/unpad.py's sweep on MiniLM
# (fp32, this CPU's 2 threads): 0 -> 13 calls a batch and 1.6x slower than 64; 512 -> almost no
# cuts. 64 and 128 are within the sweep's noise (about 15%: it is not interleaved), and so is
# every value tried under bf16 autocast, where unpadding gains 1.07x a step, not fp32's 1.3-1.4x.
CPU_OVERHEAD = 64


def groups(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """Indices into `lengths`, sorted by length and cut into consecutive groups that minimise
    sum(len(group) x longest(group) + overhead): dynamic programming over the sorted lengths."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    ls = [lengths[i] for i in order]
    n = len(ls)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + (j - i) * ls[j - 1] + overhead
            if c < best[j]:
                best[j], cut[j] = c, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j]:j])
        j = cut[j]
    return out[::-1]


def by_length(lengths: Sequence[int], fn: Callable[[list[int]], torch.Tensor],
              overhead: int | None, within: Sequence[int] | None = None) -> torch.Tensor:
    """fn(indices) -> rows [len(indices), ...] for each group of `groups`, stacked back in the
    order of `lengths`. overhead None (or a single group): one call on every index, in order.
    `within`: each call's indices ordered by these keys (stable), e.g. the rows' owners in a
    batched round, whose grouped LoRA layers then take each owner's rows as one slice."""
    n = len(lengths)
    parts = groups(lengths, overhead) if overhead is not None and n > 1 else [list(range(n))]
    if len(parts) == 1:  # one call: the rows in their own order (a single group comes sorted by length)
        parts = [list(range(n))]
    if within is not None:
        parts = [sorted(g, key=lambda i: within[i]) for g in parts]
    if len(parts) == 1 and parts[0] == list(range(n)):
        return fn(list(range(n)))
    out = torch.cat([fn(g) for g in parts])
    flat = torch.tensor([i for g in parts for i in g], device=out.device)
    return out[torch.argsort(flat)]  # a gather: differentiable, and each row lands once
