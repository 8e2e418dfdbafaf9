"""The offline zoo: tiny seeded models (fast) and the real packaged weights (slow)."""

from __future__ import annotations

import time

import pytest
import torch

from fedsplice.data import zoo
from fedsplice.errors import ConfigError

# ----------------------------------------------------------------------------- tokenizer


def test_tiny_tokenizer_covers_any_english_text(tmp_path):
    tok = zoo.tiny_tokenizer(tmp_path / "tok")
    text = "The Quick brown fox jumps over the lazy dog; zxqv café 42!"
    ids = tok(text)["input_ids"]
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[0] == "[CLS]" and toks[-1] == "[SEP]"
    assert tok.unk_token_id not in ids  # unknown words fall back to letters
    assert "the" in toks and "zxqv" not in toks
    assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == \
        "thequickbrownfoxjumpsoverthelazydog;zxqvcafe42!"
    assert tok("日本")["input_ids"][1] == tok.unk_token_id
    assert (tmp_path / "tok" / "tokenizer.json").exists()


def test_tiny_tokenizer_llama_style_pads():
    tok = zoo.tiny_tokenizer(style="llama")
    assert tok.pad_token_id is not None and tok.bos_token_id is not None
    assert tok.eos_token_id is not None
    enc = tok(["hello there", "a"], padding=True)
    assert enc["input_ids"][0][0] == tok.bos_token_id
    assert len(enc["input_ids"][0]) == len(enc["input_ids"][1])
    assert tok(" sports", add_special_tokens=False)["input_ids"] == \
        tok("sports", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError):
        zoo.tiny_tokenizer(style="t5")


# ----------------------------------------------------------------------------- tiny models


def _outputs(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def test_tiny_bert_deterministic_and_reloads(tmp_path):
    from transformers import AutoModel, AutoTokenizer, BertModel

    rng = torch.get_rng_state()
    a = zoo.tiny_bert(tmp_path / "a")
    assert torch.equal(torch.get_rng_state(), rng), "global RNG disturbed"
    b = zoo.tiny_bert(tmp_path / "b")
    assert (a / "config.json").exists() and (a / "model.safetensors").exists()
    ma, mb = AutoModel.from_pretrained(a).eval(), AutoModel.from_pretrained(b).eval()
    assert isinstance(ma, BertModel)
    cfg = ma.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.intermediate_size) == (32, 2, 4, 64)
    tok = AutoTokenizer.from_pretrained(a)
    assert cfg.vocab_size == len(tok)
    ids = torch.tensor([tok("a sentence about sports")["input_ids"]])
    assert torch.equal(_outputs(ma, ids), _outputs(mb, ids))
    assert _outputs(ma, ids).shape == (1, ids.shape[1], 32)
    # reload == the in-memory model that was saved
    ma.save_pretrained(tmp_path / "c")
    assert torch.equal(_outputs(AutoModel.from_pretrained(tmp_path / "c").eval(), ids),
                       _outputs(ma, ids))
    # a different seed gives different weights
    mc = AutoModel.from_pretrained(zoo.tiny_bert(tmp_path / "d", seed=7)).eval()
    assert not torch.equal(_outputs(mc, ids), _outputs(ma, ids))


def test_tiny_llama_gqa_deterministic_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    rng = torch.get_rng_state()
    a = zoo.tiny_llama(tmp_path / "a")
    assert torch.equal(torch.get_rng_state(), rng), "global RNG disturbed"
    b = zoo.tiny_llama(tmp_path / "b")
    ma = AutoModelForCausalLM.from_pretrained(a).eval()
    mb = AutoModelForCausalLM.from_pretrained(b).eval()
    assert isinstance(ma, LlamaForCausalLM)
    attn = ma.model.layers[0].self_attn
    assert (attn.q_proj.out_features, attn.k_proj.out_features,
            attn.v_proj.out_features, attn.o_proj.out_features) == (32, 16, 16, 32)
    assert len(ma.model.layers) == 2 and ma.config.intermediate_size == 64
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.pad_token_id is not None
    ids = torch.tensor([tok("the dog ran to the river")["input_ids"]])
    assert torch.equal(_outputs(ma, ids), _outputs(mb, ids))
    assert _outputs(ma, ids).shape == (1, ids.shape[1], len(tok))
    ma.save_pretrained(tmp_path / "c")
    assert torch.equal(
        _outputs(AutoModelForCausalLM.from_pretrained(tmp_path / "c").eval(), ids),
        _outputs(ma, ids))
    gen = ma.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape == (1, ids.shape[1] + 3)


