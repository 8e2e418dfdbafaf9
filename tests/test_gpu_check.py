"""scripts/gpu_check.py (issues 14, 27): its `--device cpu --small` mode runs every stage here and
gives the tables; a missing CUDA device exits 2; its checks can fail; a stage that raises is a FAIL
row; and configs/pfadapter-qwen2-7b-nf4.toml (hub + GPU, never run here) passes `fedsplice validate`.

The CUDA-only lines of the script (device synchronization, peak memory, the CPU-vs-CUDA equality
run) cannot run on this machine; everything else runs in the --small mode below.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
QWEN_7B = ROOT / "configs" / "pfadapter-qwen2-7b-nf4.toml"


def _load_script():
    spec = importlib.util.spec_from_file_location("fedsplice_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load_script()
from gpucheck import fixtures as fx  # noqa: E402 (on sys.path once the script loaded)
from gpucheck import measure, runs, stages  # noqa: E402


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDSPLICE_CACHE": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def _rows(markdown: str) -> list[list[str]]:
    lines = [s for s in markdown.splitlines() if s.startswith("| ")]
    return [[c.strip() for c in s.strip("|").split("|")] for s in lines[1:]]  # after the header row


STAGE_ROWS = {"preflight": 2, "parity": 3, "precision": 3, "quant": 2, "checkpointing": 2, "throughput": 2,
              "memory": 1, "workers": 1, "clients": 6}


@pytest.mark.integration
def test_small_cpu_mode_runs_every_stage_and_writes_the_tables(tmp_path):
    """All nine stages on this CPU with tiny shapes: every row PASSes (bitsandbytes runs on a CPU
    at the pinned version, so quant and memory run too); the markdown is printed and written, and
    the JSON holds the same rows."""
    out, js = tmp_path / "gpu.md", tmp_path / "gpu.json"
    p = _run(["--device", "cpu", "--small", "--out", str(out), "--json", str(js)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = out.read_text()
    assert text in p.stdout and "RANDOM weights" in text and "--small" in text
    rows, data = _rows(text), json.loads(js.read_text())
    assert [r[0] for r in rows] == [s for s, n in STAGE_ROWS.items() for _ in range(n)]
    assert [r["stage"] for r in data["rows"]] == [r[0] for r in rows] and data["header"] in text
    for r in data["rows"]:
        assert r["ok"] and r["check"].startswith(("PASS", "reference")), r
        assert r["peak_bytes"] is None and r["syncs_per_step"] is None  # no CUDA here
    by = {(r["stage"], r["what"]): r for r in data["rows"]}
    assert all(r["rate"] > 0 for r in data["rows"] if r["stage"] == "preflight")
    for family in ("tiny BERT", "tiny Llama", "tiny CLIP"):
        r = next(v for (s, w), v in by.items() if s == "parity" and w.startswith(family))
        diff = float(r["check"].split("max diff ")[1].split()[0])
        assert 0 < diff <= runs.BF16_TOL, r  # bf16 moved the numbers, and not by much
    for r in data["rows"]:
        if r["stage"] in ("precision", "throughput", "checkpointing"):
            assert r["step_s"] > 0 and r["rate"] > 0, r
    fp16 = data["rows"][7]
    assert fp16["precision"] == "fp16 (base fp16)" and fp16["check"].startswith("PASS: 4 of 4 optimizer steps")
    for r in data["rows"][8:10]:
        assert "names equal the unquantized model's; round trip exact" in r["check"]
    workers = next(r for r in data["rows"] if r["stage"] == "workers")
    assert workers["check"].startswith("PASS: max diff against workers = 1: 0.00e+00")
    together = [r for r in data["rows"] if r["stage"] == "clients" and r["what"].endswith("together")]
    assert [r["what"].split(", ")[2] for r in together] == ["2 clients a round", "4 clients a round",
                                                           "8 clients a round"]
    for r in (r for r in data["rows"] if r["stage"] == "clients"):
        assert r["rate"] > 0 and r["unit"] == "clients/h", r
    for r in together:  # batched training agrees with one client after another (bf16 on this CPU)
        assert float(r["check"].split("max diff ")[1].split()[0]) <= runs.BF16_TOL, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
@pytest.mark.integration
def test_missing_cuda_exits_2_with_one_line(tmp_path, device):
    p = _run(["--device", device], tmp_path)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "CUDA device" in p.stderr, p.stderr
    assert p.stdout == ""


@pytest.mark.integration
def test_unknown_device_exits_2(tmp_path):
    p = _run(["--device", "tpu"], tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == "gpu_check: --device 'tpu': use cuda, cuda:N or cpu"


@pytest.mark.integration
def test_unknown_stage_exits_2_naming_the_stages(tmp_path):
    p = _run(["--device", "cpu", "--only", "parity,speed"], tmp_path)
    assert p.returncode == 2 and "unknown stage(s) ['speed']; use some of preflight, parity" in p.stderr


def test_the_parity_check_fails_when_bf16_does_nothing(tmp_path):
    """With the bf16 run made fp32, the two runs agree exactly: the row must say FAIL, not PASS."""
    from fedsplice.data.tiny import tiny_llama

    ctx = runs.Ctx("cpu", True, tmp_path)
    fp32_only = lambda m, d, dev, prec, dt, **kw: fx.lm_config(m, d, dev, "fp32", dt, **kw)  # noqa: E731
    row = stages.parity_row(ctx, "tiny Llama", tiny_llama(tmp_path / "tiny"), fp32_only, ctx.text(), 32)
    assert not row.ok and row.check == "FAIL: max diff 0.00e+00 <= 0.05 (identical: bf16 had no effect)"


def test_a_stage_that_raises_is_its_fail_row_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access\nsecond line")

    monkeypatch.setitem(gpu_check.STAGES, "quant", broken)
    monkeypatch.setitem(gpu_check.STAGES, "workers", lambda ctx: [measure.Row("workers", "w", "cpu", "fp32")])
    assert gpu_check.main(["--device", "cpu", "--small", "--only", "quant,workers", "--workdir", str(tmp_path)]) == 1
    rows = _rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["quant", "workers"]
    assert rows[0][-1].startswith("FAIL: RuntimeError: CUDA error: an illegal memory access (test_gpu_check.py:")


def test_syncs_are_counted_inside_the_training_steps_only():
    """The profiler's blocking CUDA calls inside the marked step ranges, per step; the meter's own
    synchronize at a step's ends lies outside its range."""
    from types import SimpleNamespace as NS

    def ev(name, start, end):
        return NS(name=name, time_range=NS(start=start, end=end))

    step = measure.STEP_RANGE
    prof = NS(events=lambda: [ev(step, 10, 20), ev(step, 30, 40), ev("cudaStreamSynchronize", 12, 13),
                              ev("cudaMemcpy", 31, 32), ev("cudaStreamSynchronize", 33, 34),
                              ev("cudaDeviceSynchronize", 20, 21), ev("cudaLaunchKernel", 14, 15),
                              ev("cudaStreamSynchronize", 25, 26)])
    assert measure.syncs_per_step(prof) == 1.5
    assert measure.syncs_per_step(NS(events=lambda: [])) is None


