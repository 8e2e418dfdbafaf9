"""FlowerTune's pieces one by one: the communication count (fedsplice.federation.flowertune) from
shapes on the meta device and from a run's ledger; the record mapping (fedsplice.data.flowertune);
the prompt (fedsplice.model.templates); the cosine lr, gradient clipping and fp4 base; the new
settings' refusals. The four configs end to end: tests/test_flowertune_configs.py."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

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


# ----------------------------------------------------------------------------- a run's traffic


def test_a_round_with_a_retry_sends_one_more_message():
    """server.max_retries: a client that dropped at attempt 0 of a 2-attempt round is asked again;
    a rejected one never is, and a drop at the last attempt is not followed by a send."""
    rec = {"round": 3, "clients": [1], "attempts": 2,
           "events": [{"client": 2, "event": "dropped", "attempt": 0}, {"client": 4, "event": "rejected", "attempt": 0},
                      {"client": 2, "event": "late", "attempt": 1}]}
    assert FT.messages_sent(rec, 3) == 4
    assert FT.messages_sent({"round": 1, "clients": [0, 1]}, 2) == 2


def test_run_bytes_by_hand():
    rows = [{"round": r, "client": c, "name": n, "shape": s, "dtype": d}
            for r, c in ((1, 0), (1, 1), (2, 1)) for n, s, d in (("a", [4, 8], "float32"), ("b", [3], "float16"))]
    records = [{"round": 0, "gm": {}}, {"round": 1, "clients": [0, 1]}, {"round": 2, "clients": [1], "dropped": 1,
                                                                           "events": []}]
    up, down = FT.run_bytes(rows, records, clients_per_round=2)
    # np.save: a 128-byte header, then the data; down: the GLOBAL shapes in fp32 to 2 clients a round
    assert up == 3 * ((128 + 4 * 8 * 4) + (128 + 3 * 2))
    assert down == 2 * 2 * ((128 + 4 * 8 * 4) + (128 + 3 * 4))


# ----------------------------------------------------------------------------- records and prompt


@pytest.mark.parametrize("task, row, prompt", [
    ("general", {"instruction": "Name a color.", "input": "not used", "output": "red"}, "Name a color."),
    ("finance", {"instruction": "Sentiment?", "input": " Profit fell. ", "output": "negative"},
     "Sentiment?  Profit fell. "),
    # a CSV's empty cell reads as None: an empty input
    ("code", {"instruction": "Sort a list.", "input": None, "output": "sorted(x)"}, "Sort a list. "),
    ("medical", {"instruction": "Answer this question truthfully", "input": "What is a virus?", "output": "A germ."},
     "What is a virus?"),
])
def test_flowertunes_reformat_keeps_the_text_as_it_is(task, row, prompt):
    from fedsplice.data import flowertune

    rec = flowertune.reader(f"flowertune-{task}")({**row, "split": "test ", "topic": "x"}, "f.jsonl line 1")
    assert rec.messages == (("user", prompt),) and rec.response == row["output"]
    assert rec.fields == {"split": "test", "topic": "x"}


@pytest.mark.parametrize("task, row, match", [
    ("medical", {"instruction": "q", "output": "a"}, "f line 2: `input` is missing; data.record_format = "
                                                      "'flowertune-medical' reads input and output"),
    ("finance", {"instruction": 3, "input": "", "output": "a"}, "`instruction` is a int, not text"),
    ("general", {"instruction": "q", "output": "  "}, "`output` is empty"),
])
def test_a_bad_flowertune_record_is_one_line(task, row, match):
    from fedsplice.data import flowertune
    from fedsplice.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        flowertune.reader(f"flowertune-{task}")(row, "f line 2")
    assert "\n" not in str(e.value)


def test_the_flowertune_prompt_refuses_a_conversation():
    from fedsplice.data import flowertune
    from fedsplice.data.instruct import record
    from fedsplice.errors import ConfigError

    one = record({"prompt": "q", "response": "a"}, "x")
    flowertune.check_single_turn([one])
    with pytest.raises(ConfigError, match="1 of 2 records have a system turn or earlier turns"):
        flowertune.check_single_turn([one, record({"prompt": "q", "response": "a", "system": "Be brief."}, "x")])


def test_the_prompt_follows_the_tokenizers_own_leading_tokens(tiny_llama_dir):
    from transformers import AutoTokenizer

    from fedsplice.model import templates

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)  # prepends <s>, as Llama's and Mistral's do
    assert templates.special_prefix(tok) == "<s>"
    templates.install(tok, "flowertune")
    turns = [{"role": "user", "content": "Q?"}]
    head = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert head == "<s>" + templates.FLOWERTUNE_PREAMBLE + "\n### Instruction:\nQ?\n### Response:"
    assert tok.apply_chat_template(turns + [{"role": "assistant", "content": "A."}], tokenize=False) == head + " A."


# ----------------------------------------------------------------------------- lr, clipping, 4-bit


def test_the_cosine_read_at_the_rounds_end_is_flowertunes_cosine_annealing():
    from fedsplice.config import ClientConfig

    end = ClientConfig(lr=5e-5, lr_min=1e-6, schedule="cosine", cosine_at="round_end")
    # cosine_annealing(current_round, total_round=4, 5e-5, 1e-6): 1e-6 + 0.5 * 4.9e-5 * (1 + cos(pi * t / 4))
    assert [end.lr_at(t, 4) for t in (1, 2, 3, 4)] == pytest.approx(
        [1e-6 + 2.45e-5 * (1 + math.sqrt(0.5)), 2.55e-5, 1e-6 + 2.45e-5 * (1 - math.sqrt(0.5)), 1e-6], rel=1e-12)
    start = ClientConfig(lr=5e-5, lr_min=1e-6, schedule="cosine")  # round 1 at client.lr, toward lr_min
    assert [start.lr_at(t, 4) for t in (1, 3)] == pytest.approx([5e-5, 2.55e-5], rel=1e-12)


@pytest.mark.parametrize("sets, match", [
    (["client.schedule=constant", "client.lr_min=1e-6"],
     "client.lr_min = 1e-06 does nothing while client.schedule = 'constant'"),
    (["client.schedule=constant", "client.cosine_at=round_end"],
     "client.cosine_at = 'round_end' does nothing while client.schedule"),
    (["client.lr_min=1.0"], "client.lr_min must be >= 0 and below client.lr"),
    (["client.max_grad_norm=-1"], "client.max_grad_norm must be a finite number >= 0"),
    (["client.max_grad_norm=1.0", "privacy.local=dpsgd", "privacy.local_noise_multiplier=1.0"],
     "client.max_grad_norm = 1.0 does nothing while privacy.local = 'dpsgd'"),
    (["runtime.save_adapter_every=5", "peft.type=prompt", "algorithm=promptfl", "method={}"],
     "runtime.save_adapter_every = 5 writes the global LoRA as a PEFT folder; peft.type = 'prompt' has none"),
    (["model.prompt_template=flowertune"], "model.prompt_template = 'flowertune' does nothing while model.task = "
                                           "'dual_encoder'"),
    (["data.record_format=flowertune-code"], "data.record_format = 'flowertune-code' does nothing while model.task"),
    (["model.task=generate", "data.partition=iid", "eval.cold_start_epochs=0", "data.dataset=wordnet",
      "model.chat_template=plain", "model.prompt_template=flowertune"],
     "model.prompt_template = 'flowertune' does nothing while model.chat_template = 'plain'"),
    (["model.task=generate", "data.partition=iid", "eval.cold_start_epochs=0", "data.dataset=wordnet",
      "data.record_format=flowertune-medical"], "data.record_format = 'flowertune-medical' does nothing while "
                                                "data.dataset = 'wordnet'"),
])
def test_the_new_settings_refuse_bad_or_inert_values(sets, match):
    from fedsplice.errors import ConfigError
    from fedsplice.federation.validate import load_config

    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, sets)
    assert "\n" not in str(e.value)


def test_max_grad_norm_clips_the_step_by_hand():
    from fedsplice.config import ClientConfig
    from fedsplice.federation.train import make_optimizer, optimizer_step

    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = make_optimizer([a, b], ClientConfig(optimizer="sgd", lr=1.0))
    a.grad, b.grad = torch.tensor([6.0]), torch.tensor([8.0])  # the norm of both together: 10
    optimizer_step(opt, None, max_grad_norm=1.0)
    assert float(a) == pytest.approx(-0.6, abs=1e-6) and float(b) == pytest.approx(-0.8, abs=1e-6)


def test_fp4_is_bitsandbytes_default_4bit_type():
    import bitsandbytes  # noqa: F401  pinned in the test extras: a broken install fails here, never skips

    from fedsplice.federation.validate import load_config
    from fedsplice.model.loading import quantization_config
    q = quantization_config(load_config(None, ["model.quantization=fp4", "runtime.precision=fp32"]))
    assert (q.load_in_4bit, q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant) == (True, "fp4", False)
    assert q.bnb_4bit_compute_dtype == torch.float32
    nf4 = quantization_config(load_config(None, ["model.quantization=nf4", "runtime.precision=fp32"]))
    assert (nf4.bnb_4bit_quant_type, nf4.bnb_4bit_use_double_quant) == ("nf4", True)


# ----------------------------------------------------------------------------- the leaderboard row


@pytest.fixture
def finished_run(tmp_path):
    """A run folder as `fedsplice run` leaves it, written by hand: a medical config, 2 rounds of 2
    clients, each upload one 4x8 fp32 tensor, GM scored on multiple-choice records."""
    import json
    from pathlib import Path

    from fedsplice.app.rundir import write_config
    from fedsplice.federation.validate import load_config

    def make(task="medical", gm=None):
        run = tmp_path / task
        (run / "ledger").mkdir(parents=True)
        write_config(run, load_config(Path(__file__).parents[1] / "configs" / f"flowertune-{task}.toml",
                                      ["server.rounds=2", "server.clients_per_round=2"]))
        gm = gm or {"choice_parsed": 0.59, "test_size": 100, "response_loss": 1.25, "rouge_l": 0.5}
        (run / "results.json").write_text(json.dumps({"gm": gm, "rounds": 2}))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
            {"round": 0}, {"round": 1, "clients": [3, 7]}, {"round": 2, "clients": [1, 7]})))
        (run / "ledger" / "server.jsonl").write_text("".join(
            json.dumps({"round": r, "client": c, "name": "w", "shape": [4, 8], "dtype": "float32"}) + "\n"
            for r, c in ((1, 3), (1, 7), (2, 1), (2, 7))))
        return run
    return make


def test_the_row_fills_a_benchmark_only_when_declared(finished_run, capsys):
    from fedsplice.app.cli import main
    from fedsplice.app.leaderboard import leaderboard_row

    run = finished_run()
    row = leaderboard_row(run, "PubMedQA")
    cols = row["columns"]
    assert list(cols) == ["Base Model", "Comm. Costs", "Average (↑)", "PubMedQA", "MedMCQA", "MedQA", "CareQA", "Date"]
    assert (cols["Base Model"], cols["PubMedQA"], cols["MedQA"], cols["Average (↑)"]) == ("Mistral-7B-v0.3", "59.00",
                                                                                          "—", "—")
    assert row["up_mib"] * 2 ** 20 == row["down_mib"] * 2 ** 20 == 4 * (128 + 4 * 8 * 4)  # 4 messages each way
    assert "MedMCQA, MedQA, CareQA on their own data sets" in row["notes"][1] and "PubMedQA" in row["notes"][2]
    assert "GM response loss 1.250, ROUGE-L 0.500" in row["notes"][1]
    assert main(["leaderboard", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("FlowerTune LLM leaderboard, Medical:") and "| Mistral-7B-v0.3 | 0.0 GB | — |" in out


@pytest.mark.parametrize("task, bench, gm, match", [
    ("medical", "MMLU", None, "the Medical leaderboard's benchmarks are PubMedQA, MedMCQA, MedQA, CareQA"),
    ("code", "HumanEval", None, "pass@1 runs the generated programs against the benchmark's tests"),
    ("medical", "MedQA", {"choice_parsed": None, "test_size": 4}, "no multiple-choice records"),
])
def test_a_benchmark_the_run_cannot_fill_is_refused(finished_run, task, bench, gm, match):
    from fedsplice.app.leaderboard import leaderboard_row
    from fedsplice.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        leaderboard_row(finished_run(task, gm), bench)
