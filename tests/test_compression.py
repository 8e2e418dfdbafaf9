"""Compressed uploads: fp16 / int8 (+ error feedback) updates, decoded exactly as the client coded them."""

import pytest
import torch

from fedsplice.core import wire
from fedsplice.errors import ConfigError
from fedsplice.federation import fit_client as client_update
from fedsplice.federation.experiment import build
from fedsplice.federation.gather import gather
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.inprocess import run_rounds


def _tensors(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {"a.lora_A.weight": torch.randn(4, 32, generator=g) * scale,
            "b.lora_B.weight": torch.randn(32, 4, generator=g) * scale}


def test_fp32_is_the_plain_payload():
    p, ref = _tensors(0), _tensors(1)
    up, res = wire.compress(p, ref, "fp32", {})
    assert up == wire.encode(p) and res == {}
    assert all(torch.equal(v, p[k]) for k, v in wire.decode_update(up, ref).items())


def test_fp16_update_roundtrip():
    p, ref = _tensors(0), _tensors(1)
    up, res = wire.compress(p, ref, "fp16", {})
    got = wire.decode_update(up, ref)
    assert wire.metadata(up)[wire.CODEC_KEY] == "fp16-delta" and res == {}
    for k in p:
        want = ref[k] + (p[k] - ref[k]).half().float()
        assert torch.equal(got[k], want)
        assert (got[k] - p[k]).abs().max() < 2e-3 * (p[k] - ref[k]).abs().max()


def test_int8_update_matches_hand_quantization_and_error_feedback_telescopes():
    ref = _tensors(1)
    residual, sent, true = ({}, {k: torch.zeros_like(v) for k, v in ref.items()},
                            {k: torch.zeros_like(v) for k, v in ref.items()})
    for t in range(5):
        p = {k: ref[k] + v for k, v in _tensors(10 + t, scale=0.1).items()}
        prev = {k: v.clone() for k, v in residual.items()}
        up, residual = wire.compress(p, ref, "int8", residual)
        got = wire.decode_update(up, ref)
        scales = wire.decode_update(up, {k: torch.zeros_like(v) for k, v in ref.items()})
        for k in p:
            d = p[k] - ref[k] + prev.get(k, 0)
            s = d.abs().max() / 127
            q = torch.round(d / s).clamp(-127, 127)
            assert torch.allclose(scales[k], q * s, atol=1e-7)
            assert torch.allclose(got[k] - ref[k], q * s, atol=1e-7)
            assert residual[k].abs().max() <= s / 2 + 1e-7  # rounding error, no more
            sent[k] += got[k] - ref[k]
            true[k] += p[k] - ref[k]
    # Σ sent = Σ true − e_T: error feedback loses nothing but the last residual
    for k in ref:
        assert torch.allclose(sent[k], true[k] - residual[k], atol=1e-5)


def test_int8_payload_is_about_a_quarter():
    p, ref = _tensors(0), _tensors(1)
    full = len(wire.compress(p, ref, "fp32", {})[0])
    small = len(wire.compress(p, ref, "int8", {})[0])
    half = len(wire.compress(p, ref, "fp16", {})[0])
    n = sum(v.numel() for v in p.values())
    assert n <= small - 100 < small < 0.27 * full + 400 and n * 2 < half < 0.5 * full + 300


def test_malformed_coded_payload_raises_in_decode_and_is_rejected_by_gather():
    """`wire.decode_update` raises on a malformed upload (documented); the round's `gather`
    turns that into a rejected reply with the reason, and the round goes on without it."""
    from safetensors.torch import save

    from fedsplice.federation import Reply

    ref = _tensors(1)
    no_scales = save({k: torch.zeros(v.shape, dtype=torch.int8) for k, v in ref.items()},
                     metadata={wire.CODEC_KEY: "int8-delta"})
    with pytest.raises(KeyError):
        wire.decode_update(no_scales, ref)
    unknown = save({"x": torch.zeros(1)}, metadata={wire.CODEC_KEY: "zip"})
    with pytest.raises(ValueError, match="codec"):
        wire.decode_update(unknown, ref)
    good, _ = wire.compress(_tensors(0), ref, "int8", {})

    class T:
        def fit(self, rnd, cids, down):
            return [Reply(c, payload, 10, {}, len(payload), len(down))
                    for c, payload in zip(cids, (no_scales, unknown, good))]

    got = gather(T(), 1, [0, 1, 2], wire.encode(ref), ref, set(), min_replies=1, max_retries=1, norm_bound=0.0)
    assert got.events == [
        {"client": 0, "event": "rejected", "reason": "undecodable payload (KeyError)", "attempt": 0},
        {"client": 1, "event": "rejected", "reason": "undecodable payload (ValueError)", "attempt": 0}]
    assert got.attempts == 1 and [r.cid for r, _ in got.accepted] == [2]
    want = wire.decode_update(good, ref)
    assert all(torch.equal(got.accepted[0][1][k], want[k]) for k in ref)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_compressed_run_uploads_less_and_keeps_its_residual_private(tiny_cfg, codec):
    exp = build(tiny_cfg(client__upload=codec, server__rounds=3))
    store, rec = MemoryStore(), []
    run_rounds(exp, store, rec.append)
    ref = build(tiny_cfg(server__rounds=3))
    rec32 = []
    run_rounds(ref, MemoryStore(), rec32.append)
    ratio = rec[1]["up_bytes"] / rec32[1]["up_bytes"]
    # tiny tensors (4x32): the safetensors header is a large share here; at MiniLM size see benchmarks/comm.py
    assert ratio < (0.65 if codec == "fp16" else 0.5)
    assert rec[1]["rejected"] == 0 and all(r.get("skipped") is None for r in rec)
    for a, b in zip(rec[1:], rec32[1:]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=0.05)
    st = store.get(rec[-1]["clients"][0])
    ef = [k for k in st if k.startswith("ef/")]
    assert (len(ef) == len(exp.global_names)) == (codec == "int8")
    # the upload carries the GLOBAL names only (the residual stays in the store)
    up, _ = client_update(exp, store, 0, 9, wire.encode({n: exp.init_params[n] for n in exp.global_names}))
    assert sorted(wire.decode(up)) == sorted(exp.global_names)


def test_gather_decodes_a_coded_upload_against_what_was_sent(tiny_cfg):
    exp = build(tiny_cfg(client__upload="int8"))
    g = {n: exp.init_params[n] for n in exp.global_names}

    class T:
        def fit(self, rnd, cids, down):
            from fedsplice.federation import Reply
            out = []
            for c in cids:
                up, st = client_update(exp, MemoryStore(), c, rnd, down)
                out.append(Reply(c, up, 10, st, len(up), len(down)))
            return out

    got = gather(T(), 1, [0, 1], wire.encode(g), g, set(exp.private_names), min_replies=2,
                 max_retries=0, norm_bound=0.0)
    assert len(got.accepted) == 2
    for _, tensors in got.accepted:
        assert sorted(tensors) == sorted(g) and all(t.dtype == torch.float32 for t in tensors.values())
        assert any(not torch.equal(tensors[n], g[n]) for n in g)


def test_compressed_upload_is_simulation_only(tiny_cfg):
    with pytest.raises(ConfigError, match="client.upload"):
        tiny_cfg(client__upload="int8", runtime__kind="flower")
