"""Image inputs for the backbones: CLIP's image/text features and a LLaVA-style vision tower.

No torchvision, open_clip or timm: checkpoints load through Hugging Face (`CLIPModel`, any vision
model by hub id or local path) and images are preprocessed by the checkpoint's own image
processor on its PIL backend.

    CLIP dual encoder   E(x) = image features (visual projection); a sample with a caption and
                        no image uses the text tower on the caption, one with both the mean of
                        the two normalized features; T(c) = text features of the class prompts
    vision-language LM  [projector(vision tower(x)) ; embed(prompt)] -> causal LM, answers
                        scored as verbalizers; the vision tower is frozen, the projector trains
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsplice.data.samples import Sample, rgb
from fedsplice.data.zoo import resolve_model
from fedsplice.errors import ConfigError


def load_image_processor(path: str, field: str):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, backend="pil")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}: {path!r} has no image processor ({str(e).splitlines()[0]}); "
                          f"give a checkpoint with a preprocessor_config.json") from None


def pixel_values(processor, items: list, model: nn.Module) -> torch.Tensor:
    """[B, 3, H, W] model inputs of the samples' images (grey images become RGB first), on the
    device of `model`, the tower they go into."""
    pv = processor(images=[rgb(s.image) for s in items], return_tensors="pt")["pixel_values"]
    return pv.to(next(model.parameters()).device)


def load_vision_tower(spec: str, dtype: torch.dtype = torch.float32, meta: bool = False):
    """(frozen vision model, its image processor, hidden size) for `model.vision`: a CLIP or SigLIP
    checkpoint (its vision half) or any HF vision model, by zoo name, hub id or local path.
    `meta`: from its config alone, on the meta device (a plan reads no weights)."""
    from transformers import AutoConfig, AutoModel

    path = resolve_model(spec)
    cls: Any  # one of three HF model classes, each with its own from_pretrained
    try:
        cfg = AutoConfig.from_pretrained(path)
        mtype = cfg.model_type
        if mtype in ("clip", "clip_vision_model"):
            from transformers import CLIPVisionModel as cls
        elif mtype in ("siglip", "siglip_vision_model"):
            from transformers import SiglipVisionModel as cls
        else:
            cls = AutoModel
        if meta:
            with torch.device("meta"):
                # a whole CLIP / SigLIP checkpoint: its vision half, as from_pretrained reads it
                tower = cls._from_config(getattr(cfg, "vision_config", cfg), dtype=dtype)
        else:
            tower = cls.from_pretrained(path, dtype=dtype)  # frozen: model.dtype, like the LM
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.vision: cannot load {spec!r} ({str(e).splitlines()[0]}); "
                          f"use zoo:tiny-vit, a local folder or a hub id") from None
    tower = getattr(tower, "vision_model", tower) if not hasattr(tower.config, "image_size") else tower
    hidden = getattr(getattr(tower.config, "vision_config", tower.config), "hidden_size", None)
    if hidden is None:
        raise ConfigError(f"model.vision: {spec!r} ({mtype}) reports no hidden_size; give a vision model")
    for p in tower.parameters():
        p.requires_grad_(False)
    tower.eval()
    return tower, load_image_processor(path, "model.vision"), int(hidden)


class Projector(nn.Module):
    """Vision features [T, Dv] -> LM input embeddings [T, D]: LLaVA's linear or 2-layer GELU MLP.
    Seeded init; trainable (no pretrained projector exists for an arbitrary tower + LM pair)."""

    def __init__(self, vision_hidden: int, lm_hidden: int, kind: str, generator: torch.Generator):
        super().__init__()
        self.vision_hidden = vision_hidden
        layers: list[nn.Module] = [nn.Linear(vision_hidden, lm_hidden)]
        if kind == "mlp":
            layers += [nn.GELU(), nn.Linear(lm_hidden, lm_hidden)]
        self.net = nn.Sequential(*layers)
        with torch.no_grad():
            for m in self.net:
                if isinstance(m, nn.Linear):
                    bound = 1.0 / m.in_features**0.5
                    m.weight.copy_(torch.empty_like(m.weight).uniform_(-bound, bound, generator=generator))
                    m.bias.zero_()

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        if feats.shape[-1] != self.vision_hidden:
            raise ConfigError(f"model.vision: the vision tower gives features of width {feats.shape[-1]}, "
                              f"the projector takes {self.vision_hidden}; use the tower it was built for")
        return self.net(feats)


def image_key(s: Sample) -> str:
    """sha256 of an image's shape and pixels (memoized on the sample): the vision cache's key."""
    key = getattr(s, "_image_key", None)
    if key is None:
        image = s.image
        assert image is not None  # callers pass samples with an image
        h = hashlib.sha256(str(image.shape).encode())
        h.update(np.ascontiguousarray(image).tobytes())
        # a memo on the sample's instance dict: Sample (fedsplice.data) does not declare it
        key = s._image_key = "img:" + h.hexdigest()  # type: ignore[attr-defined]
    return key


def per_image(cache, items: list, compute) -> list[torch.Tensor]:
    """One row per sample: compute(samples) (one row each), through `cache` keyed by each image's
    pixels (`image_key`) when there is one, so a repeated image is computed once."""
    if cache is None:
        return list(compute(items))
    by_key = {image_key(s): s for s in items}
    return cache.rows([image_key(s) for s in items], lambda ks: list(compute([by_key[k] for k in ks])))


def vision_tokens(tower, processor, items: list) -> list[torch.Tensor]:
    """Frozen last hidden states [T, Dv] of each sample's image (CLS + patches)."""
    with torch.no_grad():
        h = tower(pixel_values=pixel_values(processor, items, tower)).last_hidden_state
    return list(h)


