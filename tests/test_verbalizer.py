"""verbalizer_logits on a tiny random Llama: exactness against a naive reference, batching, grads."""

from __future__ import annotations

import pytest
import torch

from fedsplice.data.zoo import tiny_llama
from fedsplice.model.verbalizer import cut_prompt, tokenize_answers, verbalizer_logits

PROMPTS = [
    "the dog ran to the river and saw a big fish",
    "hi",
    "a much longer prompt about sports and politics and science in the old city near the sea",
]
# one, one, two, five (letter fallback) and three tokens with the tiny tokenizer
ANSWERS = ["sports", "art", "startrek topic", "xyzzy", "songs and poems"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    return model, tok


def naive(model, tok, prompts, answers, max_length=0):
    """Score each full (prompt + answer) sequence alone: no padding, no cache."""
    a_ids = tokenize_answers(tok, answers)
    out = torch.zeros(len(prompts), len(answers))
    with torch.no_grad():
        for b, p in enumerate(prompts):
            p_ids = cut_prompt(tok(p)["input_ids"], max_length, tok.bos_token_id)
            for c, a in enumerate(a_ids):
                lp = model(torch.tensor([p_ids + a])).logits[0].float().log_softmax(-1)
                out[b, c] = sum(lp[len(p_ids) - 1 + t, a[t]] for t in range(len(a)))
    return out


def test_answers_have_different_lengths_and_no_specials(lm):
    _, tok = lm
    ids = tokenize_answers(tok, ANSWERS)
    assert sorted({len(a) for a in ids}) == [1, 2, 3, 5]
    specials = set(tok.all_special_ids)
    assert not any(i in specials for a in ids for i in a)
    assert tokenize_answers(tok, ANSWERS) is ids  # cached
    with pytest.raises(ValueError):
        tokenize_answers(tok, ["sports", "  "])


def test_prompts_get_special_tokens_and_differ_in_length(lm):
    _, tok = lm
    lens = {len(tok(p)["input_ids"]) for p in PROMPTS}
    assert len(lens) == len(PROMPTS)
    assert all(tok(p)["input_ids"][0] == tok.bos_token_id for p in PROMPTS)


@pytest.mark.parametrize("method", ["cache", "full"])
def test_matches_naive_reference(lm, method):
    model, tok = lm
    ref = naive(model, tok, PROMPTS, ANSWERS)
    with torch.no_grad():
        got = verbalizer_logits(model, tok, PROMPTS, ANSWERS, method=method)
    assert got.shape == (len(PROMPTS), len(ANSWERS))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # the reference is not trivially flat: scores spread over several nats
    assert (ref.max(1).values - ref.min(1).values).min() > 1.0


def test_tolerance_has_power(lm):
    """A gap of a few positions between prompt and answer (what padding leaking into the answer's
    position ids would cause) moves the logits far beyond the 1e-4 tolerance."""
    model, tok = lm
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    pos = torch.arange(ids.shape[1])[None]
    gap = pos.clone()
    gap[:, -2:] += 3
    with torch.no_grad():
        a = model(ids, position_ids=pos).logits[0, -1]
        b = model(ids, position_ids=gap).logits[0, -1]
    assert (a - b).abs().max() > 1e-2


def test_batch_equals_per_sample(lm):
    model, tok = lm
    with torch.no_grad():
        batch = verbalizer_logits(model, tok, PROMPTS, ANSWERS)
        single = torch.cat([verbalizer_logits(model, tok, [p], ANSWERS) for p in PROMPTS])
        one_answer = torch.cat([verbalizer_logits(model, tok, PROMPTS, [a]) for a in ANSWERS], 1)
    torch.testing.assert_close(batch, single, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch, one_answer, atol=1e-5, rtol=0)


def test_only_single_token_answers(lm):
    model, tok = lm
    answers = ["sports", "art", "law"]
    with torch.no_grad():
        got = verbalizer_logits(model, tok, PROMPTS, answers)
    torch.testing.assert_close(got, naive(model, tok, PROMPTS, answers), atol=1e-4, rtol=0)


def test_gradients_flow(lm):
    model, tok = lm
    model.zero_grad(set_to_none=True)
    logits = verbalizer_logits(model, tok, PROMPTS, ANSWERS)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2, 4]))
    loss.backward()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.embed_tokens.weight"):
        g = dict(model.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)


