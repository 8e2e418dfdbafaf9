"""Closed-set classification with a causal LM: score each answer string by its log-likelihood.

``verbalizer_logits(model, tokenizer, prompts, answers)[b, c]`` is

    sum_t log p(answer_c token t | prompt_b, answer_c tokens < t)

with each answer tokenized with a leading space (" sports") and no special tokens, and each
prompt tokenized with the tokenizer's normal special tokens. The result is differentiable, so it
can be fed to a cross-entropy loss when fine-tuning (e.g. with LoRA).

Cost: the B prompts run once (left-padded, explicit ``position_ids`` so padding does not shift
positions, ``use_cache=True``); the key/value cache is then gathered to one row per (prompt,
multi-token answer) pair and only the answer continuations run on top of it. The first answer
token's log-probability comes from the prompt's last position, so one-token answers cost nothing
beyond the prompt pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from fedsplice.model.grouped import owned_rows, owners_of
from fedsplice.model.unpad import by_length

_ANSWER_CACHE: weakref.WeakKeyDictionary[object, dict] = weakref.WeakKeyDictionary()


def tokenize_answers(tokenizer, answers: Sequence[str]) -> list[list[int]]:
    """Token ids of each answer with one leading space and no special tokens (cached per tokenizer)."""
    key = tuple(answers)
    try:
        per_tok = _ANSWER_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        per_tok = {}
    if key in per_tok:
        return per_tok[key]
    out: list[list[int]] = []
    for a in answers:
        if not isinstance(a, str) or not a.strip():
            raise ValueError(f"verbalizer: answers must be non-empty strings, got {a!r}")
        ids = tokenizer(" " + a.strip(), add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"verbalizer: answer {a!r} tokenizes to nothing")
        out.append(list(ids))
    per_tok[key] = out
    return out


def pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return 0


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _left_pad(seqs: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, n - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, n - len(s):] = 1
    return ids.to(device), mask.to(device)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., target] without materializing the full log-softmax twice."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _checkpointing(model) -> bool:
    """Activation checkpointing while gradients flow: HF drops the cache, so skip straight to
    "full" (fedsplice trains with the backbone in eval mode and its layers in training mode)."""
    if not torch.is_grad_enabled():
        return False
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        try:
            flag = getattr(model, name)
        except Exception:
            continue
        return bool(flag)
    return False


def _forward(model, **kw):
    try:
        return model(**kw)
    except TypeError as e:  # a model without logits_to_keep
        if "logits_to_keep" in kw and "logits_to_keep" in str(e):
            kw.pop("logits_to_keep")
            return model(**kw)
        raise


def cut_prompt(ids: list[int], max_length: int, bos: int | None) -> list[int]:
    """A prompt's token ids cut to `max_length` from the left, so the template's end (the
    question the answer follows) stays; a leading BOS stays too. 0: no cut."""
    if not max_length or len(ids) <= max_length:
        return ids
    if bos is not None and ids[0] == bos:
        return [bos] + ids[len(ids) - max_length + 1:]
    return ids[len(ids) - max_length:]


def verbalizer_logits(model, tokenizer, prompts: Sequence[str], answers: Sequence[str],
                      *, method: str = "cache", prefix: Sequence | None = None,
                      max_length: int = 0, overhead: int | None = None) -> torch.Tensor:
    """[B, C] summed answer log-likelihoods (differentiable). See the module docstring.

    ``method="cache"`` (default) runs prompts once and continuations on a shared KV cache;
    ``method="full"`` runs all B·C full sequences in one padded batch (no cache; used
    automatically when the model returns no cache, e.g. under gradient checkpointing).
    ``prefix`` (vision-language LMs): per prompt, input embeddings [n_b, d] placed before the
    prompt's tokens (projected image tokens), or None for a prompt without an image.
    ``max_length``: each prompt's tokens cut to this many from the left (`cut_prompt`); 0: none.
    ``overhead``: unpadded batches (`fedsplice.model.unpad`): prompts of similar length (image
    tokens included) run together; None: one batch left-padded to its longest prompt.
    Prompts that are `model.grouped.Owned` texts: every row of every call runs through its prompt
    owner's LoRA factors (inside `model.grouped`).
    """
    if len(prompts) == 0 or len(answers) == 0:
        raise ValueError("verbalizer: need at least one prompt and one answer")
    if method not in ("cache", "full"):
        raise ValueError(f"verbalizer: method must be 'cache' or 'full', got {method!r}")
    device = model_device(model)
    pad = pad_id(tokenizer)
    bos = tokenizer.bos_token_id
    p_ids = [cut_prompt(list(tokenizer(p)["input_ids"]), max_length, bos) for p in prompts]
    if any(len(s) == 0 for s in p_ids):
        raise ValueError("verbalizer: a prompt tokenizes to nothing (and the tokenizer adds no BOS)")
    a_ids = tokenize_answers(tokenizer, answers)
    if prefix is not None and all(x is None for x in prefix):
        prefix = None
    own = owners_of(prompts)
    if overhead is None and own is None:
        return _scores(model, p_ids, a_ids, pad, device, prefix, bos, method, own)
    lengths = [len(p) + (0 if prefix is None or prefix[i] is None else len(prefix[i])) for i, p in enumerate(p_ids)]
    # a call's prompts ordered by owner: its continuation and full-path rows follow them (grouped.Rows)
    return by_length(lengths, lambda idx: _scores(model, [p_ids[i] for i in idx], a_ids, pad, device,
                                                  None if prefix is None else [prefix[i] for i in idx], bos, method,
                                                  None if own is None else own[torch.as_tensor(idx)]),
                     overhead, None if own is None else own.tolist())


def _scores(model, p_ids, a_ids, pad, device, prefix, bos, method, own=None) -> torch.Tensor:
    """[B, C] of `verbalizer_logits` for tokenized prompts, as one left-padded batch; `own`: the
    prompts' owners (None: not grouped)."""
    multi = [c for c, a in enumerate(a_ids) if len(a) > 1]
    ckpt = _checkpointing(model)
    # one-token answers need the prompt pass alone (no cache), checkpointing or not
    if method == "full" or (ckpt and multi):
        return _full(model, p_ids, a_ids, pad, device, prefix, bos, own)
    with owned_rows(own):
        out, mask = _prompt_pass(model, p_ids, pad, device, prefix, bos, use_cache=bool(multi))
    last = out.logits[:, -1, :].float()                                   # [B, V]
    last_lp = last - torch.logsumexp(last, dim=-1, keepdim=True)
    first = torch.tensor([a[0] for a in a_ids], device=device)
    scores = last_lp[:, first]                                            # [B, C]
    if not multi:
        return scores
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return _full(model, p_ids, a_ids, pad, device, prefix, bos, own)
    return scores + _continuations(model, cache, mask, a_ids, multi, pad, device, own)


