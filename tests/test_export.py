"""`fedsplice export` (fedsplice.app.export): a run's adapters as a PEFT folder that
`PeftModel.from_pretrained(base, OUT)` loads to the same outputs as fedsplice's model, the
merged base, the parts PEFT has no format for, and `fedsplice.load_export` reproducing each
client's recorded PM accuracy and the recorded GM; on BERT (dual encoder) and Llama (causal LM)."""

import json

import numpy as np
import pytest
import torch

from fedsplice.app.cli import main
from fedsplice.app.export import load_export
from fedsplice.app.rundir import write_config
from fedsplice.federation.experiment import build

pytestmark = pytest.mark.unit


def run_and_export(cfg, tmp_path, *args):
    write_config(tmp_path, cfg)
    assert main(["run", str(tmp_path / "config.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), *args]) == 0
    last = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    return tmp_path / "out", last


def accuracy(model, texts, labels) -> float:
    return float((model.predict(texts, 16).argmax(1).numpy() == labels).mean())


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_clients_lora_loads_with_peft_and_reproduces_its_pm(family, cfg_factory, tiny_bert_dir, tiny_llama_dir,
                                                              toy_jsonl, tmp_path):
    from peft import PeftModel
    from transformers import AutoModel, AutoModelForCausalLM

    model_dir = tiny_bert_dir if family == "bert" else tiny_llama_dir
    extra = {} if family == "bert" else {"model__task": '"causal_lm"'}
    cfg = cfg_factory(model_dir, toy_jsonl, **extra)
    out, last = run_and_export(cfg, tmp_path, "--client", "1", "--merge")
    meta = json.loads((out / "fedsplice_export.json").read_text())
    assert meta["client"] == 1 and meta["round"] == cfg.server.rounds and meta["lora_tensors"] > 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()

    exp = build(cfg)  # client 1's local test set, and its PM accuracy as the run recorded it
    c, d = exp.clients[1], exp.data
    texts, labels = [d.test_texts[i] for i in c.test_idx], d.test_labels[c.test_idx]
    mine = load_export(out)
    assert accuracy(mine, texts, labels) == pytest.approx(last["pm"]["client_accuracy"][1])

    cls = AutoModel if family == "bert" else AutoModelForCausalLM
    theirs = PeftModel.from_pretrained(cls.from_pretrained(model_dir), str(out)).eval()
    merged = cls.from_pretrained(out / "merged").eval()
    tok = mine.tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = mine.backbone(**tok)
        a, b = theirs(**tok), merged(**tok)
    key = "last_hidden_state" if family == "bert" else "logits"
    assert torch.allclose(ours[key], a[key], atol=1e-5)  # PEFT's own loader: fedsplice's outputs
    assert torch.allclose(a[key], b[key], atol=1e-4)  # merged weights: the same function
    assert not torch.equal(ours[key], cls.from_pretrained(model_dir).eval()(**tok)[key])  # LoRA moved it


def test_the_global_export_reproduces_gm(tiny_cfg, tmp_path):
    out, last = run_and_export(tiny_cfg(), tmp_path, "--global")
    d = build(tiny_cfg()).data
    assert accuracy(load_export(out), d.test_texts, d.test_labels) == pytest.approx(last["gm"]["accuracy"])
    assert json.loads((out / "fedsplice_export.json").read_text())["client"] is None


def test_prompts_go_to_the_parts_file_and_merge_is_refused(tiny_cfg, tmp_path, capsys):
    from safetensors.torch import load_file

    cfg = tiny_cfg(algorithm='"promptfl"', peft__type='"prompt"')
    out, last = run_and_export(cfg, tmp_path, "--client", "0")
    parts = load_file(str(out / "fedsplice_parts.safetensors"))
    assert parts and all(n.startswith("prompt") for n in parts) and not (out / "adapter_config.json").exists()
    exp = build(cfg)
    c, d = exp.clients[0], exp.data
    got = accuracy(load_export(out), [d.test_texts[i] for i in c.test_idx], d.test_labels[c.test_idx])
    assert got == pytest.approx(last["pm"]["client_accuracy"][0])
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "o2"), "--global", "--merge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--merge folds LoRA into the base weights; peft.type = 'prompt'" in err and len(err.splitlines()) == 1


def test_bad_exports_exit_2_with_one_line(tiny_cfg, tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "o"), "--global"]) == 2
    assert "not a run folder" in capsys.readouterr().err
    out, _ = run_and_export(tiny_cfg(), tmp_path, "--global")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "o"), "--client", "99"]) == 2
    assert "--client 99: the run's training clients are 0..2" in capsys.readouterr().err
    assert np.isfinite(json.loads((out / "fedsplice_export.json").read_text())["round"])


def image_folder(root, per_class=12):
    from PIL import Image

    g = np.random.default_rng(0)
    for k, name in enumerate(["red", "green", "blue"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            px = g.integers(0, 80, (16, 16, 3), dtype=np.uint8)
            px[..., k] += 150  # each class its own dominant channel
            Image.fromarray(px).save(root / name / f"{i}.png")
    return root


def test_clip_vision_lora_loads_with_peft_and_merges(cfg_factory, tmp_path):
    from peft import PeftModel
    from transformers import CLIPModel

    from fedsplice.data import zoo
    from fedsplice.model.vision import pixel_values

    clip = zoo.tiny_clip(tmp_path / "clip")
    cfg = cfg_factory(clip, "unused", data__dataset=f'"images:{image_folder(tmp_path / "imgs")}"',
                      peft__tower='"vision_model"', data__class_prompt='"a photo of {label}."')
    out, last = run_and_export(cfg, tmp_path, "--client", "0", "--merge")
    exp = build(cfg)
    c, d = exp.clients[0], exp.data
    mine = load_export(out)
    items = [d.test_texts[i] for i in c.test_idx]
    assert accuracy(mine, items, d.test_labels[c.test_idx]) == pytest.approx(last["pm"]["client_accuracy"][0])
    theirs = PeftModel.from_pretrained(CLIPModel.from_pretrained(clip), str(out)).eval()
    merged = CLIPModel.from_pretrained(out / "merged").eval()
    pv = pixel_values(mine.image_processor, items, merged.vision_model)
    with torch.no_grad():
        ours = mine.backbone.get_image_features(pixel_values=pv)
        a, b = theirs.get_image_features(pixel_values=pv), merged.get_image_features(pixel_values=pv)
    ours, a, b = (getattr(x, "pooler_output", x) for x in (ours, a, b))
    assert torch.allclose(ours, a, atol=1e-5) and torch.allclose(a, b, atol=1e-4)


def test_a_methods_own_slot_and_the_feature_adapter_are_parts(tiny_cfg, tmp_path):
    from safetensors.torch import load_file

    out, _ = run_and_export(tiny_cfg(algorithm='"fedclip"', peft__type='"adapter"'), tmp_path, "--client", "0")
    kinds = json.loads((out / "fedsplice_export.json").read_text())["parts"]
    assert kinds and set(kinds.values()) == {"adapter"}
    out2, _ = run_and_export(tiny_cfg(algorithm='"fedpurel"', method__personal_rounds=1, peft__type='"prompt"'),
                             tmp_path / "p", "--client", "0")
    slot = [n for n in load_file(str(out2 / "fedsplice_parts.safetensors")) if n.startswith("slot/")]
    assert slot  # FedPuReL's residual branch, kept by the client, exported beside the prompts