# ----------------------------------------------------------------------------- resolve / list


def test_resolve_model_paths_and_hub_ids(tmp_path):
    assert zoo.resolve_model(str(tmp_path)) == str(tmp_path)
    assert zoo.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_resolve_model_unknown_zoo_name():
    with pytest.raises(ConfigError) as e:
        zoo.resolve_model("zoo:clip")
    assert str(e.value) == ("model.name: unknown zoo model 'clip'; "
                            "choose one of zoo:minilm, zoo:smollm2, zoo:tiny-clip, zoo:tiny-vit")
    with pytest.raises(ConfigError):
        zoo.resolve_model("")


def test_describe_models_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSPLICE_CACHE", str(tmp_path / "empty-cache"))
    rows = zoo.describe_models()
    assert [r["name"] for r in rows] == list(zoo.ZOO) == ["minilm", "smollm2", "tiny-clip", "tiny-vit"]
    for r in rows:
        assert r["fetched"] is False
        assert r["spec"] == f"zoo:{r['name']}"
        assert r["description"] and r["params"] and r["source"]


# ----------------------------------------------------------------------------- real weights


@pytest.mark.real_weights
def test_minilm_loads_and_embeds():
    from transformers import AutoModel, AutoTokenizer

    path = zoo.minilm_path()
    assert zoo.resolve_model("zoo:minilm") == str(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    enc = tok(["A cat sits on the mat.", "Stocks fell sharply today."], padding=True,
              return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    emb = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    assert emb.shape == (2, 384)
    assert torch.isfinite(emb).all()
    assert 0.0 < float(emb[0] @ emb[1]) < 0.5  # unrelated sentences: low cosine
    assert any(r["fetched"] for r in zoo.describe_models() if r["name"] == "minilm")


@pytest.mark.real_weights
def test_smollm2_converted_checkpoint(record_property):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedsplice.model.verbalizer import verbalizer_logits

    t0 = time.perf_counter()
    path = zoo.smollm2_path()  # converts once (~30-45 s), then instant
    record_property("smollm2_path_s", round(time.perf_counter() - t0, 2))
    assert zoo.resolve_model("zoo:smollm2") == str(path)
    cfg_text = (path / "config.json").read_text()
    assert "quantization_config" not in cfg_text
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    record_property("converted_load_s", round(time.perf_counter() - t0, 2))
    attn = model.model.layers[0].self_attn
    assert len(model.model.layers) == 30 and model.config.hidden_size == 576
    assert (attn.q_proj.out_features, attn.k_proj.out_features) == (576, 192)

    x = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=4, do_sample=False)
        converted = model(**x).logits
    assert "Paris" in tok.decode(out[0, x["input_ids"].shape[1]:])

    gguf = zoo.smollm2_gguf_path()
    t0 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    record_property("gguf_load_s", round(time.perf_counter() - t0, 2))
    with torch.no_grad():
        diff = (ref(**x).logits - converted).abs().max().item()
    record_property("gguf_vs_converted_max_abs_logit_diff", diff)
    assert diff < 1e-3

    topics = ["sports", "politics", "food", "computers"]
    prompts = ["Quote: The team won the match in the last minute.\nTopic:",
               "Quote: The senator promised lower taxes.\nTopic:"]
    with torch.no_grad():
        logits = verbalizer_logits(model, tok, prompts, topics)
    assert logits.shape == (2, 4) and torch.isfinite(logits).all()
    assert logits.argmax(1).tolist() == [0, 1]
