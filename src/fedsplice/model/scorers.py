"""One scorer per task: a batch of inputs (texts, or `Sample`s holding an image and/or a text) ->
class logits [B, C]. Each is called as scorer(items, class_emb, zero_shot).

  dual_encoder  s·cos(E(x), T(prompt(c)))  — zero-shot before any training (MiniLM; CLIP, whose
                E is the image tower and T the text tower)
  encoder_head  Linear(meanpool(E(x)))      — a trainable head (FedPer keeps it private)
  causal_lm     Σ log p(answer_c | prompt(x)) — verbalizer scoring (SmolLM2, Llama)
  vlm           the same with projected image tokens before the prompt (LLaVA-style)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fedsplice.data.samples import Sample
from fedsplice.errors import ConfigError
from fedsplice.model.cache import FrozenCache
from fedsplice.model.encoders import ClassSide, InputSide
from fedsplice.model.grouped import Owned
from fedsplice.model.verbalizer import verbalizer_logits
from fedsplice.model.vision import per_image, vision_tokens

if TYPE_CHECKING:
    from fedsplice.algorithms.hooks import Scorer


def cosine_logits(scale: float, features: torch.Tensor, class_emb: torch.Tensor) -> torch.Tensor:
    """s·cos(features, class_emb) in fp32, outside autocast: under bf16 a product at CLIP's s = 100
    would round the logits in steps of 0.125-0.25 (the towers still run in the autocast dtype)."""
    with torch.autocast(device_type=features.device.type, enabled=False):
        return scale * F.normalize(features.float(), dim=-1) @ class_emb.float().T


class DualEncoderScorer:
    def __init__(self, inputs: InputSide, classes: ClassSide, logit_scale: float):
        self.inputs, self.classes, self.logit_scale = inputs, classes, logit_scale

    def __call__(self, items: list, class_emb: torch.Tensor | None, zero_shot: bool) -> torch.Tensor:
        # With class-side adapters the class embeddings change every step while training;
        # evaluation passes them in once per model.
        ce = self.classes.embeddings(zero_shot) if class_emb is None else class_emb
        return cosine_logits(self.logit_scale, self.inputs(items, zero_shot), ce)


class Views:
    """hooks.InputViews of one batch: each view computed on first use."""

    def __init__(self, inputs: InputSide, items: list):
        self.inputs, self.items = inputs, items

    def pooled(self) -> torch.Tensor:
        return self.inputs(self.items, False)

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs.tokens(list(self.items))


class MethodScorer:
    """A method's own scorer (PromptParts.scorer: FedOTP's optimal transport on the token
    features): s·score(views of the batch, class side). The zero-shot model scores as the dual
    encoder does (pooled features, the template prompts)."""

    def __init__(self, inputs: InputSide, classes: ClassSide, logit_scale: float, score: Scorer):
        self.inputs, self.classes, self.logit_scale, self.score = inputs, classes, logit_scale, score

    def __call__(self, items: list, class_emb: torch.Tensor | None, zero_shot: bool) -> torch.Tensor:
        ce = self.classes.embeddings(zero_shot) if class_emb is None else class_emb
        if zero_shot:
            return cosine_logits(self.logit_scale, self.inputs(items, zero_shot), ce)
        return self.logit_scale * self.score(Views(self.inputs, items), ce)


class EncoderHeadScorer:
    def __init__(self, inputs: InputSide, head: nn.Linear):
        self.inputs, self.head = inputs, head

    def __call__(self, items: list, class_emb: torch.Tensor | None, zero_shot: bool) -> torch.Tensor:
        return self.head(self.inputs(items, zero_shot))


def lm_prompts(template: str, items: list) -> list[str]:
    """The prompt of each input: a sample's text (never its key), "" when it has none; an `Owned`
    text's prompt keeps its owner (the client whose LoRA scores it: model.grouped)."""
    text = [(s.text if isinstance(s, Sample) else s) for s in items]
    out = [template.format(text=t if t is not None else "") for t in text]
    return [Owned(p, t.owner) if isinstance(t, Owned) else p for p, t in zip(out, text)]


class CausalLMScorer:
    """Verbalizer scoring of the class names (each with a leading space) after the prompt."""

    def __init__(self, lm: nn.Module, tokenizer, class_names: list[str], template: str, max_length: int = 0):
        self.lm, self.tokenizer, self.template, self.max_length = lm, tokenizer, template, max_length
        self.answers = [" " + c for c in class_names]
        self.overhead: int | None = None  # unpadded batches (fedsplice.model.unpad); TaskModel sets it

    def __call__(self, items: list, class_emb: torch.Tensor | None, zero_shot: bool) -> torch.Tensor:
        if any(isinstance(s, Sample) and s.has_image for s in items):
            raise ConfigError("data.dataset holds images but model.task = 'causal_lm' reads text only; "
                              "set model.task = 'vlm' and model.vision")
        return verbalizer_logits(self.lm, self.tokenizer, lm_prompts(self.template, items), self.answers,
                                 max_length=self.max_length, overhead=self.overhead)


class ImageTokens:
    """Projected image tokens per sample (None without an image). The frozen tower's output is
    cached per image when `cache` is given (keyed by its pixels: easy-VQA asks ~10 questions per
    image, and |notext copies share it); the projector trains, so it always runs."""

    def __init__(self, tower: nn.Module, processor, projector: nn.Module, cache: FrozenCache | None):
        self.tower, self.processor, self.projector, self.cache = tower, processor, projector, cache

    def _tower(self, imgs: list) -> list[torch.Tensor]:
        return per_image(self.cache, imgs, lambda ss: vision_tokens(self.tower, self.processor, ss))

    def __call__(self, items: list) -> list[torch.Tensor | None]:
        has = [i for i, s in enumerate(items) if getattr(s, "has_image", False)]  # a Sample's or an Instruction's
        out: list[torch.Tensor | None] = [None] * len(items)
        if not has:
            return out
        feats = self._tower([items[i] for i in has])
        projected = self.projector(torch.stack(feats))  # one call: a tower gives every image T tokens
        for i, f in zip(has, projected):
            out[i] = f
        return out


class VLMScorer:
    """Verbalizer scoring with each sample's image tokens placed before its prompt."""

    def __init__(self, lm: CausalLMScorer, image_tokens: ImageTokens):
        self.lm, self.image_tokens = lm, image_tokens

    def __call__(self, items: list, class_emb: torch.Tensor | None, zero_shot: bool) -> torch.Tensor:
        lm = self.lm
        return verbalizer_logits(lm.lm, lm.tokenizer, lm_prompts(lm.template, items), lm.answers,
                                 prefix=self.image_tokens(items), max_length=lm.max_length, overhead=lm.overhead)
