"""The split: every trainable parameter name belongs to exactly one group, GLOBAL or PRIVATE.

GLOBAL tensors are trained locally, uploaded and aggregated; PRIVATE tensors never leave the
client. Policies are written in roles (q/k/v/o), LoRA factors (A/B) or `head`, so one policy
fits every backbone (cf. optax.partition: a label per leaf).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fedsplice.errors import ConfigError

GLOBAL = "global"
PRIVATE = "private"


@dataclass(frozen=True)
class ParamInfo:
    """What a trainable parameter is, read off its name by the backbone."""

    role: str | None  # q, k, v, o for attention LoRA; None otherwise
    factor: str | None  # "A" or "B" for LoRA; None otherwise
    layer: str | None  # a key shared by the LoRA tensors of one attention block
    # what the tensor belongs to: "lora", "lora_<adapter>" (a method's own adapter, LoraParts:
    # pFedLoRA's "lora_private"), or the
    # module a non-LoRA tensor lives in, named by its first path part: "head", "prompt",
    # "adapter", "projector", "backbone" (full fine-tuning), or a module a method adds
    # (PromptParts: "prompt_local", "prompt_lowrank", "prompt_ot") (model/peft.py)
    kind: str


def all_global(infos: Mapping[str, ParamInfo]) -> dict[str, str]:
    return {n: GLOBAL for n in infos}


def none_global(infos: Mapping[str, ParamInfo]) -> dict[str, str]:
    """Local-only training: nothing travels."""
    return {n: PRIVATE for n in infos}


def by_roles(infos: Mapping[str, ParamInfo], global_roles: Iterable[str]) -> dict[str, str]:
    """PFAdapter: LoRA of `global_roles` is GLOBAL, other LoRA PRIVATE; non-role tensors GLOBAL."""
    g = set(global_roles)
    return {n: GLOBAL if (i.role is None or i.role in g) else PRIVATE for n, i in infos.items()}


def by_lora_factor(infos: Mapping[str, ParamInfo]) -> dict[str, str]:
    """FedSA-LoRA: A matrices GLOBAL, B matrices PRIVATE; non-LoRA tensors GLOBAL."""
    return {n: PRIVATE if i.factor == "B" else GLOBAL for n, i in infos.items()}


def head_private(infos: Mapping[str, ParamInfo]) -> dict[str, str]:
    """FedPer: the classification head stays on the client; everything else is shared."""
    if not any(i.kind == "head" for i in infos.values()):
        raise ConfigError("a private classification head needs a trainable one: set model.task = 'encoder_head'")
    return {n: PRIVATE if i.kind == "head" else GLOBAL for n, i in infos.items()}


def validate(split: dict[str, str], trainable: list[str]) -> None:
    """Every trainable parameter has exactly one group, and nothing else is grouped."""
    missing = [n for n in trainable if n not in split]
    extra = [n for n in split if n not in set(trainable)]
    bad = [n for n, g in split.items() if g not in (GLOBAL, PRIVATE)]
    if missing:
        raise ConfigError(f"split leaves {len(missing)} trainable parameter(s) ungrouped, e.g. "
                          f"{missing[0]}; every trainable tensor must be GLOBAL or PRIVATE")
    if extra:
        raise ConfigError(f"split names {extra[0]}, which is not a trainable parameter")
    if bad:
        raise ConfigError(f"split puts {bad[0]} in group {split[bad[0]]!r}; use 'global' or 'private'")


def names_in(split: dict[str, str], group: str) -> list[str]:
    return sorted(n for n, g in split.items() if g == group)
