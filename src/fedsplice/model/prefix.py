"""Frozen-prefix caches (docs/design.md §7): with LoRA only in layers >= l0, the hidden states entering
layer l0 depend on frozen weights alone, so they are computed once per input and only the layers
from l0 up run on them. Cached hidden states reproduce the full forward exactly.

  TextPrefix          BERT-like encoders and the CLIP text tower: per text, unpadded [T, H]
  build_image_prefix  CLIP's vision tower (vision.ClipImagePrefix): per image, keyed by pixels

Each cache's namespace holds a fingerprint of the frozen weights it depends on, so an entry on
disk can only be found by the computation that made it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from fedsplice.config import ExperimentConfig
from fedsplice.model.cache import FrozenCache, TokenCache, fingerprint
from fedsplice.model.vision import ClipImagePrefix

if TYPE_CHECKING:
    from transformers import CLIPModel

# (embeddings, layer stack) of the encoders whose frozen prefix can be cached: BERT-like and the
# CLIP text tower, where the embeddings feed layer 0 directly (CLIP's vision tower has a
# pre-layernorm in between, so it is not listed). Others run the full forward.
STACKS = (("embeddings", "encoder.layer"), ("text_model.embeddings", "text_model.encoder.layers"))


class _Const(nn.Module):
    """Stands in for the embeddings: returns the cached hidden states of the frozen prefix."""

    def __init__(self, h: torch.Tensor):
        super().__init__()
        self.h = h

    def forward(self, *args, **kwargs):
        return self.h


@contextmanager
def swapped(root: nn.Module, path: str, new: nn.Module):
    """Temporarily replace the submodule of `root` at `path` by `new`."""
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, attr)
    setattr(parent, attr, new)
    try:
        yield
    finally:
        setattr(parent, attr, old)


def text_prefix_layer(cfg: ExperimentConfig, is_clip: bool) -> int:
    """l0 of a cacheable text prefix (the first adapted layer), 0 when there is none: LoRA in
    some layers above 0 of a text encoder (a causal LM's prompts are not reused; CLIP caches its
    image side instead)."""
    pc = cfg.peft
    if (cfg.runtime.cache and pc.type == "lora" and pc.layers and min(pc.layers) > 0
            and cfg.model.task not in ("causal_lm", "vlm", "generate") and not is_clip):
        return min(pc.layers)
    return 0


class TextPrefix:
    """The hidden states entering layer l0 of a text encoder, cached per text; `encode` runs the
    layers from l0 up on them (in place, so their LoRA applies as in the full forward)."""

    def __init__(self, backbone: nn.Module, hf: nn.Module, tokens: TokenCache, cache: FrozenCache,
                 l0: int, paths: tuple[str, str]):
        self.backbone, self.hf, self.tokens = backbone, hf, tokens
        self.cache, self.l0, self.paths = cache, l0, paths

    @classmethod
    def build(cls, cfg: ExperimentConfig, backbone, hf, tokens: TokenCache, l0: int) -> TextPrefix | None:
        """None when the model has none of the known (embeddings, layer stack) layouts."""
        for emb, layers in STACKS:
            try:
                frozen = [hf.get_submodule(emb)] + list(hf.get_submodule(layers))[:l0]
            except AttributeError:
                continue
            ns = {"kind": "prefix", "model": cfg.model.name, "first_adapted_layer": l0,
                  "max_length": cfg.model.max_length, "tokenizer": tokens.tok.name_or_path,
                  "weights": fingerprint(p for m in frozen for p in m.parameters())}
            cache = FrozenCache(ns, cfg.runtime.cache_budget_mb << 20, cfg.runtime.cache_dir, tokens.device)
            return cls(backbone, hf, tokens, cache, l0, (emb, layers))
        return None

    def _compute(self, missing: list[str]) -> list[torch.Tensor]:
        """Unpadded hidden states entering layer l0 of each text: the stack cut after l0 - 1."""
        _, layers_path = self.paths
        sub = self.tokens(missing)
        layers = list(self._stack(layers_path))
        got: dict[str, torch.Tensor] = {}
        hook = layers[self.l0 - 1].register_forward_hook(
            lambda m, a, o: got.__setitem__("h", o[0] if isinstance(o, tuple) else o))
        try:
            with torch.no_grad(), swapped(self.hf, layers_path, nn.ModuleList(layers[:self.l0])):
                self.backbone(**sub)
        finally:
            hook.remove()
        sm = sub["attention_mask"].bool()
        return [got["h"][j][sm[j]] for j in range(len(missing))]

    def _stack(self, path: str) -> nn.ModuleList:
        """The layer stack at `path` (a STACKS entry: a ModuleList in every listed layout)."""
        return cast(nn.ModuleList, self.hf.get_submodule(path))

    def states(self, texts: list[str], enc) -> torch.Tensor:
        """[B, T, H] hidden states entering layer l0, from the cache or computed (and kept)."""
        rows = self.cache.rows(texts, self._compute)
        mask = enc["attention_mask"].bool()
        h = torch.zeros(*mask.shape, rows[0].shape[-1], device=mask.device)
        for i, r in enumerate(rows):
            h[i][mask[i]] = r
        return h

    def encode(self, enc, texts: list[str]) -> torch.Tensor:
        """Last hidden states of the full model, with layers below l0 read from the cache."""
        emb, layers_path = self.paths
        h = self.states(texts, enc)
        upper = nn.ModuleList(list(self._stack(layers_path))[self.l0:])
        with swapped(self.hf, emb, _Const(h)), swapped(self.hf, layers_path, upper):
            return self.backbone(**enc).last_hidden_state


def wants_image_prefix(cfg: ExperimentConfig, is_clip: bool) -> bool:
    """CLIP with LoRA only in the text tower, or only in vision layers above 0."""
    pc = cfg.peft
    return bool(is_clip and cfg.runtime.cache and pc.type == "lora" and (
        pc.tower == "text_model" or (pc.layers and min(pc.layers) > 0)))


def build_image_prefix(cfg: ExperimentConfig, clip: nn.Module, processor) -> ClipImagePrefix:
    """CLIP: cache the frozen bottom of the vision tower (vision.ClipImagePrefix)."""
    vm = cast("CLIPModel", clip).vision_model  # wants_image_prefix: only a CLIP model gets here
    layers = list(vm.encoder.layers)
    l0 = len(layers) if cfg.peft.tower == "text_model" else min(cfg.peft.layers)
    frozen = [vm.embeddings, vm.pre_layrnorm, *layers[:l0]]
    ns = {"kind": "clip-image-prefix", "model": cfg.model.name, "first_adapted_layer": l0,
          "weights": fingerprint(p for m in frozen for p in m.parameters())}
    cache = FrozenCache(ns, cfg.runtime.cache_budget_mb << 20, cfg.runtime.cache_dir,
                        next(clip.parameters()).device)
    return ClipImagePrefix(clip, processor, l0, cache)