def _prompt_pass(model, p_ids, pad, device, prefix, bos, use_cache: bool = True):
    """(output with the KV cache and the last position's logits, [B, P] attention mask) of the
    left-padded prompts (as embeddings, with their image tokens, when there is a prefix)."""
    if prefix is None:
        ids, mask = _left_pad(p_ids, pad, device)
        inputs = {"input_ids": ids}
    else:
        embeds, mask = pad_embeds(model, p_ids, prefix, device, bos)
        inputs = {"inputs_embeds": embeds}
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = _forward(model, **inputs, attention_mask=mask, position_ids=pos,
                   use_cache=use_cache, logits_to_keep=1)
    return out, mask


def _continuations(model, cache, mask, a_ids, multi, pad, device, own=None) -> torch.Tensor:
    """[B, C] log-likelihoods of the answer tokens after the first (zero for one-token answers):
    the multi-token answers continue every prompt on its gathered KV cache."""
    B, C, M = mask.shape[0], len(a_ids), len(multi)
    L = max(len(a_ids[c]) for c in multi) - 1     # continuation length (tokens 0..len-2 fed)
    cont = torch.full((M, L), pad, dtype=torch.long)
    tgt = torch.zeros((M, L), dtype=torch.long)
    cmask = torch.zeros((M, L), dtype=torch.long)
    for j, c in enumerate(multi):
        a = a_ids[c]
        n = len(a) - 1
        cont[j, :n] = torch.tensor(a[:-1])
        tgt[j, :n] = torch.tensor(a[1:])
        cmask[j, :n] = 1
    cont, tgt, cmask = cont.to(device), tgt.to(device), cmask.to(device)

    # rows ordered (b, j): row b*M + j continues prompt b with answer multi[j]
    rows_b = torch.arange(B, device=device).repeat_interleave(M)
    cache.batch_select_indices(rows_b)
    full_mask = torch.cat([mask[rows_b], cmask.repeat(B, 1)], dim=1)
    plen = mask.sum(-1)[rows_b]                                           # [B*M]
    cpos = plen[:, None] + torch.arange(L, device=device)[None, :]
    with owned_rows(None if own is None else own[rows_b.cpu()]):  # a continuation is its prompt's
        out2 = _forward(model, input_ids=cont.repeat(B, 1), attention_mask=full_mask,
                        position_ids=cpos, cache=cache, use_cache=True)
    lp = _token_logprobs(out2.logits, tgt.repeat(B, 1))                   # [B*M, L]
    rest = (lp * cmask.repeat(B, 1)).sum(-1).view(B, M)
    add = torch.zeros((B, C), dtype=rest.dtype, device=device)
    return add.index_copy(1, torch.tensor(multi, device=device), rest)


