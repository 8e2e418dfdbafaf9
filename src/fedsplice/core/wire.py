"""What crosses the wire: name-keyed tensors serialized with safetensors (no pickle).

Communication is measured as the length of these serialized payloads, not estimated from
parameter counts, so headers and dtypes are counted as they would be sent.
"""

from __future__ import annotations

import base64
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


class WireViolation(RuntimeError):
    """A payload carries a name it must not (a PRIVATE tensor, or an unknown name)."""


def encode(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def decode(payload: bytes) -> dict[str, torch.Tensor]:
    return st_load(payload) if payload else {}


CODEC_KEY = "fedsplice.codec"  # safetensors metadata: how the tensors of an upload are coded
SCALES_KEY = "fedsplice.scales"


def metadata(payload: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (8-byte little-endian length, then JSON)."""
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + n]).get("__metadata__") or {}


def compress(params: dict[str, torch.Tensor], received: dict[str, torch.Tensor], codec: str,
             residual: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A client's upload: the tensors (fp32), or the round's update `params - received` coded as
    fp16, or as int8 with one scale per tensor (max|x|/127) and error feedback (Seide et al.
    2014; Karimireddy et al. 2019): what quantization dropped, `residual`, is added to the next
    round's update, so nothing is lost for good. Returns (payload, the new residual)."""
    if codec == "fp32":
        return encode(params), {}
    meta, out, new_residual, scales = {CODEC_KEY: f"{codec}-delta"}, {}, {}, []
    for n in sorted(params):
        d = params[n].detach().float() - received[n].float()
        if codec == "fp16":
            out[n] = d.half()
            continue
        d = d + residual[n] if n in residual else d
        s = d.abs().max() / 127
        s = s if s > 0 else torch.ones(())
        q = torch.round(d / s).clamp(-127, 127).to(torch.int8)
        scales.append(float(s))
        out[n] = q
        new_residual[n] = d - q.float() * float(s)
    if scales:  # float32 bits, in name order: exact, and no name repeated in the header
        meta[SCALES_KEY] = base64.b64encode(struct.pack(f"<{len(scales)}f", *scales)).decode()
    return st_save({k: v.contiguous() for k, v in out.items()}, metadata=meta), new_residual


def decode_update(payload: bytes, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an upload stands for: coded updates are added back onto `reference` (the
    GLOBAL tensors the server sent this round). Raises on a malformed payload."""
    tensors = decode(payload)
    meta = metadata(payload) if payload else {}
    codec = meta.get(CODEC_KEY)
    if codec is None:
        return tensors
    if codec not in ("fp16-delta", "int8-delta"):
        raise ValueError(f"unknown upload codec {codec!r}")
    names = sorted(tensors)
    if codec == "int8-delta":
        raw = base64.b64decode(meta[SCALES_KEY])
        scales = dict(zip(names, struct.unpack(f"<{len(names)}f", raw)))
    out = {}
    for n in names:
        q = tensors[n]
        if n not in reference:
            out[n] = q  # left for validation to reject by name
            continue
        d = q.float() * scales[n] if codec == "int8-delta" else q.float()
        out[n] = (reference[n].float() + d).to(reference[n].dtype)
    return out


def audit(tensors: dict[str, torch.Tensor], allowed: set[str], private: set[str], who: str) -> None:
    """Refuse a payload with any PRIVATE or unknown name (checked on the decoded message)."""
    leaked = sorted(set(tensors) & private)
    if leaked:
        raise WireViolation(f"{who}: payload carries PRIVATE tensor {leaked[0]}")
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise WireViolation(f"{who}: payload carries unknown tensor {unknown[0]}")
