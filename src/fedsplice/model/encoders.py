"""The two sides of a dual encoder (and the input side of encoder + head).

  TextEncoder  tokenized texts -> hidden states (through the frozen-prefix cache when there is
               one) -> mean-pooled embeddings, or CLIP's projected text features
  ClassSide    T(prompt(c)): normalized class embeddings from the template(s), the CoOp prompt
               learner(s), or the frozen model (computed once when nothing on that side trains)
  InputSide    E(x): text features, or CLIP's image (and caption) features; frozen and cached
               when only the class side or an adapter trains; the FedCLIP adapter on top

`zero_shot` is passed in by the caller (TaskModel.zero_shot), never stored here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from fedsplice.data.samples import Sample
from fedsplice.errors import ConfigError
from fedsplice.model.adapters import FeatureAdapter, PromptLearner
from fedsplice.model.cache import FrozenCache, TokenCache
from fedsplice.model.grouped import owner_order, rows_of
from fedsplice.model.peft import adapters_off
from fedsplice.model.prefix import TextPrefix
from fedsplice.model.unpad import by_length
from fedsplice.model.vision import ClipImagePrefix, ClipInputs, clip_text_from_embeds

if TYPE_CHECKING:
    from transformers import CLIPModel


class TextEncoder:
    """`overhead`: unpadded batches (fedsplice.model.unpad), a forward call's cost in token rows; None: a
    batch runs padded to its longest member. TaskModel sets it per mode (runtime.unpad)."""

    def __init__(self, backbone: nn.Module, hf: nn.Module, tokens: TokenCache, is_clip: bool,
                 prefix: TextPrefix | None = None):
        self.backbone, self.hf, self.tokens, self.is_clip = backbone, hf, tokens, is_clip
        self.prefix = prefix
        self.overhead: int | None = None

    def encode(self, enc, texts: list[str]) -> torch.Tensor:
        """Last hidden states [B, T, D] of the tokenized `texts`, in their order. Owned texts (a
        batched round: model.grouped) run ordered by owner and come back in the order given."""
        perm = owner_order(texts)
        if perm is None:
            return self._encode(enc, texts)
        dev = next(v for v in enc.values() if torch.is_tensor(v)).device
        p = perm.to(dev)
        out = self._encode({k: v.index_select(0, p) if torch.is_tensor(v) else v for k, v in enc.items()},
                           [texts[i] for i in perm.tolist()])
        return out[torch.argsort(p)]

    def _encode(self, enc, texts: list[str]) -> torch.Tensor:
        with rows_of(texts):  # Owned texts: each row through its client's LoRA (model.grouped)
            if self.prefix is None:
                return self.backbone(**enc).last_hidden_state
            return self.prefix.encode(enc, texts)

    def embed(self, texts: list[str]) -> torch.Tensor:
        return self._unpadded(texts, self._mean_pooled)

    def _mean_pooled(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokens(texts)
        out = self.encode(enc, texts)
        mask = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
        return (out * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # mean pooling (sentence-transformers)

    def embed_text(self, texts: list[str]) -> torch.Tensor:
        """T(texts): CLIP's projected text features, else mean-pooled hidden states."""
        if self.is_clip:
            clip = cast("CLIPModel", self.hf)  # is_clip: the HF model is a CLIPModel
            return self._unpadded(list(texts), lambda ts: clip.get_text_features(**self.tokens(ts)).pooler_output)
        return self.embed(texts)

    def _unpadded(self, texts: list[str], fn) -> torch.Tensor:
        if self.overhead is None:
            return fn(texts)
        return by_length(self.tokens.lengths(texts), lambda idx: fn([texts[i] for i in idx]), self.overhead)