def clip_text_from_embeds(clip, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CLIP text features of input *embeddings* (CoOp context), which `CLIPTextModel` does not
    take: embeddings + positions, the causal encoder, the final norm, pooling at the last real
    token (the end-of-text token the prompt learner appends), the text projection."""
    from transformers.masking_utils import create_causal_mask

    tm = clip.text_model
    h = tm.embeddings(inputs_embeds=embeds)
    am = create_causal_mask(config=tm.config, inputs_embeds=h, attention_mask=mask, cache=None)
    h = tm.final_layer_norm(tm.encoder(inputs_embeds=h, attention_mask=am, is_causal=True).last_hidden_state)
    pooled = h[torch.arange(h.shape[0], device=h.device), mask.sum(-1) - 1]
    return clip.text_projection(pooled)


class ClipImagePrefix:
    """CLIP image features with the frozen bottom of the vision tower cached (docs/design.md §7): with
    LoRA only in vision layers >= l0 (or only in the text tower: l0 = every layer), the hidden
    states entering layer l0 depend on frozen weights alone, so they are computed once per image
    (keyed by its pixels) and only layers l0.. run on them. The layers are called in place, so
    their LoRA (and peft's disable_adapter) applies as in the full forward."""

    def __init__(self, clip, processor, l0: int, cache):
        self.clip, self.processor, self.l0, self.cache = clip, processor, l0, cache

    def _bottom(self, items: list) -> list[torch.Tensor]:
        vm = self.clip.vision_model
        with torch.no_grad():
            h = vm.pre_layrnorm(vm.embeddings(pixel_values(self.processor, items, vm)))
            for layer in vm.encoder.layers[:self.l0]:
                h = layer(h, None)
        return list(h)

    def __call__(self, items: list) -> torch.Tensor:
        h = torch.stack(per_image(self.cache, items, self._bottom))
        vm = self.clip.vision_model
        for layer in vm.encoder.layers[self.l0:]:
            h = layer(h, None)
        return self.clip.visual_projection(vm.post_layernorm(h[:, 0]))


class ClipInputs:
    """E(x) for a CLIP dual encoder: image features, caption features, or their mean (both
    normalized first); plain strings are texts. `image_features` (e.g. a ClipImagePrefix)
    replaces the full image forward. `pixels` (a FrozenCache): each image's preprocessed pixels,
    computed once (the processor's resize and normalization are a pure function of the image)."""

    def __init__(self, clip, processor, text_features, image_features=None, pixels=None):
        self.clip, self.processor, self.text_features = clip, processor, text_features
        self.image_features, self.pixels = image_features, pixels

    def pixel_values(self, items: list) -> torch.Tensor:
        if self.pixels is None:
            return pixel_values(self.processor, items, self.clip)
        return torch.stack(per_image(self.pixels, items, lambda ss: pixel_values(self.processor, ss, self.clip)))

    def __call__(self, items: list) -> torch.Tensor:
        with_img = [i for i, s in enumerate(items) if isinstance(s, Sample) and s.has_image]
        texts = [(i, s.text if isinstance(s, Sample) else s) for i, s in enumerate(items)]
        texts = [(i, t) for i, t in texts if t is not None]
        feats: list[list[torch.Tensor]] = [[] for _ in items]
        if with_img:
            if self.image_features is not None:
                img = self.image_features([items[i] for i in with_img])
            else:
                pv = self.pixel_values([items[i] for i in with_img])
                img = self.clip.get_image_features(pixel_values=pv).pooler_output
            for j, i in enumerate(with_img):
                feats[i].append(F.normalize(img[j], dim=-1))
        if texts:
            txt = self.text_features([t for _, t in texts])
            for j, (i, _) in enumerate(texts):
                feats[i].append(F.normalize(txt[j], dim=-1))
        return torch.stack([torch.stack(f).mean(0) for f in feats])

    @torch.no_grad()
    def patch_tokens(self, items: list, cache=None) -> list[torch.Tensor]:
        """A method scorer's token view: each image's patch tokens in the joint space, [P, D] per
        sample (post-layernorm, visual projection; the class token dropped), cached by pixels."""
        if not all(isinstance(s, Sample) and s.has_image and s.text is None for s in items):
            raise ConfigError("algorithm: its scorer matches a CLIP image's patches to the prompts: "
                              "every sample needs an image and no caption")
        def compute(samples: list) -> torch.Tensor:
            vm = self.clip.vision_model
            h = vm(pixel_values=pixel_values(self.processor, samples, vm)).last_hidden_state
            return self.clip.visual_projection(vm.post_layernorm(h[:, 1:]))

        return per_image(cache, items, compute)
