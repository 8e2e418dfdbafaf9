"""Instruction records through a causal LM: the prompt and response as token ids, the loss on the
response tokens only, greedy generation, and multiple-choice scoring by log-likelihood.

Rendering. The tokenizer's chat template when it has one (`apply_chat_template`: the context turns
with the generation prompt, then the same turns with the answer; the answer's tokens are what the
second adds, end-of-turn included). Without one, a stated plain template, Alpaca's without its
preamble: "### Instruction:\\n{user}\\n\\n### Response:\\n" per turn, a system turn as a first
paragraph, the response followed by EOS. A multiple-choice record lists its options under the
question, one "A. <text>" a line.

The prompt and the response are tokenized apart and concatenated: the model trains on exactly the
prompt ids it is later given to generate from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsplice.data.instruct import Instruction, option_text
from fedsplice.errors import ConfigError
from fedsplice.model.verbalizer import model_device, pad_embeds

PLAIN_TURN = "### Instruction:\n{user}\n\n### Response:\n"
TEMPLATES = ("auto", "chat", "plain")


@dataclass(frozen=True)
class Encoded:
    prompt: list[int]
    response: list[int]  # the answer's ids, its end (EOS or end-of-turn) included

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


def user_text(rec: Instruction, content: str) -> str:
    """The last user turn as shown: the question, then a multiple-choice record's options."""
    if not rec.choice:
        return content
    return content + "\n\n" + "\n".join(option_text(rec.options, i) for i in range(len(rec.options)))


def _turns(rec: Instruction) -> list[dict]:
    msgs = [{"role": r, "content": c} for r, c in rec.messages]
    msgs[-1] = {"role": "user", "content": user_text(rec, msgs[-1]["content"])}
    return msgs


def uses_chat(tokenizer, template: str) -> bool:
    if template not in TEMPLATES:
        raise ConfigError(f"model.chat_template = {template!r}; one of {', '.join(TEMPLATES)}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has:
        raise ConfigError("model.chat_template = 'chat' but the tokenizer has no chat template; set 'auto' or 'plain'")
    return has and template != "plain"


def plain_prompt(turns: list[dict]) -> str:
    out, pending = [], []
    for t in turns:
        if t["role"] == "system":
            out.append(t["content"] + "\n\n")
        elif t["role"] == "user":
            pending.append(PLAIN_TURN.format(user=t["content"]))
        else:  # an earlier answer closes its turn
            out.append("".join(pending) + t["content"] + "\n\n")
            pending = []
    return "".join(out) + "".join(pending)


def prompt_ids(tokenizer, rec: Instruction, template: str = "auto") -> list[int]:
    turns = _turns(rec)
    if uses_chat(tokenizer, template):
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(plain_prompt(turns))["input_ids"])