def test_useful_flops_per_token_of_the_qwen2_1_5b_shape():
    """4 x the decoder layers' linear weights: 28 x (2 x 1536^2 + 2 x 1536 x 256 + 3 x 1536 x 8960)
    = 1,310,195,712 weights (the 1.54B model less its 233M-weight embedding), x 4."""
    assert measure.llama_train_flops(fx.QWEN2_1_5B) == 4 * 1_310_195_712


class _Run:
    def __init__(self, losses, gm=0.5, pm=0.5):
        self._recs = [{"round": 0}] + [{"round": i + 1, "train_loss": v} for i, v in enumerate(losses)]
        self.gm = {"accuracy": gm, "f1_macro": gm}
        self.pm = {"accuracy": pm, "f1_macro": pm}

    def records(self):
        return self._recs


def test_max_diff_is_relative_on_losses_and_absolute_on_metrics():
    md = runs.max_diff
    assert md(_Run([2.0, 1.0]), _Run([2.0, 1.0])) == 0.0
    assert md(_Run([2.0, 1.0]), _Run([2.0, 1.01])) == pytest.approx(0.01)
    assert md(_Run([2.0]), _Run([2.0], gm=0.6)) == pytest.approx(0.1)
    assert md(_Run([2.0]), _Run([2.0], pm=0.45)) == pytest.approx(0.05)
    assert md(_Run([2.0, 1.0]), _Run([2.0])) == math.inf  # a round missing is no agreement


