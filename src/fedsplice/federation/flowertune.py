"""Communication as FlowerTune counts it: from a model's shapes alone (no weights), and of a run
from its ledger and metrics (`run_bytes`, which `fedsplice leaderboard` reports).

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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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


def lora_shapes(model_config: PretrainedConfig, r: int, alpha: int,
                targets: list[str] | None = None) -> dict[str, tuple[int, ...]]:
    """The LoRA tensors' shapes of a causal LM built from `model_config` on the meta device (no
    memory, no weights); `targets` None: peft's defaults for the model type."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)  # type: ignore[no-untyped-call]  # transformers: unannotated
        model = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=targets), model)
    return {n: tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n}


def row_bytes(row: dict[str, Any]) -> int:
    """One tensor of a run's ledger (fedsplice.federation.ledger) as FlowerTune's tracker counts it:
    the `np.save` size of its shape and dtype."""
    return npy_bytes(tuple(row["shape"]), np.dtype(row["dtype"]).str)


def messages_sent(record: dict[str, Any], clients_per_round: int) -> int:
    """The messages a round (its metrics.jsonl record) sent to clients: one to each sampled client,
    and one more to each client asked again after it dropped or was late (server.max_retries)."""
    attempts = record.get("attempts", 1)
    again: int = sum(e["event"] in ("dropped", "late") and e["attempt"] < attempts - 1
                     for e in record.get("events", []))
    return clients_per_round + again


def run_bytes(server_rows: list[dict[str, Any]], records: list[dict[str, Any]],
              clients_per_round: int) -> tuple[int, int]:
    """(up, down) bytes of a run as FlowerTune counts them: every upload the server accepted (its
    ledger rows, in their dtype) and the GLOBAL tensors (fp32, their shapes from those rows) in
    every message sent to a client."""
    shapes = {r["name"]: tuple(r["shape"]) for r in server_rows}
    sent = sum(messages_sent(r, clients_per_round) for r in records if r.get("round", 0) >= 1 and "clients" in r)
    return sum(row_bytes(r) for r in server_rows), sent * message_bytes(shapes)
