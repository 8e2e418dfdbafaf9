"""End-to-end multimodal runs through the CLI: a user's image+text JSONL on tiny random models
(fast), and the shipped easy-VQA / Fashion-MNIST configs on the offline zoo (slow, in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_RUN, ZOO_SMALL, set_args
from PIL import Image

from fedsplice.app.cli import main
from fedsplice.core import wire
from fedsplice.data import zoo

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ["circle", "square", "triangle"]


@pytest.fixture(scope="module")
def vqa_jsonl(tmp_path_factory) -> Path:
    """A toy closed-set VQA file: 3 answers x 16 coloured images with a question each."""
    d = tmp_path_factory.mktemp("vqa")
    g = np.random.default_rng(3)
    with open(d / "data.jsonl", "w") as f:
        for c, name in enumerate(SHAPES):
            for i in range(16):
                img = np.full((12, 12, 3), 40 * c, np.uint8) + g.integers(0, 40, (12, 12, 3), dtype=np.uint8)
                Image.fromarray(img).save(d / f"{name}{i}.png")
                f.write(json.dumps({"image": f"{name}{i}.png", "text": f"what shape is it {i}", "label": name}) + "\n")
    return d / "data.jsonl"


def run(args: list[str], out: Path) -> dict:
    assert main(["run", *args, "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "results.json").read_text())


def records(out: Path) -> list[dict]:
    return [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]


def check_gm(r: dict, out: Path, test_size: int) -> None:
    """results.json's GM is the last metrics.jsonl record's, and its accuracy is a count of
    correct answers on the balanced global test set: mean of the per-class accuracies, k/n."""
    assert r["gm"] == records(out)[-1]["gm"] and r["zero_shot_gm"] == records(out)[0]["gm"]
    for gm in (r["gm"], r["zero_shot_gm"]):
        per_class = gm["class_accuracy"]
        assert len(per_class) == r["num_classes"] and None not in per_class
        assert gm["accuracy"] == pytest.approx(sum(per_class) / len(per_class), abs=1e-12)
        correct = gm["accuracy"] * test_size
        assert correct == pytest.approx(round(correct), abs=1e-9), (correct, test_size)


TINY = set_args(TINY_RUN, server__rounds=1, data__test_per_class=4)


def test_vlm_pfadapter_sends_only_q_k_lora_and_the_projector(tmp_path, vqa_jsonl, monkeypatch):
    llama = zoo.tiny_llama(tmp_path / "llama")
    vit = zoo.tiny_vit(tmp_path / "vit")
    sent = []
    encode = wire.encode
    monkeypatch.setattr(wire, "encode", lambda t, *a, **k: sent.append(sorted(t)) or encode(t, *a, **k))
    common = set_args({"model.name": f"'{llama}'", "model.task": "'vlm'", "model.vision": f"'{vit}'",
                       "model.projector": "'linear'", "model.input_template": "'question: {text} answer:'",
                       "data.dataset": f"'jsonl:{vqa_jsonl}'"}) + TINY
    pf = run(["configs/pfadapter-easyvqa.toml", *common], tmp_path / "pf")
    names = {n for payload in sent for n in payload}
    assert names and all(".q_proj." in n or ".k_proj." in n or n.startswith("projector.") for n in names)
    assert any(n.startswith("projector.") for n in names)
    fa = run(["configs/fedavg-lora-easyvqa.toml", *common], tmp_path / "fa")
    # tiny Llama: q,o 32 wide, k,v 16 (GQA); r = 8 -> q,k LoRA 8·(32+32) + 8·(32+16) per layer
    lora_qk, lora_vo, proj = 2 * (8 * 64 + 8 * 48), 2 * (8 * 48 + 8 * 64), 32 * 32 + 32
    assert pf["params"] == {"global": lora_qk + proj, "private": lora_vo}
    assert fa["params"] == {"global": lora_qk + lora_vo + proj, "private": 0}
    ratio = pf["communication"]["up_bytes"] / fa["communication"]["up_bytes"]
    assert ratio == pytest.approx((lora_qk + proj) / (lora_qk + lora_vo + proj), abs=0.02)
    assert pf["random_weights"] == [] and pf["vision"] == str(vit)
    for r, out in ((pf, tmp_path / "pf"), (fa, tmp_path / "fa")):
        check_gm(r, out, test_size=3 * 4)


def test_clip_fedpurel_on_user_images_with_a_missing_modality_scenario(tmp_path, vqa_jsonl):
    from fedsplice.federation.experiment import build
    from fedsplice.federation.validate import load_config

    clip = zoo.tiny_clip(tmp_path / "clip")
    out = tmp_path / "fp"
    r = run(["configs/fedpurel-lora-fmnist.toml", *set_args({
        "model.name": f"'{clip}'", "data.dataset": f"'jsonl:{vqa_jsonl}'", "data.imbalance": "1.0",
        "data.n_max": "0", "method.personal_rounds": "1", "scenario.missing_rate": "0.5",
        "scenario.missing": "'either'"}), *TINY], out)
    check_gm(r, out, test_size=3 * 4)
    recs = records(out)
    # the zero-shot model against itself: TKL 0; and the zero-shot accuracy is what the cached
    # zero-shot logits of a fresh build of the same config score on the global test set
    assert r["zero_shot_gm"]["tkl"] == 0.0 and "tkl" in r["gm"]
    exp = build(load_config(out / "config.toml"))
    n = exp.data.global_test_size
    zs = exp.caches["zero_shot_test"][:n].argmax(1).numpy()
    assert r["zero_shot_gm"]["accuracy"] == pytest.approx(float((zs == exp.data.test_labels[:n]).mean()), abs=1e-12)
    # purified_fraction: the mean over rounds of the share of local steps that were purified
    steps = [x["purified_steps"] for x in recs if "purified_steps" in x]
    assert len(steps) == 1 and r["purified_fraction"] == pytest.approx(sum(steps) / len(steps), abs=1e-12)
    assert recs[-1]["phase"] == "personalization" and r["pm"] == recs[-1]["pm"]
    sc = json.loads((out / "scenario.json").read_text())
    assert sc["totals"]["missing_clients"] == 2  # round(0.5 x 4)


@pytest.mark.real_weights
@pytest.mark.parametrize("config", ["pfadapter-easyvqa.toml", "fedavg-lora-easyvqa.toml"])
def test_easyvqa_configs_run_on_smollm2_and_are_labelled_random(tmp_path, config, capsys):
    small = set_args(ZOO_SMALL, data__test_per_class=3, data__local_test_size=6, client__batch_size=8)
    assert main(["run", str(ROOT / "configs" / config), "--out", str(tmp_path / "r"), *small]) == 0
    r = json.loads((tmp_path / "r" / "results.json").read_text())
    assert r["random_weights"] == ["model.vision = zoo:tiny-vit"] and r["num_classes"] == 13
    assert "RANDOM WEIGHTS (model.vision = zoo:tiny-vit)" in capsys.readouterr().out
    # 30 SmolLM2 layers; LoRA r=8 on q,k (576/192 wide outputs), a linear 32 -> 576 projector
    qk, vo, proj = 30 * (8 * (576 + 576) + 8 * (576 + 192)), 30 * (8 * (576 + 192) + 8 * (576 + 576)), 32 * 576 + 576
    want = ({"global": qk + proj, "private": vo} if config.startswith("pfadapter")
            else {"global": qk + vo + proj, "private": 0})
    assert r["params"] == want
    check_gm(r, tmp_path / "r", test_size=13 * 3)
    assert r["cold_start"]["epochs"] == [0, 1]


@pytest.mark.real_weights
def test_fedpurel_clip_config_on_fashion_mnist(tmp_path):
    small = set_args(ZOO_SMALL, method__personal_rounds=1, data__n_max=40)
    assert main(["run", str(ROOT / "configs" / "fedpurel-lora-fmnist.toml"), "--out", str(tmp_path / "r"),
                 "--quiet", *small]) == 0
    r = json.loads((tmp_path / "r" / "results.json").read_text())
    assert r["random_weights"] == ["model.name = zoo:tiny-clip"] and r["num_classes"] == 10
    assert r["train_counts"][0] == 40 and min(r["train_counts"]) == 1  # n_max 40, IF 100 -> 40 … 0.4 -> 1
