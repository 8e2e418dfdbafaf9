"""What crosses the wire: name-keyed tensors serialized with safetensors (no pickle).

Communication is measured as the length of these serialized payloads, not estimated from
parameter counts, so headers and dtypes are counted as they would be sent.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


class WireViolation(RuntimeError):
    """A payload carries a name it must not (a PRIVATE tensor, or an unknown name)."""


def encode(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def decode(payload: bytes) -> dict[str, torch.Tensor]:
    return st_load(payload) if payload else {}


def audit(tensors: dict[str, torch.Tensor], allowed: set[str], private: set[str], who: str) -> None:
    """Refuse a payload with any PRIVATE or unknown name (checked on the decoded message)."""
    leaked = sorted(set(tensors) & private)
    if leaked:
        raise WireViolation(f"{who}: payload carries PRIVATE tensor {leaked[0]}")
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise WireViolation(f"{who}: payload carries unknown tensor {unknown[0]}")
