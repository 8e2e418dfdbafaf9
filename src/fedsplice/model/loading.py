"""Loading a backbone: the Hugging Face model and tokenizer, its q/k/v/o role map, and the checks
that a PEFT type fits the task before anything is built on it.

Roles name attention projections across architectures (q, k, v, o), so a split written in roles
fits every backbone; `target_regex` turns roles × layers × tower into a peft target_modules regex.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedsplice.config import ExperimentConfig
from fedsplice.data.zoo import resolve_model
from fedsplice.errors import ConfigError, ModelUnavailable
from fedsplice.model import templates
from fedsplice.model.device import DTYPES, bound_kernel_caches, resolve_precision
from fedsplice.model.vision import load_image_processor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


def quantization_config(cfg: ExperimentConfig, device: torch.device | None = None):
    """transformers' BitsAndBytesConfig for `model.quantization` (None for "none"); a missing
    bitsandbytes is a one-line ConfigError before anything loads. nf4 (with double quantization)
    and fp4 (without: `BitsAndBytesConfig(load_in_4bit=True)`'s defaults) compute in model.dtype,
    or, with an fp32 base, in the run's autocast dtype (runtime.precision)."""
    mc = cfg.model
    if mc.quantization == "none":
        return None
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"model.quantization = {mc.quantization!r} needs bitsandbytes, which is not installed: "
                          f"pip install bitsandbytes (QLoRA runs on a CUDA GPU), or set model.quantization = 'none'")
    from transformers import BitsAndBytesConfig

    compute = DTYPES[mc.dtype] if mc.dtype != "fp32" else run_precision(cfg, device or torch.device("cpu"))
    if mc.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=mc.quantization,
                              bnb_4bit_use_double_quant=mc.quantization == "nf4", bnb_4bit_compute_dtype=compute)


def run_precision(cfg: ExperimentConfig, device: torch.device) -> torch.dtype:
    """The run's autocast dtype: runtime.precision resolved on `device` (for "auto" on a CPU,
    knowing the model's width and whether peft.type is "lora": fedsplice.model.device.resolve_precision)."""
    auto_cpu = cfg.runtime.precision == "auto" and device.type == "cpu"
    return resolve_precision(cfg.runtime.precision, device, model_width(cfg) if auto_cpu else None,
                             lora=cfg.peft.type == "lora")


def model_width(cfg: ExperimentConfig) -> int | None:
    """The widest hidden size among the model's towers (model.name's, its text and vision
    configs', and a VLM's model.vision), from their config.json; None where one cannot be read."""
    from transformers import AutoConfig

    widths = []
    for spec in (cfg.model.name, cfg.model.vision):
        if not spec:
            continue
        try:
            c = AutoConfig.from_pretrained(resolve_model(spec))
        except Exception:  # noqa: BLE001 -- unreadable here: the model's own load says why, in one line
            return None
        for sub in (c, getattr(c, "text_config", None), getattr(c, "vision_config", None)):
            w = getattr(sub, "hidden_size", None)
            widths += [w] if isinstance(w, int) else []
    return max(widths) if widths else None