def pad_embeds(model, p_ids, prefix, device, bos=None, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Left- (or right-) padded [prefix_b ; embed(prompt_b)] rows (pads are zero vectors, masked
    out; a row without a prefix is its embeddings alone); a prompt that starts with BOS keeps it
    first, before the prefix (as LLaVA does)."""
    emb = model.get_input_embeddings()
    rows = [emb(torch.tensor(p, device=device)) for p in p_ids]
    cut = [1 if (bos is not None and p and p[0] == bos) else 0 for p in p_ids]
    rows = [r if x is None else torch.cat([r[:k], x.to(r.dtype), r[k:]]) for x, r, k in zip(prefix, rows, cut)]
    n = max(len(r) for r in rows)
    out = rows[0].new_zeros(len(rows), n, rows[0].shape[-1])
    mask = torch.zeros((len(rows), n), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        at = slice(n - len(r), n) if left else slice(0, len(r))
        out[i, at], mask[i, at] = r, 1
    return out, mask


def _full(model, p_ids, a_ids, pad, device, prefix=None, bos=None, own=None) -> torch.Tensor:
    """All B·C (prompt + answer) sequences in one batch: prompts left-, answers right-padded;
    row b·C + c is prompt b's (its owner's, where `own` names them)."""
    with owned_rows(None if own is None else own.repeat_interleave(len(a_ids))):
        return _full_rows(model, p_ids, a_ids, pad, device, prefix, bos)


def _full_rows(model, p_ids, a_ids, pad, device, prefix, bos) -> torch.Tensor:
    if prefix is not None:  # image tokens: one padded row per (prompt, answer) pair of embeddings
        B, C = len(p_ids), len(a_ids)
        seqs = [(p + a, x) for p, x in zip(p_ids, prefix) for a in a_ids]
        embeds, mask = pad_embeds(model, [s for s, _ in seqs], [x for _, x in seqs], device, bos)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        A = max(len(a) for a in a_ids)
        logits = _forward(model, inputs_embeds=embeds, attention_mask=mask, position_ids=pos,
                          use_cache=False, logits_to_keep=A + 1).logits  # only the answers' positions
        T = logits.shape[1]  # left padding: each row ends with its answer's tokens
        seq_lp = [_token_logprobs(logits[b * C + c, T - len(a) - 1:T - 1], torch.tensor(a, device=device)).sum()
                  for b in range(B) for c, a in enumerate(a_ids)]
        return torch.stack(seq_lp).view(B, C)
    B, C = len(p_ids), len(a_ids)
    P = max(len(s) for s in p_ids)
    A = max(len(a) for a in a_ids)
    n = B * C
    ids = torch.full((n, P + A), pad, dtype=torch.long)
    mask = torch.zeros((n, P + A), dtype=torch.long)
    tgt = torch.zeros((n, A), dtype=torch.long)
    tmask = torch.zeros((n, A), dtype=torch.long)
    for b, p in enumerate(p_ids):
        for c, a in enumerate(a_ids):
            r = b * C + c
            ids[r, P - len(p):P] = torch.tensor(p)
            mask[r, P - len(p):P] = 1
            ids[r, P:P + len(a)] = torch.tensor(a)
            mask[r, P:P + len(a)] = 1
            tgt[r, :len(a)] = torch.tensor(a)
            tmask[r, :len(a)] = 1
    ids, mask, tgt, tmask = ids.to(device), mask.to(device), tgt.to(device), tmask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    # the vocabulary's logits only where an answer token is predicted: the last A + 1 positions
    out = _forward(model, input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                   logits_to_keep=A + 1)
    logits = out.logits[:, -(A + 1):-1, :]   # positions P-1 .. P+A-2: position t predicts token t+1
    lp = _token_logprobs(logits, tgt)
    return (lp * tmask).sum(-1).view(B, C)
