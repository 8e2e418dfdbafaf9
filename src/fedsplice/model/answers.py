"""Free-text answers (model.task = "generate") over a TaskModel's causal LM: a plain object the
model holds (a module attribute would register the LM a second time), the records' encodings
cached once each, and each record's image tokens before its prompt when the model has a vision
tower (model.vision: the VLM path, as `fedsplice.model.scorers.VLMScorer` places them), the
response loss unpadded as the label-set batches are (runtime.unpad).

Image tokens are not counted in model.max_length: it bounds the text (prompt + response)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedsplice.model.generate import Encoded, encode, fit, greedy, option_logliks, prompt_features, response_nll
from fedsplice.model.unpad import by_length
from fedsplice.model.verbalizer import pad_id


class Answering:
    def __init__(self, lm: Callable[[], nn.Module], tokenizer, mcfg, image_tokens=None):
        self._lm, self.tokenizer, self.mcfg, self.image_tokens = lm, tokenizer, mcfg, image_tokens
        self.pad, self.bos = pad_id(tokenizer), getattr(tokenizer, "bos_token_id", None)
        self._encoded: dict[str, Encoded] = {}
        self.overhead: int | None = None  # runtime.unpad (`fedsplice.model.unpad`), set per mode by the model

    def _nll(self, lm, enc: list[Encoded], img) -> tuple[torch.Tensor, torch.Tensor]:
        """`response_nll` of the rows, unpadded: cut into sub-batches of similar length (the same
        math within rounding: each row's loss is a function of its own tokens)."""
        lengths = [len(e) + (0 if img is None or img[i] is None else len(img[i])) for i, e in enumerate(enc)]

        def part(idx: list[int]) -> torch.Tensor:
            sub = None if img is None else [img[i] for i in idx]
            nll, count = response_nll(lm, [enc[i] for i in idx], self.pad, sub, self.bos)
            return torch.stack([nll, count.to(nll.dtype)], 1)
        rows = by_length(lengths, part, self.overhead)
        return rows[:, 0], rows[:, 1]

    def encoded(self, item) -> Encoded:
        """An instruction record's prompt and response ids, fitted to model.max_length (the prompt
        cut from the left; `fedsplice.model.generate.fit`), once per record."""
        got = self._encoded.get(item)
        if got is None:
            got = self._encoded[item] = fit(encode(self.tokenizer, item, self.mcfg.chat_template),
                                            self.mcfg.max_length, self.bos)
        return got

    def images(self, items: list) -> list[torch.Tensor | None] | None:
        """Each record's projected image tokens (None for a record without an image); None when
        the model has no vision tower."""
        return None if self.image_tokens is None else self.image_tokens(items)

    def loss(self, items: list) -> torch.Tensor:
        """The mean -log p over the batch's response tokens (prompt tokens masked)."""
        nll, count = self._nll(self._lm(), [self.encoded(x) for x in items], self.images(items))
        return nll.sum() / count.sum().clamp(min=1)

    def features(self, items: list) -> torch.Tensor:
        return prompt_features(self._lm(), [self.encoded(x).prompt for x in items], self.pad, self.images(items),
                               self.bos)

    def answers(self, items: list, batch_size: int, max_new_tokens: int, stop) -> dict:
        """`TaskModel.answers`, in the mode and precision the caller set."""
        lm, enc = self._lm(), [self.encoded(x) for x in items]
        img = self.images(items)
        parts = [self._nll(lm, enc[i:i + batch_size], None if img is None else img[i:i + batch_size])
                 for i in range(0, len(enc), batch_size)]
        text = greedy(lm, self.tokenizer, [e.prompt for e in enc], max_new_tokens=max_new_tokens, stop=stop or (),
                      batch_size=batch_size, pad_id=self.pad, prefix=img, bos=self.bos)
        options = [option_logliks(lm, self.tokenizer, x, self.mcfg.chat_template, self.pad,
                                  None if img is None else img[i]).tolist() if x.choice else None
                   for i, x in enumerate(items)]
        nll = torch.cat([p[0] for p in parts]).double().cpu() if parts else torch.zeros(0)
        count = torch.cat([p[1] for p in parts]).long().cpu() if parts else torch.zeros(0)
        return {"nll": nll.tolist(), "tokens": count.tolist(), "text": text, "options": options}