def load_pretrained(cfg: ExperimentConfig, device: torch.device | None = None, meta: bool = False):
    """(model, tokenizer, resolved path) of `model.name` in `model.dtype`; the tokenizer always
    has a pad. The weights are placed on `device` as they load (a quantized base must be:
    bitsandbytes weights cannot move afterwards; it is then prepared for k-bit training).
    `meta`: the architecture from its config alone, every tensor on the meta device, no weight
    read and no quantization (a plan: fedsplice.federation.plan; the names are the same)."""
    # transformers is imported here, not at module level: importing fedsplice stays fast
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    quiet_bitsandbytes()
    bound_kernel_caches()  # before the model's first kernel

    path = resolve_model(cfg.model.name)
    quant = None if meta else quantization_config(cfg, device)
    kw: dict[str, Any] = {"dtype": DTYPES[cfg.model.dtype]}  # from_pretrained's keyword arguments
    if quant is not None:
        kw.update(quantization_config=quant, device_map={"": str(device or "cpu")})
    elif device is not None and device.type != "cpu":
        kw["device_map"] = {"": str(device)}  # straight to the accelerator: no second copy on the host
    try:
        tok = AutoTokenizer.from_pretrained(path)
        cls = AutoModelForCausalLM if cfg.model.task in ("causal_lm", "vlm", "generate") else AutoModel
        if meta:
            with torch.device("meta"):
                model = cls.from_config(AutoConfig.from_pretrained(path), dtype=kw["dtype"])
        else:
            model = cls.from_pretrained(path, **kw)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if quant is not None and not isinstance(e, OSError):
            raise ConfigError(f"model.quantization = {cfg.model.quantization!r}: bitsandbytes cannot load "
                              f"{cfg.model.name!r} here ({first}); set model.quantization = 'none'") from None
        if isinstance(e, OSError) and offline_hub(path):
            raise ModelUnavailable(f"model.name: {cfg.model.name!r} is not in the local Hugging Face cache and "
                                   f"HF_HUB_OFFLINE is set; unset it to download the model, or use a local "
                                   f"folder") from None
        raise ConfigError(f"model.name: cannot load {cfg.model.name!r} ({first}); "
                          f"use zoo:minilm, zoo:smollm2, a local folder or a hub id") from None
    if quant is not None:
        model = prepare_kbit(model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    templates.install(tok, cfg.model.prompt_template)
    return model, tok, path


def offline_hub(path: str) -> bool:
    """`path` is not a folder here, and the hub may not be asked (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) and not Path(path).expanduser().exists()


@contextmanager
def without_bitsandbytes():
    """A context in which bitsandbytes looks absent, unless it is already imported. peft imports
    it as it loads (peft.helpers) and at every LoRA injection (its 8-bit dispatcher): 4.6 s of a
    7 s import on this machine (measured), which only a quantized base uses, and a quantized base
    has imported it before any LoRA is injected. On leaving, the availability checks that peft and
    transformers cache are cleared, so a quantized base later in the process still finds it."""
    if "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # its import raises ImportError
    _clear_bnb_checks()
    try:
        yield
    finally:
        if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]
        _clear_bnb_checks()


def _clear_bnb_checks() -> None:
    import transformers.utils.import_utils as hf_imports

    hf_imports.is_bitsandbytes_available.cache_clear()
    peft_imports = sys.modules.get("peft.import_utils")
    if peft_imports is not None:
        peft_imports.is_bnb_available.cache_clear()
        peft_imports.is_bnb_4bit_available.cache_clear()


def quiet_bitsandbytes() -> None:
    """bitsandbytes, when installed, is imported by peft and transformers and warns at import on
    a CPU (an optional kernels package) and at every int8 matmul (a dtype cast): noise in every
    run's output. Its logger is set to errors only, unless the user configured it."""
    import logging

    log = logging.getLogger("bitsandbytes")
    if log.level == logging.NOTSET:
        log.setLevel(logging.ERROR)


def prepare_kbit(model):
    """peft's k-bit preparation (norms and embeddings in fp32, input grads). On a CPU with AVX-512
    BF16, bitsandbytes repacks a 4-bit weight at its first no-grad eval forward into a layout
    with no backward, after which LoRA silently gets no gradients (bitsandbytes 0.50.2, measured
    here): that fast path is switched off."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def enable_gradient_checkpointing(model) -> None:
    """HF's own switch (non-reentrant: the frozen base needs no input gradients); a model
    without support is a one-line error."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.gradient_checkpointing: {type(model).__name__} does not support it; "
                          f"set model.gradient_checkpointing = false")
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


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
    model: PreTrainedModel  # the HF model, every parameter frozen
    tokenizer: object
    model_type: str
    rmap: dict[str, str]
    is_clip: bool  # CLIP: images on the input side (E), class prompts through the text tower (T)
    image_processor: object | None  # CLIP's own; a VLM's comes with its vision tower
    hidden: int  # the width of the features a head or an adapter sees
    text_positions: int | None  # CLIP's text tower has a fixed number of positions (77)


def load_backbone(cfg: ExperimentConfig, device: torch.device | None = None, meta: bool = False) -> Backbone:
    """Load, freeze and check `model.name` against `peft.type` and `model.task` (in this order, so
    a config with several problems always reports the same one first). `meta`: see load_pretrained."""
    base, tok, path = load_pretrained(cfg, device, meta)
    for p in base.parameters():
        p.requires_grad_(False)
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    mtype = getattr(base.config, "model_type", "?")
    rmap = role_map(mtype)
    is_clip = mtype == "clip"
    processor = load_image_processor(path, "model.name") if is_clip else None
    check_peft_fits_task(cfg.peft.type, cfg.model.task)
    hidden = base.config.projection_dim if is_clip else base.config.hidden_size
    positions = base.config.text_config.max_position_embeddings if is_clip else None
    return Backbone(base, tok, mtype, rmap, is_clip, processor, hidden, positions)