def test_gradients_flow_through_lora(lm):
    import copy

    import peft  # a required dependency: its absence is a failure, not a skip

    model, tok = lm
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    logits = verbalizer_logits(lora, tok, PROMPTS, ANSWERS)
    with torch.no_grad():
        torch.testing.assert_close(logits, verbalizer_logits(model, tok, PROMPTS, ANSWERS),
                                   atol=1e-5, rtol=0)  # LoRA B starts at zero
    torch.nn.functional.cross_entropy(logits, torch.tensor([1, 2, 3])).backward()
    grads = {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)


def test_falls_back_without_cache_under_gradient_checkpointing(lm, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = lm
    ckpt = AutoModelForCausalLM.from_pretrained(tiny_llama(tmp_path / "m"))
    enable = getattr(ckpt, "activation_checkpointing_enable", None) or ckpt.gradient_checkpointing_enable
    enable()
    ckpt.train()
    got = verbalizer_logits(ckpt, tok, PROMPTS, ANSWERS)
    got.sum().backward()
    torch.testing.assert_close(got.detach(), naive(model, tok, PROMPTS, ANSWERS), atol=1e-4, rtol=0)


def test_bad_inputs(lm):
    model, tok = lm
    with pytest.raises(ValueError):
        verbalizer_logits(model, tok, [], ANSWERS)
    with pytest.raises(ValueError):
        verbalizer_logits(model, tok, PROMPTS, [])
    with pytest.raises(ValueError):
        verbalizer_logits(model, tok, PROMPTS, ANSWERS, method="nope")


def test_cut_prompt_by_hand():
    assert cut_prompt([1, 10, 11, 12, 13, 14], 4, bos=1) == [1, 12, 13, 14]  # BOS kept, the end kept
    assert cut_prompt([10, 11, 12, 13, 14], 3, bos=1) == [12, 13, 14]  # no BOS to keep
    assert cut_prompt([1, 10, 11], 3, bos=1) == [1, 10, 11] and cut_prompt([1, 10, 11], 0, bos=1) == [1, 10, 11]


@pytest.mark.parametrize("method", ["cache", "full"])
def test_prompts_are_cut_to_max_length_keeping_their_end(lm, method):
    model, tok = lm
    long = tok(PROMPTS[2])["input_ids"]
    assert (len(long) > 8
            and tok(PROMPTS[1])["input_ids"] == cut_prompt(tok(PROMPTS[1])["input_ids"], 8, tok.bos_token_id))
    with torch.no_grad():
        got = verbalizer_logits(model, tok, PROMPTS, ANSWERS, method=method, max_length=8)
        uncut = verbalizer_logits(model, tok, PROMPTS, ANSWERS, method=method)
    torch.testing.assert_close(got, naive(model, tok, PROMPTS, ANSWERS, max_length=8), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], uncut[1], atol=1e-5, rtol=1e-5)  # a short prompt is not cut
    assert (got[2] - uncut[2]).abs().max() > 1e-3  # the long one is


def test_the_full_path_computes_only_the_answers_logits(lm):
    """method "full" (and gradient checkpointing with multi-token answers) runs B·C sequences of
    prompt + answer: the vocabulary's logits are taken at the A + 1 last positions only (A the
    longest answer), not at every prompt position, with the same scores."""
    model, tok = lm
    shapes = []
    hook = model.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.logits.shape)))
    try:
        got = verbalizer_logits(model, tok, PROMPTS, ANSWERS, method="full")
    finally:
        hook.remove()
    a_max = max(len(a) for a in tokenize_answers(tok, ANSWERS))
    assert a_max == 5 and shapes == [(len(PROMPTS) * len(ANSWERS), a_max + 1, model.config.vocab_size)]
    assert torch.allclose(got, naive(model, tok, PROMPTS, ANSWERS), atol=1e-4)
