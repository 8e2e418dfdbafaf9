"""model.task = "generate" with model.vision: instruction records with an image, its projected
tokens before the prompt (after BOS, as LLaVA and the label-set VLM path place them), on the tiny
Llama and the tiny ViT (docs/instruct.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import GEN_BUDGET
from PIL import Image

from fedsplice.core import wire
from fedsplice.errors import ConfigError

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}


@pytest.fixture(scope="module")
def vqa_dir(tmp_path_factory) -> Path:
    """48 open-ended questions on 24 coloured images; the answer names the colour (so only the image
    tells it), 4 of them multiple choice."""
    d = tmp_path_factory.mktemp("gvqa")
    g = np.random.default_rng(5)
    rows = []
    for i in range(24):
        name = list(COLOURS)[i % 3]
        img = np.clip(np.array(COLOURS[name]) + g.integers(-20, 20, (10, 10, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(d / f"im{i}.png")
        rows.append({"image": f"im{i}.png", "prompt": f"What colour is picture {i}?", "response": f"It is {name}."})
        rows.append({"image": f"im{i}.png", "instruction": "Name the colour.", "input": f"case {i}",
                     "output": f"{name}"} if i % 6 else
                    {"image": f"im{i}.png", "prompt": "Which colour?", "options": list(COLOURS), "answer": name})
    (d / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory) -> Path:
    from fedsplice.data import zoo

    return zoo.tiny_vit(tmp_path_factory.mktemp("models") / "vit")


@pytest.fixture
def vlm_cfg(cfg_factory, tiny_llama_dir, vqa_dir, vit_dir):
    def make(**kw):
        sets = {**GEN_BUDGET, "model__vision": f'"{vit_dir}"', "model__projector": '"linear"',
                "data__test_per_class": 8, **kw}
        return cfg_factory(tiny_llama_dir, vqa_dir / "data.jsonl", **sets)
    return make


def _alone(m, rec):
    """(the record's image tokens, then its prompt + response) as one unpadded row of embeddings,
    the image after BOS: what the batched path must equal."""
    e = m.encoded(rec)
    seq = e.prompt + e.response
    emb = m._lm.get_input_embeddings()(torch.tensor(seq))
    img = m._answering.images([rec])[0]
    k = 1 if seq[0] == m.tokenizer.bos_token_id else 0
    return torch.cat([emb[:k], img, emb[k:]]), len(e.prompt) + len(img), e


def test_the_response_loss_with_images_equals_each_record_alone(vlm_cfg):
    from fedsplice.federation import build

    exp = build(vlm_cfg(runtime__precision='"fp32"'))
    m, recs = exp.model, exp.data.test_texts[:6]
    assert all(r.has_image for r in recs) and len({len(m.encoded(r).prompt) for r in recs}) > 1
    m.eval()
    got = m.answers(recs, 6, 3)
    for r, nll, n in zip(recs, got["nll"], got["tokens"]):
        rows, start, e = _alone(m, r)
        with torch.no_grad():
            logits = m._lm(inputs_embeds=rows[None]).logits[0].float()
        lp = torch.log_softmax(logits[start - 1:start - 1 + len(e.response)], -1)
        want = -lp[torch.arange(len(e.response)), torch.tensor(e.response)].sum()
        assert n == len(e.response) and nll == pytest.approx(float(want), rel=1e-5)
    no_image = [type(r)(r.messages, r.response, r.options, r.answer, None, r.fields) for r in recs]
    assert m.answers(no_image, 6, 3)["nll"] != pytest.approx(got["nll"], rel=1e-3)  # the image is read


def test_greedy_with_images_equals_an_argmax_loop_one_record_at_a_time(vlm_cfg):
    from fedsplice.federation import build

    exp = build(vlm_cfg(runtime__precision='"fp32"'))
    m, recs = exp.model, exp.data.test_texts[:5]
    m.eval()
    got = m.answers(recs, 5, 4)["text"]
    for r, text in zip(recs, got):
        rows, start, _ = _alone(m, r)
        rows, out = rows[:start], []
        emb = m._lm.get_input_embeddings()
        with torch.no_grad():
            for _ in range(4):
                nxt = int(m._lm(inputs_embeds=rows[None]).logits[0, -1].argmax())
                if nxt == m.tokenizer.eos_token_id:
                    break
                out.append(nxt)
                rows = torch.cat([rows, emb(torch.tensor([nxt]))])
        assert text == m.tokenizer.decode(out, skip_special_tokens=True).strip()


def test_pfadapter_on_image_records_learns_and_sends_the_projector(vlm_cfg, tmp_path, capture_uploads):
    from fedsplice import run

    res = run(vlm_cfg(), tmp_path / "run")
    zs, gm, pm = res.raw["zero_shot_gm"], res.gm, res.pm
    assert math.isfinite(pm["rouge_l"]) and gm["test_size"] == 8
    assert gm["response_loss"] < 0.9 * zs["response_loss"] and pm["response_loss"] < 0.9 * zs["response_loss"]
    names = {n for _, _, up in capture_uploads for n in wire.decode(up)}
    assert any(n.startswith("projector.") for n in names)
    assert all(".q_proj." in n or ".k_proj." in n or n.startswith("projector.") for n in names)


def test_images_and_the_vision_tower_come_together(vlm_cfg, cfg_factory, tiny_llama_dir, instruct_jsonl, vqa_dir,
                                                  vit_dir, tmp_path):
    from fedsplice.federation import build

    with pytest.raises(ConfigError, match="48 records have an `image`, which needs a vision tower"):
        build(vlm_cfg(model__vision='""'))
    with pytest.raises(ConfigError, match="does nothing: no record has an `image`"):
        build(cfg_factory(tiny_llama_dir, instruct_jsonl, **{**GEN_BUDGET, "model__vision": f'"{vit_dir}"'}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"image": "absent.png", "prompt": "q", "response": "r"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl line 1: image file 'absent.png' not found"):
        build(vlm_cfg(data__dataset=f'"jsonl:{bad}"'))
    (tmp_path / "junk.png").write_bytes(b"not an image")
    bad.write_text(json.dumps({"image": "junk.png", "prompt": "q", "response": "r"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl line 1: image 'junk.png': cannot decode"):
        build(vlm_cfg(data__dataset=f'"jsonl:{bad}"'))


def test_an_hf_data_set_with_an_image_column(vlm_cfg, vqa_dir, tmp_path):
    """An `hf:` data set's Image feature: decoded here and keyed by content, as a file's images are."""
    import datasets

    from fedsplice.federation import build

    rows = [json.loads(x) for x in (vqa_dir / "data.jsonl").read_text().splitlines() if '"prompt"' in x][:20]
    table = {"prompt": [r["prompt"] for r in rows], "response": [r.get("response", "x") for r in rows],
             "image": [Image.open(vqa_dir / r["image"]) for r in rows]}
    folder = tmp_path / "hfvqa"
    datasets.Dataset.from_dict(table).cast_column("image", datasets.Image()).save_to_disk(str(folder))
    exp = build(vlm_cfg(data__dataset=f'"hf:{folder}"', data__test_per_class=4, data__hf_test_split='""'))
    recs = [*exp.data.train_texts, *exp.data.test_texts]
    assert len(recs) == 20 and all(r.has_image and r.image.shape == (10, 10, 3) for r in recs)
    by_prompt = {r.prompt: r for r in recs}
    first = np.asarray(Image.open(vqa_dir / rows[0]["image"]).convert("RGB"))
    assert np.array_equal(by_prompt[rows[0]["prompt"]].image, first)
