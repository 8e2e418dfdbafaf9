"""configs/flowertune-*.toml: FlowerTune's four challenges, each config's own pipeline on stand-in
records of its data set's fields (the hub data sets and Mistral's weights are not here): the tiny
Llama in place of the model, a few records in place of the data set, 6 rounds of 2 of 4 clients;
every other setting is the config's own (fp4 base, r32/α64 on q/v, FlowerTune's record mapping,
prompt, lr schedule and checkpoints). What each value must be is written out by hand from
FlowerTune's apps (flwrlabs/flower, examples/flowertune-llm-*), not computed by the code tested."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PREAMBLE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.")
# per challenge: the data set, clients and clients a round (fraction-train of them), a record in
# the data set's own fields, and FlowerTune's training text of it (their reformat + prompt), by hand
CASES = {
    "general": ("hf:flwrlabs/alpaca-gpt4", 20, 2,
                {"instruction": "Give three tips for staying healthy.", "input": "ignored by the general task",
                 "output": "Eat well, sleep, move."},
                f"{PREAMBLE}\n### Instruction:\nGive three tips for staying healthy.\n### Response: Eat well, sleep, "
                f"move."),
    "finance": ("hf:flwrlabs/fingpt-sentiment-train", 50, 5,
                {"instruction": "What is the sentiment of this news? Please choose an answer from "
                                "{negative/neutral/positive}.", "input": "Shares of the bank rose 5%.",
                 "output": "positive"},
                f"{PREAMBLE}\n### Instruction:\nWhat is the sentiment of this news? Please choose an answer from "
                f"{{negative/neutral/positive}}. Shares of the bank rose 5%.\n### Response: positive"),
    "medical": ("hf:flwrlabs/medical-meadow-medical-flashcards", 20, 2,
                {"instruction": "Answer this question truthfully", "input": "What does the liver store?",
                 "output": "Glycogen, among others."},
                f"{PREAMBLE}\n### Instruction:\nWhat does the liver store?\n### Response: Glycogen, among others."),
    "code": ("hf:flwrlabs/code-alpaca-20k", 10, 2,
             {"instruction": "Write a function that adds two numbers.", "input": "",
              "output": "def add(a, b): return a + b"},
             # an empty input leaves the space after the instruction: " " + ""
             f"{PREAMBLE}\n### Instruction:\nWrite a function that adds two numbers. \n### Response: def add(a, b): "
             f"return a + b"),
}
WORDS = "tree sea bird fire road city king song star dog moon rain".split()
ROUNDS, CLIENTS, PER_ROUND = 6, 4, 2


def stand_in(task: str, path: Path) -> Path:
    """24 records in the fields of the task's data set (the hand-written one first)."""
    keys = list(CASES[task][3])
    rows = [CASES[task][3]] + [{k: f"{k} of the {w} {i}" if k != "input" or i % 2 else "" for k in keys}
                               for i, w in enumerate(WORDS * 2)][1:]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(task: str, model: Path, data: Path, **more):
    from fedsplice.federation.validate import load_config

    sets = {"model.name": json.dumps(str(model)), "data.dataset": json.dumps(f"jsonl:{data}"),
            "runtime.device": "cpu", "runtime.threads": 1, "server.rounds": ROUNDS, "data.num_clients": CLIENTS,
            "server.clients_per_round": PER_ROUND, "data.test_per_class": 4, "data.local_test_size": 2,
            "eval.max_new_tokens": 4,
            "eval.stop": "[]",  # the tiny tokenizer has no newline token: "\n###" cannot be a stop string
            **more}
    return load_config(ROOT / "configs" / f"flowertune-{task}.toml", [f"{k}={v}" for k, v in sets.items()])


@pytest.mark.parametrize("task", list(CASES))
def test_the_config_is_the_apps_settings(task):
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    from fedsplice.federation.validate import load_config

    dataset, n, m = CASES[task][:3]
    cfg = load_config(ROOT / "configs" / f"flowertune-{task}.toml")  # offline: the config alone
    assert (cfg.algorithm, cfg.server.optimizer, cfg.data.dataset, cfg.data.partition) == ("lora", "fedavg", dataset,
                                                                                           "iid")
    assert (cfg.data.num_clients, cfg.server.clients_per_round, cfg.server.rounds) == (n, m, 200)
    assert m == max(int(n * (0.2 if task == "code" else 0.1)), 2)  # Flower's FedAvg: fraction-train, at least 2
    assert (cfg.data.record_format, cfg.data.hf_test_split) == (f"flowertune-{task}", "")
    assert (cfg.client.max_steps, cfg.client.batch_size, cfg.model.max_length) == (10, 16, 512)
    assert (cfg.peft.r, cfg.peft.alpha, cfg.peft.dropout) == (32, 64.0, 0.075)
    for model_type in ("mistral", "llama"):  # peft's default targets are the q and v projections
        assert sorted(DEFAULT_TARGETS[model_type]) == ["q_proj", "v_proj"] and cfg.peft.roles == ["q", "v"]
    assert (cfg.model.name, cfg.model.quantization, cfg.runtime.precision) == ("mistralai/Mistral-7B-v0.3", "fp4",
                                                                              "fp32")
    assert (cfg.client.lr, cfg.client.lr_min, cfg.client.cosine_at) == (5e-5, 1e-6, "round_end")
    assert (cfg.runtime.save_adapter_every, cfg.client.max_grad_norm) == (5, 1.0)


