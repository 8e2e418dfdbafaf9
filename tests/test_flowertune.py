"""FlowerTune's communication count (fedsplice.federation.flowertune) from shapes on the meta device."""

from __future__ import annotations

import io

import numpy as np
import pytest

from fedsplice.federation import flowertune as FT


@pytest.mark.parametrize("shape, dtype", [((32, 4096), "<f4"), ((1024, 32), "<f4"), ((3,), "<f2"), ((), "<f4")])
def test_npy_bytes_is_what_np_save_writes(shape, dtype):
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype=dtype))
    assert FT.npy_bytes(shape, dtype) == buf.tell()


def test_the_leaderboards_baseline_costs_follow_from_the_shapes():
    """flower.ai/benchmarks/llm-leaderboard (general NLP): Mistral-7B-v0.3 "40.7 GB", Llama-3.2-3B
    "27.4 GB", both with the template's LoRA r32/alpha64 on peft's default targets (q_proj, v_proj),
    200 rounds, 2 of 20 clients a round (fraction 0.1; FedAvg's minimum of 2)."""
    from transformers import LlamaConfig, MistralConfig

    mistral = MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=32768)  # Mistral-7B-v0.3's config.json
    shapes = FT.lora_shapes(mistral, r=32, alpha=64)
    assert len(shapes) == 32 * 2 * 2  # layers x (q, v) x (A, B)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 32 * (32 * (4096 + 4096) + 32 * (4096 + 1024))
    gib = FT.run_gib(shapes, rounds=200, clients_per_round=2)
    assert gib == pytest.approx(40.637, abs=5e-4)
    # the leaderboard prints 40.7: 0.06 GiB (0.15%) above this count, which we could not trace
    # (the same count gives Llama-3.2-3B's published figure to the digit, below)
    assert abs(gib - 40.7) < 0.07
    llama = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True)
    assert round(FT.run_gib(FT.lora_shapes(llama, r=32, alpha=64), rounds=200, clients_per_round=2), 1) == 27.4
