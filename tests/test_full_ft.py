"""Federated full fine-tuning (`full-ft`, peft.type = "full"): the cost reference of PFAdapter's
Table IV. Every backbone weight trains and travels; nothing is private, so nothing is kept per client."""

from __future__ import annotations

import pytest
import torch

from fedsplice.app.cli import main
from fedsplice.app.runner import run_experiment
from fedsplice.core import wire
from fedsplice.core.server import deltas, fedavg, weighted_mean
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.inprocess import run_rounds


@pytest.fixture
def full_cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    def make(**kw):
        return cfg_factory(tiny_bert_dir, toy_jsonl, algorithm='"full-ft"', peft__type='"full"', **kw)
    return make


def _hf_names(model_dir) -> list[str]:
    from transformers import AutoModel

    return [n for n, _ in AutoModel.from_pretrained(model_dir).named_parameters()]


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_every_backbone_parameter_trains_and_travels(full_cfg, tiny_bert_dir):
    exp = build(full_cfg())
    want = sorted(f"backbone.{n}" for n in _hf_names(tiny_bert_dir))
    assert sorted(exp.model.trainable()) == want
    assert exp.global_names == want and exp.private_names == []
    assert all(i.kind == "backbone" and i.role is None for i in exp.model.param_infos().values())
    assert all(t.dtype == torch.float32 for t in exp.init_params.values())


def test_no_frozen_work_is_cached(full_cfg):
    # nothing is frozen: no prefix or feature cache, and the class side runs the trained encoder
    exp = build(full_cfg(runtime__cache=True))
    assert exp.model.cache_stats() == {}
    assert exp.model._classes.trains_text and exp.model._text.prefix is None


def test_the_input_side_gets_gradients(full_cfg):
    exp = build(full_cfg())
    m = exp.model
    m.train()
    loss = m(exp.data.train_texts[:4]).logsumexp(-1).sum()
    loss.backward()
    p = dict(m.named_parameters())
    assert p["backbone.encoder.layer.0.attention.self.query.weight"].grad.abs().sum() > 0
    assert p["backbone.embeddings.word_embeddings.weight"].grad.abs().sum() > 0


def test_fedavg_of_identical_full_updates_is_the_identity(full_cfg):
    exp = build(full_cfg())
    g = torch.Generator().manual_seed(0)
    x = exp.init_params
    u = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in x.items()}
    assert all(torch.equal(v, u[n]) for n, v in weighted_mean([u, u, u], [5, 11, 17]).items())
    d = weighted_mean([deltas(u, x) for _ in range(3)], [5, 11, 17])
    opt = fedavg(1.0)
    new, _ = opt.update(d, opt.init(x), x)
    assert all(torch.equal(new[n], u[n]) for n in u)


def test_two_rounds_upload_the_whole_model(full_cfg, capture_uploads):
    cfg = full_cfg(server__rounds=2)
    exp = build(cfg)
    records = []
    final = run_rounds(exp, MemoryStore(), records.append)
    per_client = len(wire.encode(exp.init_params))  # float32 bytes + the safetensors header
    model_bytes = _nbytes(exp.init_params)
    assert model_bytes < per_client < model_bytes + 16 * 1024
    m = cfg.server.clients_per_round
    assert len(capture_uploads) == 2 * m
    assert all(len(b) == per_client for _, _, b in capture_uploads)
    assert [r["up_bytes"] for r in records[1:]] == [per_client * m] * 2
    assert final["up_bytes"] == final["down_bytes"] == per_client * m * 2
    # the clients trained every weight, and the server moved to their mean
    up = wire.decode(capture_uploads[0][2])
    assert sorted(up) == exp.global_names
    moved = [n for n in up if not torch.equal(up[n], exp.init_params[n])]
    assert "backbone.encoder.layer.0.attention.output.dense.weight" in moved
    assert any(not torch.equal(final["global_params"][n], exp.init_params[n]) for n in moved)


def test_disk_store_and_checkpoints_keep_no_copy_per_client(full_cfg, tmp_path):
    cfg = full_cfg(server__rounds=2, runtime__store='"disk"', runtime__checkpoint_every=1,
                   runtime__keep_checkpoints=2)
    run_experiment(cfg, tmp_path / "run", quiet=True)
    model_bytes = _nbytes(build(cfg).init_params)
    small = 1024  # a client file holds no tensor at all: a header only
    client_files = list((tmp_path / "run" / "client_state").glob("*.safetensors"))
    assert len(client_files) >= cfg.server.clients_per_round
    assert all(p.stat().st_size < small for p in client_files)
    cps = sorted((tmp_path / "run" / "checkpoints").glob("round-*"))
    assert len(cps) == 2
    for cp in cps:
        clients = list((cp / "clients").glob("*.safetensors"))
        assert clients and all(p.stat().st_size < small for p in clients)
        # one copy of the model per checkpoint (GLOBAL), a stateless FedAvg server
        assert model_bytes < (cp / "global.safetensors").stat().st_size < model_bytes + 16 * 1024
        assert (cp / "server.safetensors").stat().st_size < small


def _one_error_line(capsys, argv) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [s for s in err.splitlines() if s.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    return lines[0]


@pytest.mark.parametrize("sets,needle", [
    (["peft.type=full"], "algorithm 'pfadapter'"),  # the default: needs LoRA roles
    (["method={}", "algorithm=fedsa-lora", "peft.type=full"], "use algorithm = 'full-ft'"),
    (["method={}", "algorithm=lora", "peft.type=full"], "use algorithm = 'full-ft'"),
    (["method={}", "algorithm=fedpurel", "peft.type=full"], "algorithm 'fedpurel'"),
    (["method={}", "algorithm=full-ft", "peft.type=full", "peft.layers=[1]"], "peft.type = 'full'"),
    (["method={}", "algorithm=full-ft", "peft.type=full", "peft.dropout=0.1"], "peft.type = 'full'"),
])
def test_bad_use_is_one_line_exit_2(capsys, sets, needle):
    argv = ["validate", "--no-data"] + [a for s in sets for a in ("--set", s)]
    assert needle in _one_error_line(capsys, argv)


def test_full_ft_without_peft_full_is_refused(cfg_factory, tiny_bert_dir, toy_jsonl):
    with pytest.raises(ConfigError, match="set peft.type = 'full'"):  # at validation, before any model
        cfg_factory(tiny_bert_dir, toy_jsonl, algorithm='"full-ft"')


def test_fedper_keeps_the_head_private_over_a_full_backbone(cfg_factory, tiny_bert_dir, toy_jsonl):
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, algorithm='"fedper"', peft__type='"full"',
                      model__task='"encoder_head"')
    exp = build(cfg)
    assert exp.private_names == ["head.bias", "head.weight"]
    assert all(n.startswith("backbone.") for n in exp.global_names)


def test_a_causal_lm_trains_every_weight_once(cfg_factory, tiny_llama_dir, toy_jsonl):
    # tied input/output embeddings are one parameter: one name, sent once
    from transformers import AutoModelForCausalLM

    cfg = cfg_factory(tiny_llama_dir, toy_jsonl, algorithm='"full-ft"', peft__type='"full"',
                      model__task='"causal_lm"', server__rounds=1)
    exp = build(cfg)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert exp.global_names == sorted(f"backbone.{n}" for n, _ in hf.named_parameters())
    final = run_rounds(exp, MemoryStore(), lambda r: None)
    assert final["up_bytes"] == len(wire.encode(exp.init_params)) * cfg.server.clients_per_round