class ClassSide:
    """Class embeddings [C, D], normalized. `trains_text` (`model.class_side_adapters`, or CLIP
    with LoRA in its text tower): the class side changes as LoRA trains, so it is recomputed."""

    def __init__(self, text: TextEncoder, class_names: list[str], templates: list[str], peft_type: str,
                 trains_text: bool, cache_on: bool, prompt: PromptLearner | None = None):
        self.text, self.class_names, self.templates = text, class_names, templates
        self.peft_type, self.trains_text, self.cache_on = peft_type, trains_text, cache_on
        self.prompt = prompt
        # () -> class embeddings: a method's own class side from its prompt modules (PromptParts)
        self.compose: Callable[[], torch.Tensor] | None = None
        self.frozen_emb: torch.Tensor | None = None

    def embeddings(self, zero_shot: bool) -> torch.Tensor:
        if zero_shot or self.peft_type == "adapter":
            return self.frozen()
        if self.peft_type == "prompt" and self.compose is not None:
            return self.compose()
        if self.peft_type == "prompt":
            assert self.prompt is not None  # peft.type = "prompt" always builds one (TaskModel)
            return self.from_prompt(self.prompt)
        if not self.trains_text:
            return self.frozen()
        return self.from_templates()

    def from_templates(self) -> torch.Tensor:
        """Normalized class embeddings; a prompt ensemble averages its templates' (CLIP)."""
        es = [F.normalize(self.text.embed_text(self.prompts(t)), dim=-1) for t in self.templates]
        return es[0] if len(es) == 1 else F.normalize(torch.stack(es).mean(0), dim=-1)

    def prompts(self, template: str) -> list[str]:
        return [template.format(label=c) for c in self.class_names]

    def frozen(self) -> torch.Tensor:
        if self.frozen_emb is None or not self.cache_on:  # frozen work, computed once
            with torch.no_grad(), adapters_off(self.text.backbone, self.peft_type):
                self.frozen_emb = self.from_templates()
        return self.frozen_emb

    def word_embeddings(self) -> nn.Embedding:
        if self.text.is_clip:
            return cast("CLIPModel", self.text.hf).text_model.embeddings.token_embedding
        # an HF model's (through peft's wrapper with LoRA), reached through nn.Module's __getattr__
        return self.text.backbone.get_input_embeddings()  # type: ignore[operator]

    def from_prompt(self, learner: nn.Module, ctx: torch.Tensor | None = None, /) -> torch.Tensor:
        """A CoOp learner's class sequences around `ctx` (None: its own context), encoded and
        normalized: [C, D] (PromptParts.class_embeddings's `encode`)."""
        return self._encoded(*cast(PromptLearner, learner).inputs(self.word_embeddings(), ctx))

    def from_prompts(self, learner: nn.Module, ctxs: list[torch.Tensor]) -> torch.Tensor:
        """from_prompt around each of several contexts (one per client), in one forward of the
        text encoder over all their class sequences: [len(ctxs), C, D]."""
        parts = [cast(PromptLearner, learner).inputs(self.word_embeddings(), c) for c in ctxs]
        out = self._encoded(torch.cat([e for e, _ in parts]), torch.cat([m for _, m in parts]))
        return out.reshape(len(ctxs), -1, out.shape[-1])

    def _encoded(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.text.is_clip:
            return F.normalize(clip_text_from_embeds(self.text.hf, embeds, mask), dim=-1)
        out = self.text.backbone(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(out.dtype)
        return F.normalize((out * m).sum(1) / m.sum(1), dim=-1)


class InputSide:
    """E(x) [B, D]. With LoRA (or full fine-tuning) it trains through the encoder; with prompts or
    an adapter the encoder is frozen on this side, so its features are computed without gradients
    (and cached per input when `features` is given); the adapter, outside zero-shot, maps them."""

    def __init__(self, text: TextEncoder, peft_type: str, adapter: FeatureAdapter | None = None,
                 features: FrozenCache | None = None, clip_inputs: ClipInputs | None = None):
        self.text, self.peft_type, self.adapter = text, peft_type, adapter
        self.features, self.clip_inputs = features, clip_inputs
        self.token_cache: FrozenCache | None = None  # token features for a method's scorer (PromptParts.scorer)

    @staticmethod
    def clip(text: TextEncoder, processor, image_prefix: ClipImagePrefix | None, captions_frozen: bool,
             pixels: FrozenCache | None = None) -> ClipInputs:
        """CLIP's E(x); with a frozen text tower (and caching on) captions are encoded once."""
        fn: Callable[[list[str]], torch.Tensor] = text.embed_text
        if captions_frozen:
            captions = FrozenCache({"kind": "clip-captions"}, 1 << 62, device=text.tokens.device)
            fn = lambda ts: torch.stack(captions.rows(ts, text.embed_text))  # noqa: E731
        return ClipInputs(text.hf, processor, fn, image_prefix, pixels)

    def __call__(self, items: list, zero_shot: bool) -> torch.Tensor:
        if self.peft_type in ("lora", "full"):  # the encoder itself trains
            return self.embed(items)
        with torch.no_grad():  # the encoder is frozen on the input side for prompts and adapters
            f = self.frozen(items)
        return f if (self.adapter is None or zero_shot) else self.adapter(f)

    @torch.no_grad()
    def tokens(self, items: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Token features for a method's scorer (PromptParts.scorer), L2-normalized per token and padded:
        ([B, M, D], mask [B, M]).
        A text: the frozen encoder's last hidden state of every token its mean-pooled embedding
        averages; an image (CLIP): its projected patch tokens. Cached per input."""
        def compute(missing: list[str]) -> list[torch.Tensor]:
            enc = self.text.tokens(missing)
            out, m = self.text.encode(enc, missing), enc["attention_mask"].bool()
            return [out[i][m[i]] for i in range(len(missing))]

        if self.clip_inputs is not None:
            rows = self.clip_inputs.patch_tokens(items, self.token_cache)
        elif any(isinstance(s, Sample) for s in items):
            raise ConfigError("algorithm: its scorer reads an image's patch tokens from a CLIP model, and "
                              "model.name is a text encoder; use a CLIP dual encoder for images")
        else:
            rows = self.token_cache.rows(items, compute) if self.token_cache is not None else compute(items)
        longest = max(len(r) for r in rows)
        dev = rows[0].device
        h = torch.zeros(len(rows), longest, rows[0].shape[-1], device=dev)
        mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=dev)
        for i, r in enumerate(rows):
            h[i, :len(r)], mask[i, :len(r)] = r, True
        return F.normalize(h, dim=-1), mask

    def frozen(self, items: list) -> torch.Tensor:
        if self.features is None:
            return self.embed(items)
        return torch.stack(self.features.rows(items, self.embed))

    def embed(self, items: list) -> torch.Tensor:
        """E(x): text encoder for texts; CLIP's image (and caption) features for samples."""
        if self.clip_inputs is not None:
            return self.clip_inputs(items)
        if any(isinstance(s, Sample) for s in items):
            raise ConfigError("data.dataset holds images but model.name is a text encoder; use a CLIP "
                              "checkpoint (dual_encoder) or model.task = 'vlm'")
        return self.text.embed(items)