@pytest.mark.parametrize("task", list(CASES))
def test_validate_answers_offline(task, capsys):
    from fedsplice.app.cli import main

    assert main(["validate", "--no-data", f"configs/flowertune-{task}.toml"]) == 0
    plan, ok = capsys.readouterr().out.splitlines()  # the tests run offline (HF_HUB_OFFLINE=1): no plan
    assert plan.startswith("plan: skipped (model.name: 'mistralai/Mistral-7B-v0.3' is not in the local Hugging Face")
    assert ok.startswith(f"ok: configs/flowertune-{task}.toml (lora, mistralai/Mistral-7B-v0.3")


@pytest.mark.parametrize("task", list(CASES))
def test_the_prompt_the_loss_mask_and_the_4bit_base(task, tiny_llama_dir, tmp_path):
    """The hand-written record, read through the config's mapping, renders as FlowerTune's text; the
    tokens the loss is on are those FlowerTune's collator labels (everything after the last
    "### Response:"), and the base's linear layers are bitsandbytes' fp4."""
    import bitsandbytes as bnb

    from fedsplice.federation import build
    from fedsplice.model.generate import response_nll

    exp = build(config(task, tiny_llama_dir, stand_in(task, tmp_path / "records.jsonl")))
    tok, want = exp.model.tokenizer, CASES[task][4]
    rec = next(r for r in exp.data.train_texts + exp.data.test_texts if r.response == CASES[task][3]["output"])
    turns = [{"role": "user", "content": rec.messages[-1][1]}, {"role": "assistant", "content": rec.response}]
    assert tok.apply_chat_template(turns, tokenize=False) == tok.bos_token + want
    e = exp.model.encoded(rec)
    full = tok(want)["input_ids"]  # their trainer: the whole text, the tokenizer's special tokens
    assert e.prompt + e.response == full
    marker = tok("### Response:", add_special_tokens=False)["input_ids"]
    at = max(i for i in range(len(full)) if full[i:i + len(marker)] == marker) + len(marker)
    assert e.response == full[at:] and len(e.prompt) == at  # the loss on the response only, no end token
    _, count = response_nll(exp.model._lm, [e], tok.pad_token_id)
    assert int(count) == len(full) - at
    linear4 = [m for m in exp.model.backbone.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 2 * 7 and {m.weight.quant_type for m in linear4} == {"fp4"}
    assert {m.compute_dtype for m in linear4} == {torch.float32}


@pytest.mark.parametrize("task", list(CASES))
def test_rounds_lr_checkpoints_and_the_leaderboard_row(task, tiny_llama_dir, tmp_path, monkeypatch):
    import bitsandbytes  # noqa: F401  the configs' fp4 base; pinned in the test extras: never skipped
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fedsplice import run
    from fedsplice.app.leaderboard import leaderboard_row
    from fedsplice.federation import train

    lrs: list[float] = []
    real = train.make_optimizer
    monkeypatch.setattr(train, "make_optimizer", lambda params, cc: (lrs.append(cc.lr), real(params, cc))[1])
    out = tmp_path / "run"
    run(config(task, tiny_llama_dir, stand_in(task, tmp_path / "records.jsonl")), out)
    # FlowerTune's cosine_annealing(current_round, total_round, 5e-5, 1e-6), constant within the round
    want = [1e-6 + 0.5 * (5e-5 - 1e-6) * (1 + math.cos(math.pi * t / ROUNDS)) for t in range(1, ROUNDS + 1)]
    assert lrs == pytest.approx([lr for lr in want for _ in range(PER_ROUND)], rel=1e-12)
    assert lrs[-1] == pytest.approx(1e-6, rel=1e-12)
    # the global adapter after every 5th round and the last, loadable by peft alone
    assert sorted(p.name for p in out.glob("peft_*")) == ["peft_5", "peft_6"]
    for rnd in (5, 6):
        adapter = json.loads((out / f"peft_{rnd}" / "adapter_config.json").read_text())
        assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"], adapter["task_type"]) == (
            32, 64.0, 0.075, "CAUSAL_LM")
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), out / f"peft_{rnd}")
        sent = load_file(out / "checkpoints" / f"round-{rnd:06d}" / "global.safetensors")  # the server's tensors
        lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        assert len(lora) == len(sent) == 2 * 2 * 2  # layers x (q, v) x (A, B)
        for name, p in lora.items():
            assert torch.equal(p.detach(), sent[f"backbone.{name}"]), name
    # one message: 2 layers x (q A 32x32, q B 32x32, v A 32x32, v B 16x32) fp32, each with
    # np.save's 128-byte header; every round it goes to each of the 2 clients and comes back
    message = 2 * (4 * 128 + 4 * (32 * 32 * 3 + 16 * 32))
    row = leaderboard_row(out)
    assert row["up_mib"] * 2 ** 20 == row["down_mib"] * 2 ** 20 == ROUNDS * PER_ROUND * message == 356352
    assert row["columns"]["Comm. Costs"] == "0.0 GB" and row["columns"]["Base Model"] == tiny_llama_dir.name
    assert "0.68 MiB = 0.34 up + 0.34 down over 6 rounds of 2 clients" in row["notes"][0]
    assert row["columns"]["Average (↑)"] == "—" and list(row["columns"])[:3] == ["Base Model", "Comm. Costs",
                                                                                "Average (↑)"]
