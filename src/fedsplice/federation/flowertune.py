"""Communication as FlowerTune counts it, from a model's shapes alone (no weights).

FlowerTune's strategy (flwrlabs/flower, examples/flowertune-llm-*/strategy.py; the template of
PR #4013, in use when the leaderboard's baselines ran) adds up, for every message it sends to a
sampled client and every reply, the bytes of each tensor as Flower serializes it: `np.save`, a
.npy header (padded to 64-byte blocks, 128 bytes for these shapes) and the raw data. It logs MiB
(1024**2) against a 200,000 MiB budget; the leaderboard's "GB" are GiB (that figure / 1024).

With LoRA r = 32 (alpha 64) on peft's default targets and fp32 adapters, 200 rounds and 2 clients a
round, Mistral-7B-v0.3 comes to 40.64 GiB (the leaderboard prints 40.7) and Llama-3.2-3B to
27.35 GiB (it prints 27.4): tests/test_flowertune.py.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch

GIB, MIB = 1 << 30, 1 << 20


def npy_bytes(shape: tuple[int, ...], dtype: str = "<f4") -> int:
    """The size of `np.save` of an array of `shape` and `dtype`: its header, then its data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": tuple(shape)})
    return buf.tell() + np.dtype(dtype).itemsize * math.prod(shape)


def message_bytes(shapes: dict[str, tuple[int, ...]], dtype: str = "<f4") -> int:
    """One message's parameters as FlowerTune's tracker counts them."""
    return sum(npy_bytes(s, dtype) for s in shapes.values())


def run_gib(shapes: dict[str, tuple[int, ...]], rounds: int, clients_per_round: int, dtype: str = "<f4") -> float:
    """A run's communication in GiB: every round, the parameters to each sampled client and back."""
    return rounds * clients_per_round * 2 * message_bytes(shapes, dtype) / GIB


def lora_shapes(model_config, r: int, alpha: int, targets: list[str] | None = None) -> dict[str, tuple[int, ...]]:
    """The LoRA tensors' shapes of a causal LM built from `model_config` on the meta device (no
    memory, no weights); `targets` None: peft's defaults for the model type."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
        model = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=targets), model)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n}