def test_meter_times_steps_and_counts_tokens_of_the_first_layer():
    """Two training steps of a 2-layer Llama: tokens = batch x length through layer 0 only;
    forwards without autograd (evaluation) are not counted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 50, (3, 7))
    with measure.Meter(torch.device("cpu"), width=16, per_token=True) as m:
        with torch.no_grad():
            model(ids)
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step()
    assert [n for _, n in m.steps] == [21, 21]
    s = m.summary()
    assert s["steps"] == 2 and s["step_s"] > 0 and s["rate"] > 0 and s["peak"] is None


def test_tiny_builders_take_real_shapes(tmp_path):
    """The additive shape / dtype parameters of fedsplice.data.tiny, as gpu_check uses them."""
    from safetensors import safe_open

    from fedsplice.data.tiny import tiny_clip, tiny_llama

    lm = tiny_llama(tmp_path / "lm", shape=fx.SMALL_LLAMA, dtype=torch.bfloat16)
    cfg = json.loads((lm / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2
    with safe_open(str(lm / "model.safetensors"), "pt") as f:
        assert f.get_tensor(f.keys()[0]).dtype == torch.bfloat16
    c = fx.SMALL_CLIP
    clip = tiny_clip(tmp_path / "clip", text=c["text"], vision=c["vision"], projection_dim=c["projection_dim"])
    cfg = json.loads((clip / "config.json").read_text())
    assert cfg["vision_config"]["hidden_size"] == 48 and cfg["text_config"]["hidden_size"] == 32
    assert cfg["projection_dim"] == 16
    pre = json.loads((clip / "preprocessor_config.json").read_text())
    assert pre["crop_size"] == {"height": 32, "width": 32}


def test_qwen2_7b_nf4_config_passes_validate(capsys):
    """The paper-scale config needs the hub and a GPU; `fedsplice validate` checks it offline
    (without reading the data: the test cache is empty) and loads no model."""
    from fedsplice.app.cli import main

    assert main(["validate", "--no-data", str(QWEN_7B)]) == 0
    plan, ok = capsys.readouterr().out.splitlines()  # offline, the hub model's config.json is not here to plan
    assert plan.startswith("plan: skipped (model.name: 'Qwen/Qwen2-7B-Instruct' is not in the local")
    assert ok.startswith("ok:")
    from fedsplice.federation.validate import load_config

    cfg = load_config(QWEN_7B)
    assert (cfg.model.name, cfg.model.quantization, cfg.model.dtype) == ("Qwen/Qwen2-7B-Instruct", "nf4", "bf16")
    assert cfg.model.gradient_checkpointing and (cfg.runtime.device, cfg.runtime.precision) == ("cuda", "bf16")
    assert (cfg.peft.r, cfg.peft.alpha, cfg.client.lr, cfg.server.rounds) == (8, 16.0, 2e-5, 50)
    assert (cfg.data.num_clients, cfg.server.clients_per_round, cfg.method["ortho_lambda"]) == (10, 2, 0.1)


def test_defaults_and_the_header_of_a_real_shape_run():
    args = gpu_check.parse([])
    assert (args.device, args.small, args.precision, args.steps, args.batch, args.out, args.json,
            args.mem_cap_gib) == ("cuda", False, "bf16", 6, 16, None, None, 48.0)
    assert args.stages == ["preflight", "parity", "precision", "quant", "checkpointing", "throughput", "memory",
                           "workers", "clients"]
    text = gpu_check.header(args, torch.device("cpu"), 12.3)
    assert "real shapes (Qwen2-1.5B, ViT-B/16, Qwen2-7B + so400m)" in text and "633 words" in text
    assert gpu_check.parse(["--small"]).steps == 2
    assert gpu_check.parse(["--only", " memory, parity "]).stages == ["memory", "parity"]


def test_a_refused_config_exits_2_with_one_line(monkeypatch, capsys):
    from fedsplice.errors import ConfigError

    def refuse(ctx):
        raise ConfigError("model.quantization = 'nf4' needs bitsandbytes")

    monkeypatch.setitem(gpu_check.STAGES, "parity", refuse)
    assert gpu_check.main(["--device", "cpu", "--small", "--only", "parity"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == "gpu_check: model.quantization = 'nf4' needs bitsandbytes"