def answer_ids(tokenizer, rec: Instruction, answer: str, template: str = "auto", end: bool = True) -> list[int]:
    """The ids of `answer` as the assistant's turn after rec's prompt; `end`: with its end token."""
    if uses_chat(tokenizer, template):
        turns = _turns(rec)
        head = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": answer}], tokenize=False)
        if not full.startswith(head):
            raise ConfigError("the tokenizer's chat template renders the conversation differently once the "
                              "answer is added, so the answer's tokens cannot be told apart; "
                              "set model.chat_template = 'plain'")
        tail = full[len(head):] if end else answer
        return list(tokenizer(tail, add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if end and eos is None:
        raise ConfigError("the tokenizer has no EOS token to end an answer with; give it one (eos_token)")
    return ids + [eos] if end else ids


def encode(tokenizer, rec: Instruction, template: str = "auto") -> Encoded:
    return Encoded(prompt_ids(tokenizer, rec, template), answer_ids(tokenizer, rec, rec.response, template))


def fit(e: Encoded, max_length: int, bos: int | None = None) -> Encoded:
    """`e` within max_length tokens: the prompt cut from the left (a leading `bos` kept), so the
    question's end and the whole answer stay; an answer longer than max_length - 1 keeps its start
    (and loses its end token). `fedsplice.federation.generative` counts and reports such records."""
    if len(e) <= max_length:
        return e
    room = max(max_length - len(e.response), 1)
    head = e.prompt[:1] if bos is not None and e.prompt[:1] == [bos] and room > 1 else []
    prompt = head + e.prompt[len(e.prompt) - (room - len(head)):]
    return Encoded(prompt, e.response[:max_length - len(prompt)])


def padded(lm, seqs: Sequence[list[int]], pad_id: int, prefix=None, bos: int | None = None, left: bool = False):
    """({input_ids} or, with image tokens, {inputs_embeds}; attention mask) of `seqs`, left- or right-
    padded; prefix[i] ([T, d] or None) goes after row i's BOS (`verbalizer.pad_embeds`)."""
    dev = model_device(lm)
    if prefix is not None and any(x is not None for x in prefix):
        embeds, mask = pad_embeds(lm, seqs, prefix, dev, bos, left)
        return {"inputs_embeds": embeds}, mask
    n = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, x in enumerate(seqs):
        at = slice(n - len(x), n) if left else slice(0, len(x))
        ids[i, at], mask[i, at] = torch.tensor(x), 1
    return {"input_ids": ids.to(dev)}, mask.to(dev)


def _images(prefix, n: int) -> list[int]:
    return [0 if prefix is None or prefix[i] is None else len(prefix[i]) for i in range(n)]


def response_nll(lm, batch: Sequence[Encoded], pad_id: int, prefix=None,
                 bos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ -log p over each row's response tokens [B], their count [B]); right-padded, one forward,
    row i's image tokens prefix[i] (if any) before its prompt. Differentiable: a training loss is
    nll.sum() / count.sum() (the mean over the batch's response tokens, as Hugging Face's
    trainers take it)."""
    img = _images(prefix, len(batch))
    inputs, mask = padded(lm, [e.prompt + e.response for e in batch], pad_id, prefix, bos)
    target = torch.full(mask.shape, -100, dtype=torch.long)
    for i, e in enumerate(batch):
        start = len(e.prompt) + img[i]
        target[i, start:start + len(e.response)] = torch.tensor(e.response)
    logits = lm(**inputs, attention_mask=mask).logits[:, :-1].float()
    tgt = target[:, 1:].to(logits.device)
    nll = F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=-100, reduction="none")
    count = (tgt != -100).sum(1)
    return nll.sum(1), count


def prompt_features(lm, prompts: Sequence[list[int]], pad_id: int, prefix=None, bos: int | None = None) -> torch.Tensor:
    """The last layer's hidden state at each prompt's last token [B, D] (a record's summary, the
    input features FedDPA compares): right-padded, so causal attention never sees the padding."""
    inputs, mask = padded(lm, prompts, pad_id, prefix, bos)
    hidden = lm(**inputs, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    last = torch.tensor([len(p) + k - 1 for p, k in zip(prompts, _images(prefix, len(prompts)))])
    return hidden[torch.arange(len(prompts)), last.to(hidden.device)]


def stop_ids(lm, tokenizer) -> list[int]:
    """The token ids that end an answer: the tokenizer's EOS and the model's generation config's."""
    out = {tokenizer.eos_token_id}
    cfg = getattr(lm, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    out |= set(eos) if isinstance(eos, list) else {eos}
    return sorted(i for i in out if i is not None)


@torch.no_grad()
def greedy(lm, tokenizer, prompts: Sequence[list[int]], *, max_new_tokens: int, stop: Sequence[str] = (),
           batch_size: int = 16, pad_id: int = 0, prefix=None, bos: int | None = None) -> list[str]:
    """Greedy answers to token-id prompts (prompt i after its image tokens prefix[i], if any), in the
    order given: batched shortest first (left-padded, Hugging Face's `generate` with its KV cache),
    each stopped at an end token or after the first of `stop` (which is cut off), decoded without
    special tokens."""
    img = _images(prefix, len(prompts))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + img[i])
    out = [""] * len(prompts)
    ends = stop_ids(lm, tokenizer)
    for s in range(0, len(order), batch_size):
        rows = order[s:s + batch_size]
        inputs, mask = padded(lm, [prompts[i] for i in rows], pad_id,
                              None if prefix is None else [prefix[i] for i in rows], bos, left=True)
        kw = {"stop_strings": list(stop), "tokenizer": tokenizer} if stop else {}
        gen = lm.generate(**inputs, attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=ends, pad_token_id=pad_id, **kw)
        new = 0 if "inputs_embeds" in inputs else mask.shape[1]  # from embeddings, generate returns new tokens only
        for j, i in enumerate(rows):
            text = tokenizer.decode(gen[j, new:], skip_special_tokens=True)
            for st in stop:
                text = text.split(st)[0]
            out[i] = text.strip()
    return out


@torch.no_grad()
def option_logliks(lm, tokenizer, rec: Instruction, template: str = "auto", pad_id: int = 0,
                   image: torch.Tensor | None = None) -> torch.Tensor:
    """Σ log p of each option, written as an answer gives it ("B. <text>", no end token), after
    rec's prompt (and its image tokens) [n_options]: the choice by log-likelihood is its argmax."""
    p = prompt_ids(tokenizer, rec, template)
    batch = [Encoded(p, answer_ids(tokenizer, rec, option_text(rec.options, i), template, end=False))
             for i in range(len(rec.options))]
    nll, _ = response_nll(lm, batch, pad_id, None if image is None else [image] * len(batch),
                          getattr(tokenizer, "bos_token_id", None))
    return -nll.cpu()
