"""Loading a backbone: the Hugging Face model and tokenizer, its q/k/v/o role map, and the checks
that a PEFT type fits the task before anything is built on it.

Roles name attention projections across architectures (q, k, v, o), so a split written in roles
fits every backbone; `target_regex` turns roles × layers × tower into a peft target_modules regex.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fedsplice.config import ExperimentConfig
from fedsplice.data.zoo import resolve_model
from fedsplice.errors import ConfigError
from fedsplice.model.vision import load_image_processor

_BERT = {"q": "attention.self.query", "k": "attention.self.key",
         "v": "attention.self.value", "o": "attention.output.dense"}
_LLAMA = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj"}
_CLIP = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj"}
ROLE_MAPS = {
    "bert": _BERT, "roberta": _BERT, "xlm-roberta": _BERT, "electra": _BERT,
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "clip": _CLIP, "clip_text_model": _CLIP, "clip_vision_model": _CLIP, "siglip": _CLIP,
}


def role_map(model_type: str) -> dict[str, str]:
    if model_type not in ROLE_MAPS:
        raise ConfigError(f"model.name: no q/k/v/o role map for model_type {model_type!r}; "
                          f"supported: {', '.join(sorted(ROLE_MAPS))}")
    return ROLE_MAPS[model_type]


def target_regex(rmap: dict[str, str], roles, layers, tower: str) -> str:
    """A peft target_modules regex (full match on module names) for roles × layers × tower."""
    idx = "|".join(str(i) for i in layers) if layers else r"\d+"
    suffix = "|".join(re.escape(rmap[r]) for r in roles)
    prefix = rf"(?:.*\.)?{re.escape(tower)}\..*" if tower else ".*"
    return rf"{prefix}\.(?:layer|layers|h)\.(?:{idx})\.(?:{suffix})"


def load_pretrained(cfg: ExperimentConfig):
    """(model, tokenizer, resolved path) of `model.name`, fp32; the tokenizer always has a pad."""
    # transformers is imported here, not at module level: importing fedsplice stays fast
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    path = resolve_model(cfg.model.name)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        cls = AutoModelForCausalLM if cfg.model.task in ("causal_lm", "vlm") else AutoModel
        model = cls.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name: cannot load {cfg.model.name!r} ({str(e).splitlines()[0]}); "
                          f"use zoo:minilm, zoo:smollm2, a local folder or a hub id") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok, path


def check_peft_fits_task(peft_type: str, task: str) -> None:
    if peft_type in ("prompt", "adapter") and task in ("causal_lm", "vlm"):
        raise ConfigError(f"peft.type = {peft_type!r} needs a dual encoder or encoder + head; "
                          f"use peft.type = 'lora' with model.task = {task!r}")
    if peft_type == "prompt" and task != "dual_encoder":
        raise ConfigError("peft.type = 'prompt' learns the class prompts of a dual encoder: "
                          "set model.task = 'dual_encoder'")


@dataclass
class Backbone:
    """A loaded, frozen HF model and what the rest of the model is built from."""
    model: object  # the HF model, every parameter frozen
    tokenizer: object
    model_type: str
    rmap: dict[str, str]
    is_clip: bool  # CLIP: images on the input side (E), class prompts through the text tower (T)
    image_processor: object | None  # CLIP's own; a VLM's comes with its vision tower
    hidden: int  # the width of the features a head or an adapter sees
    text_positions: int | None  # CLIP's text tower has a fixed number of positions (77)


def load_backbone(cfg: ExperimentConfig) -> Backbone:
    """Load, freeze and check `model.name` against `peft.type` and `model.task` (in this order, so
    a config with several problems always reports the same one first)."""
    base, tok, path = load_pretrained(cfg)
    for p in base.parameters():
        p.requires_grad_(False)
    mtype = getattr(base.config, "model_type", "?")
    rmap = role_map(mtype)
    is_clip = mtype == "clip"
    processor = load_image_processor(path, "model.name") if is_clip else None
    check_peft_fits_task(cfg.peft.type, cfg.model.task)
    hidden = base.config.projection_dim if is_clip else base.config.hidden_size
    positions = base.config.text_config.max_position_embeddings if is_clip else None
    return Backbone(base, tok, mtype, rmap, is_clip, processor, hidden, positions)
