"""The trainable parts of a backbone and their metadata.

Builders: LoRA injected through HF peft (by role, layer and tower), CoOp prompt learners, the
FedCLIP feature adapter, an encoder's linear head (fedsplice.model.adapters holds the modules
themselves), and `unfreeze` for full fine-tuning (no PEFT). Metadata: `param_infos` (role, LoRA
factor, layer and kind of every trainable tensor, what splits are written in) and
`lora_scalings` (s of ΔW = s·B·A, for the orthogonality loss).

Every random init draws from a generator seeded by cfg.seed, never from the global stream: LoRA's
A init (drawn by peft from torch's RNG) runs inside a forked, locally seeded RNG.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from fedsplice.config import PeftConfig
from fedsplice.core.split import ParamInfo
from fedsplice.errors import ConfigError
from fedsplice.model.adapters import FeatureAdapter, PromptLearner
from fedsplice.model.loading import target_regex, without_bitsandbytes

if TYPE_CHECKING:
    from peft import LoraModel, PeftModel

    from fedsplice.algorithms import Beside, LoraParts

LAYER = re.compile(r"^(.*?\.(?:layer|layers|h)\.\d+)\.")


def inject_lora(base: nn.Module, rmap: dict[str, str], pc: PeftConfig, seed: int, mtype: str,
                parts: LoraParts | None = None):
    """`base` wrapped by peft with LoRA on pc.roles × pc.layers × pc.tower; the method's `parts`
    (fedsplice.algorithms.LoraParts) add more adapters on the same modules, all active."""
    with without_bitsandbytes():  # heavy: imported when a LoRA model is built
        from peft import LoraConfig, get_peft_model

    regex = target_regex(rmap, pc.roles, pc.layers, pc.tower)
    # peft annotates lora_alpha as int; a float works (scaling = alpha / r), and peft.alpha is one
    lcfg = LoraConfig(r=pc.r, lora_alpha=pc.alpha,  # type: ignore[arg-type]
                      lora_dropout=pc.dropout, target_modules=regex, use_rslora=pc.use_rslora, bias="none")
    # LoRA A init draws from torch's RNG: seed it locally so the global stream is untouched.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), without_bitsandbytes():
        warnings.simplefilter("ignore", FutureWarning)  # peft probing deprecated HF helpers
        torch.manual_seed(seed)
        try:
            model = get_peft_model(base, lcfg)
            for name, rank in (parts.adapters.items() if parts is not None else ()):
                model.add_adapter(name, dataclasses.replace(lcfg, r=rank))
            if parts is not None and parts.adapters:
                # peft types base_model as nn.Module; under a LoraConfig it is the LoraModel
                cast("LoraModel", model.base_model).set_adapter(["default", *parts.adapters])
            if parts is not None and parts.beside:
                add_beside(model, parts.beside)
            return model
        except ValueError as e:
            raise ConfigError(f"peft: no module of this {mtype} backbone matches roles {pc.roles}, "
                              f"layers {pc.layers or 'all'}, tower {pc.tower or '(any)'} ({e}); "
                              f"check peft.layers / peft.tower") from None


def add_beside(model: nn.Module, beside: Mapping[str, Beside]) -> None:
    """The method's tensor of each name beside the LoRA of every adapted Linear, as its parameter
    "lora_<name>" (LoraParts.beside), and a forward hook adding each one's term to the output:
    W0 x + its LoRA + Σ_name add(x, tensor); the frozen W0 x alone with the adapters off."""
    attrs = {f"lora_{name}": part for name, part in beside.items()}

    def plus(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if getattr(mod, "disable_adapters", False):  # zero-shot: the frozen weight alone
            return out
        for attr, part in attrs.items():
            out = out + part.add(args[0], cast(torch.Tensor, getattr(mod, attr)))
        return out

    for mod in model.modules():
        base = getattr(mod, "base_layer", None)
        if isinstance(base, nn.Linear) and hasattr(mod, "lora_A"):
            for attr, part in attrs.items():
                if hasattr(mod, attr):
                    raise ConfigError(f"algorithm: its LoraParts.beside names {attr[5:]!r}, which peft's LoRA "
                                      f"layer already has as {attr!r}; rename it")
                # by the features, not weight.shape: a 4-bit base packs its weight
                start = part.init(base.out_features, base.in_features)
                setattr(mod, attr, nn.Parameter(start.to(base.weight.device)))
            mod.register_forward_hook(plus)


def unfreeze(base: nn.Module) -> nn.Module:
    """peft.type = "full": every weight of the backbone trains (and so is a named trainable tensor)."""
    for p in base.parameters():
        p.requires_grad_(True)
    return base


def hf_model(backbone: nn.Module, peft_type: str) -> nn.Module:
    """The HF model under peft's wrapper (the backbone itself without LoRA)."""
    # with LoRA the backbone is inject_lora's PeftModel (typed nn.Module here)
    return cast("PeftModel", backbone).get_base_model() if peft_type == "lora" else backbone


