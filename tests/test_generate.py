"""Instruction records through a causal LM (fedsplice.model.generate), against the tiny Llama."""

from __future__ import annotations

import pytest
import torch

from fedsplice.data.instruct import record
from fedsplice.errors import ConfigError
from fedsplice.model import generate as G

CHAT = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
        "{% if add_generation_prompt %}<s> assistant : {% endif %}")


@pytest.fixture(scope="module")
def lm_tok(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return lm, tok


REC = record({"prompt": "Define tree.", "response": "a woody plant"}, "t")
MC = record({"prompt": "Which is red?", "options": ["sun", "fire", "sea"], "answer": "B"}, "t")


def test_plain_template_prompt_and_answer_ids(lm_tok):
    _, tok = lm_tok
    e = G.encode(tok, REC, "auto")  # the tiny tokenizer has no chat template: the plain one
    assert e.prompt == tok("### Instruction:\nDefine tree.\n\n### Response:\n")["input_ids"]
    assert e.prompt[0] == tok.bos_token_id
    assert e.response == tok("a woody plant", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(e) == len(e.prompt) + len(e.response)


def test_plain_template_lists_options_and_renders_context_turns():
    rec = record({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                               {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                               {"role": "assistant", "content": "a2"}]}, "t")
    turns = [{"role": r, "content": c} for r, c in rec.messages]
    assert G.plain_prompt(turns) == ("S\n\n### Instruction:\nq1\n\n### Response:\na1\n\n"
                                     "### Instruction:\nq2\n\n### Response:\n")
    assert G.user_text(MC, "Which is red?") == "Which is red?\n\nA. sun\nB. fire\nC. sea"


def test_chat_template_answer_is_what_the_answer_adds(lm_tok):
    _, tok = lm_tok
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.chat_template = CHAT
    e = G.encode(tok, REC, "auto")
    head = "<s> user : Define tree. </s><s> assistant : "
    assert e.prompt == tok(head, add_special_tokens=False)["input_ids"]
    assert e.response == tok("a woody plant </s>", add_special_tokens=False)["input_ids"]
    assert e.response[-1] == tok.eos_token_id
    assert G.encode(tok, REC, "plain").prompt[0] == tok.bos_token_id  # the plain template on request
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}A:{% endif %}")
    with pytest.raises(ConfigError, match="renders the conversation differently"):
        G.encode(tok, REC, "chat")


def test_template_choice_errors(lm_tok):
    _, tok = lm_tok
    with pytest.raises(ConfigError, match="has no chat template"):
        G.encode(tok, REC, "chat")
    with pytest.raises(ConfigError, match="model.chat_template = 'jinja'"):
        G.encode(tok, REC, "jinja")


def _alone(lm, e: G.Encoded) -> tuple[float, int]:
    """Σ -log p of e's response tokens, the sequence alone (no padding), by hand."""
    seq = torch.tensor([e.prompt + e.response])
    with torch.no_grad():
        logp = torch.log_softmax(lm(input_ids=seq).logits[0].double(), -1)
    p = len(e.prompt)
    return -sum(float(logp[p - 1 + j, t]) for j, t in enumerate(e.response)), len(e.response)


def test_response_nll_is_the_response_tokens_loss_whatever_the_padding(lm_tok):
    lm, tok = lm_tok
    recs = [REC, MC, record({"instruction": "Say hi to the world and the sea.", "output": "hi"}, "t")]
    batch = [G.encode(tok, r) for r in recs]
    with torch.no_grad():
        nll, count = G.response_nll(lm, batch, tok.pad_token_id)
    for i, e in enumerate(batch):
        want, n = _alone(lm, e)
        assert int(count[i]) == n
        assert float(nll[i]) == pytest.approx(want, rel=1e-4)
    # differentiable: the training loss is the mean over the batch's response tokens
    lm.zero_grad()
    nll, count = G.response_nll(lm, batch, tok.pad_token_id)
    (nll.sum() / count.sum()).backward()
    assert lm.model.embed_tokens.weight.grad.abs().sum() > 0


def _greedy_alone(lm, ids: list[int], n: int, eos: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):  # no cache, no padding: the reference
            nxt = int(lm(input_ids=torch.tensor([out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
    return out[len(ids):]


def test_greedy_batched_with_cache_equals_one_prompt_at_a_time(lm_tok):
    lm, tok = lm_tok
    recs = [REC, MC, record({"prompt": "What is the sun in the sky at night and day?", "response": "x"}, "t")]
    prompts = [G.prompt_ids(tok, r) for r in recs]
    got = G.greedy(lm, tok, prompts, max_new_tokens=5, batch_size=2, pad_id=tok.pad_token_id)
    for p, text in zip(prompts, got):
        want = tok.decode(_greedy_alone(lm, p, 5, tok.eos_token_id), skip_special_tokens=True).strip()
        assert text == want
    words = got[0].split()
    assert len(words) > 1  # the random model does not end at once (it says "3 shape cry 3 shape")
    cut = G.greedy(lm, tok, prompts[:1], max_new_tokens=5, stop=[words[1]], pad_id=tok.pad_token_id)
    assert cut == [got[0].split(words[1])[0].strip()]  # a stop string ends the answer before it


def test_option_logliks_score_each_lettered_option_after_the_prompt(lm_tok):
    lm, tok = lm_tok
    got = G.option_logliks(lm, tok, MC, pad_id=tok.pad_token_id)
    p = G.prompt_ids(tok, MC)
    for i, text in enumerate(["A. sun", "B. fire", "C. sea"]):
        e = G.Encoded(p, tok(text, add_special_tokens=False)["input_ids"])  # no end token
        assert float(got[i]) == pytest.approx(-_alone(lm, e)[0], rel=1e-4)