def adapters_off(backbone: nn.Module, peft_type: str):
    """A context in which the backbone runs without its LoRA (the frozen model). Prompt and adapter
    types leave the backbone frozen; "full" has no frozen model (TaskModel.zero_shot)."""
    return cast("PeftModel", backbone).disable_adapter() if peft_type == "lora" else nullcontext()


def build_prompts(tokenizer, word_embeddings: nn.Embedding, template: str, class_names: list[str],
                  pc: PeftConfig, gen: torch.Generator, positions: int | None, parts=None):
    """{module name: module}: "prompt", the CoOp context, then the modules of the method's `parts`
    (fedsplice.algorithms.PromptParts). Each is drawn after the ones before it, from one generator."""
    def make():
        return PromptLearner(tokenizer, word_embeddings, template, class_names, pc.n_ctx, pc.class_specific, gen,
                              pc.prompt_init)

    prompt = make()
    out: dict[str, nn.Module] = {"prompt": prompt}
    if parts is not None:
        own = parts.modules(make, prompt, gen)
        if "prompt" in own:  # every other name is checked against the model's attributes (TaskModel)
            raise ConfigError("algorithm: its PromptParts.modules names 'prompt', the model's own CoOp "
                              "context; rename it")
        out.update(own)
    if positions and prompt.mask.shape[1] > positions:
        raise ConfigError(f"peft.n_ctx: the longest class sequence has {prompt.mask.shape[1]} "
                          f"tokens, CLIP's text tower takes {positions}; lower peft.n_ctx or shorten "
                          f"data.class_prompt / the class names")
    return out


def build_adapter(hidden: int, pc: PeftConfig, gen: torch.Generator) -> FeatureAdapter:
    return FeatureAdapter(hidden, pc.adapter_hidden or hidden, gen, pc.adapter_init)


def build_head(hidden: int, num_classes: int, gen: torch.Generator) -> nn.Linear:
    """A linear head with nn.Linear's default init bounds (weight), zero bias, seeded."""
    head = nn.Linear(hidden, num_classes)
    with torch.no_grad():
        bound = 1.0 / hidden**0.5
        head.weight.copy_(torch.empty_like(head.weight).uniform_(-bound, bound, generator=gen))
        head.bias.zero_()
    return head


def param_infos(names, rmap: dict[str, str]) -> dict[str, ParamInfo]:
    """Role, LoRA factor, layer and kind of each trainable parameter name."""
    infos = {}
    for name in names:
        if ".lora_A." in name or ".lora_B." in name:
            factor = "A" if ".lora_A." in name else "B"
            module = name.split(f".lora_{factor}.")[0]
            role = next((r for r, s in rmap.items() if module.endswith("." + s)), None)
            m = LAYER.match(module)
            adapter = name.split(f".lora_{factor}.")[1].split(".")[0]
            kind = "lora" if adapter == "default" else f"lora_{adapter}"  # a method's own adapter (LoraParts)
            infos[name] = ParamInfo(role, factor, m.group(1) if m else module, kind)
        elif name.rsplit(".", 1)[-1].startswith("lora_"):  # a method's tensor beside the LoRA (LoraParts.beside)
            module, kind = name.rsplit(".", 1)
            role = next((r for r, s in rmap.items() if module.endswith("." + s)), None)
            m = LAYER.match(module)
            infos[name] = ParamInfo(role, None, m.group(1) if m else module, kind)
        else:  # head, prompt, adapter, projector, backbone ("full"), a method's modules: named by their module
            infos[name] = ParamInfo(None, None, None, name.split(".")[0])
    return infos


def lora_scalings(named_modules) -> dict[str, float]:
    """LoRA scaling s (alpha/r, or alpha/sqrt(r) with rsLoRA) for each LoRA tensor name."""
    out = {}
    for mname, mod in named_modules:
        if hasattr(mod, "scaling") and isinstance(mod.scaling, dict):
            for adapter, s in mod.scaling.items():
                for f in ("A", "B"):
                    out[f"{mname}.lora_{f}.{adapter}.weight"] = float(s)
    return out


def check_roles(infos: dict[str, ParamInfo], roles, mtype: str, rmap: dict[str, str]) -> None:
    """Every role asked for must have matched a module: a split by roles would miss it silently."""
    found = {i.role for i in infos.values() if i.kind == "lora"}
    missing = [r for r in roles if r not in found]
    if missing:
        raise ConfigError(f"peft.roles: role(s) {missing} match no module of this {mtype} backbone "
                          f"(role map {rmap}); choose roles it has or another model")
