"""CLIP dual encoder and LLaVA-style VLM on tiny random models (fedsplice.model.vision, backbone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsplice.config import DataConfig, ExperimentConfig, ModelConfig, PeftConfig
from fedsplice.core.split import GLOBAL, PRIVATE, by_roles
from fedsplice.data import zoo
from fedsplice.data.samples import Sample
from fedsplice.errors import ConfigError
from fedsplice.model.taskmodel import TaskModel

CLASSES = ["circle", "square", "triangle"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return str(zoo.tiny_clip(tmp_path_factory.mktemp("m") / "clip"))


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    return str(zoo.tiny_vit(tmp_path_factory.mktemp("m") / "vit"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return str(zoo.tiny_llama(tmp_path_factory.mktemp("m") / "llama"))


def samples(n=6, seed=0, text=True):
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        img = g.integers(0, 256, (28, 28), dtype=np.uint8) if i % 2 else g.integers(0, 256, (20, 24, 3), dtype=np.uint8)
        out.append(Sample(f"toy/{seed}/{i}", img, ("is it a circle" if text else None)))
    return out


def clip_model(clip_dir, ensemble=True, **peft):
    cfg = ExperimentConfig(model=ModelConfig(name=clip_dir, logit_scale=100.0), peft=PeftConfig(**peft),
                           data=DataConfig(class_prompt="a photo of a {label}.",
                                           class_prompts=["a drawing of a {label}."] if ensemble else []))
    cfg.check()
    return TaskModel(cfg, CLASSES)


def test_clip_lora_by_tower_layer_and_role_split(clip_dir):
    m = clip_model(clip_dir, tower="vision_model", layers=[1])
    infos = m.param_infos()
    assert len(infos) == 8  # 4 roles x (A, B) in one layer
    assert all(".vision_model.encoder.layers.1.self_attn." in n for n in infos)
    split = by_roles(infos, ["q", "k"])
    glob = sorted(n for n, g in split.items() if g == GLOBAL)
    priv = sorted(n for n, g in split.items() if g == PRIVATE)
    assert [n.split("self_attn.")[1].split(".")[0] for n in glob] == ["k_proj"] * 2 + ["q_proj"] * 2
    assert [n.split("self_attn.")[1].split(".")[0] for n in priv] == ["out_proj"] * 2 + ["v_proj"] * 2
    assert not m._classes.trains_text  # LoRA only in the image tower: class embeddings stay frozen

    t = clip_model(clip_dir, tower="text_model", roles=["v"])
    assert all(".text_model.encoder.layers." in n and ".v_proj." in n for n in t.param_infos())
    assert t._classes.trains_text  # text-tower LoRA changes the class side: recomputed every step
    before = t.class_embeddings().detach().clone()
    with torch.no_grad():
        for n, p in t.trainable().items():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    assert not torch.allclose(before, t.class_embeddings())


def test_clip_zero_shot_logits_equal_cosine_formula(clip_dir):
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    m = clip_model(clip_dir, tower="vision_model")
    items = samples(text=False) + [Sample("toy/both", samples()[0].image, "a red circle"), "just a caption"]
    with m.zero_shot():
        got = m.predict(items, batch_size=4)

    ref = CLIPModel.from_pretrained(clip_dir).eval()
    tok = AutoTokenizer.from_pretrained(clip_dir)
    proc = AutoImageProcessor.from_pretrained(clip_dir, backend="pil")

    def text(ts):
        return F.normalize(ref.get_text_features(**tok(ts, padding=True, return_tensors="pt")).pooler_output, dim=-1)

    with torch.no_grad():
        cls = F.normalize(text([f"a photo of a {c}." for c in CLASSES])
                          + text([f"a drawing of a {c}." for c in CLASSES]), dim=-1)
        imgs = [np.repeat(s.image[:, :, None], 3, 2) if s.image.ndim == 2 else s.image for s in items[:-1]]
        img = F.normalize(ref.get_image_features(**proc(images=imgs, return_tensors="pt")).pooler_output, dim=-1)
        both = F.normalize(img[-1] + text(["a red circle"])[0], dim=-1)  # mean of the two, normalized
        x = torch.cat([img[:-1], both[None], text(["just a caption"])])
        want = 100.0 * x @ cls.T
    assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("class_specific", [False, True])
def test_prompt_learner_gradients_reach_only_the_context(clip_dir, class_specific):
    m = clip_model(clip_dir, ensemble=False, type="prompt", class_specific=class_specific, prompt_init="template")
    items = samples(text=False)
    assert list(m.trainable()) == ["prompt.ctx"]
    with m.zero_shot():
        zs = m.predict(items, 8)
    # template init: the context starts as the template's own word embeddings -> zero-shot exactly
    assert torch.allclose(m.predict(items, 8), zs, atol=1e-4)
    with pytest.raises(ConfigError, match="class_prompts.*peft.type = 'prompt'"):
        clip_model(clip_dir, type="prompt")  # an ensemble the learned context could not start from
    m.train()
    for p in m.parameters():
        p.grad = None
    F.cross_entropy(m(items), torch.tensor([0, 1, 2, 0, 1, 2])).backward()
    grads = {n for n, p in m.named_parameters() if p.grad is not None}
    assert grads == {"prompt.ctx"}
    assert m.prompt.ctx.grad.abs().sum() > 0
    n = len(m.tokenizer("a photo of a", add_special_tokens=False)["input_ids"])  # 8 word pieces here
    assert n == 8 and m.prompt.ctx.shape == ((3, n, 32) if class_specific else (n, 32))


def test_clip_feature_adapter_starts_at_zero_shot(clip_dir):
    m = clip_model(clip_dir, type="adapter", adapter_init="zero")
    items = samples(text=False)
    assert sorted(m.trainable()) == ["adapter.fc1.bias", "adapter.fc1.weight", "adapter.fc2.bias", "adapter.fc2.weight"]
    assert m.adapter.fc1.in_features == 16  # CLIP's projection width
    with m.zero_shot():
        zs = m.predict(items, 8)
    assert torch.allclose(m.predict(items, 8), zs, atol=1e-5)


def vlm(llama_dir, vit_dir, **peft):
    cfg = ExperimentConfig(model=ModelConfig(name=llama_dir, task="vlm", vision=vit_dir,
                                             input_template="question: {text} answer:"),
                           peft=PeftConfig(**peft))
    return TaskModel(cfg, ["yes", "no", "circle"])


def test_vlm_roles_are_the_lm_attention_and_projector_is_global(llama_dir, vit_dir):
    m = vlm(llama_dir, vit_dir)
    infos = m.param_infos()
    lora = [n for n, i in infos.items() if i.kind == "lora"]
    assert len(lora) == 2 * 4 * 2  # 2 LM layers x q,k,v,o x (A, B)
    assert all(".model.layers." in n for n in lora) and not any("vision" in n for n in infos)
    assert sorted(n for n, i in infos.items() if i.kind == "projector") == [
        "projector.net.0.bias", "projector.net.0.weight", "projector.net.2.bias", "projector.net.2.weight"]
    assert all(not p.requires_grad for p in m.vision.parameters())
    split = by_roles(infos, ["q", "k"])
    glob = {n for n, g in split.items() if g == GLOBAL}
    priv = {n for n, g in split.items() if g == PRIVATE}
    assert priv == {n for n in lora if ".v_proj." in n or ".o_proj." in n}
    assert glob == {n for n in lora if ".q_proj." in n or ".k_proj." in n} | {
        n for n, i in infos.items() if i.kind == "projector"}


def test_vlm_scores_image_tokens_and_text_only_samples(llama_dir, vit_dir):
    from fedsplice.model.scorers import lm_prompts
    from fedsplice.model.verbalizer import verbalizer_logits

    m = vlm(llama_dir, vit_dir, roles=["q", "v"])
    items = samples(4)
    got = m.predict(items, 4)
    pre = m._scorer.image_tokens(items)
    assert [p.shape for p in pre] == [(17, 32)] * 4  # CLS + 16 patches of 8x8 in a 32x32 image
    with torch.no_grad():
        full = verbalizer_logits(m.backbone, m.tokenizer, lm_prompts(m.mcfg.input_template, items),
                                 [" yes", " no", " circle"], prefix=pre, method="full")
    assert torch.allclose(got, full, atol=1e-4)  # KV-cache path == one full forward per pair
    other = m.predict([s.derive("white", image=np.full((28, 28), 255, np.uint8)) for s in items], 4)
    assert not torch.allclose(got, other, atol=1e-3)  # the image matters
    no_img = m.predict([Sample("q", None, "is it a circle")], 1)
    with torch.no_grad():
        text_only = verbalizer_logits(m.backbone, m.tokenizer, ["question: is it a circle answer:"],
                                      [" yes", " no", " circle"])
    assert torch.allclose(no_img, text_only, atol=1e-5)
    # keyed by pixels: 4 images + 1 (the 4 white variants are the same image)
    assert m.cache_stats()["vision"]["entries"] == 5


def test_vlm_projector_of_another_tower_is_refused(llama_dir, vit_dir):
    m = vlm(llama_dir, vit_dir)
    with pytest.raises(ConfigError, match=r"projector\.net\.0\.weight.*model\.vision"):
        m.load_params({"projector.net.0.weight": torch.zeros(32, 48)})
    with pytest.raises(ConfigError, match="width 48.*takes 32"):
        m.projector(torch.zeros(3, 48))


def test_vision_tower_loads_from_a_clip_checkpoint_and_errors(clip_dir, tmp_path):
    from fedsplice.model.vision import load_vision_tower

    tower, proc, hidden = load_vision_tower(clip_dir)
    assert type(tower).__name__ == "CLIPVisionModel" and hidden == 32
    assert proc.crop_size == {"height": 32, "width": 32}
    with pytest.raises(ConfigError, match="model.vision"):
        load_vision_tower(str(tmp_path))  # an empty folder
    with pytest.raises(ConfigError, match="model.vision"):
        ModelConfig(task="vlm", name="zoo:smollm2").check()
    with pytest.raises(ConfigError, match="class_prompts\\[0\\]"):
        DataConfig(class_prompts=["no label here"]).check()
    with pytest.raises(ConfigError, match=r"data.class_prompts\[0\]: only \{label\}.*KeyError: 'kind'"):
        DataConfig(class_prompts=["a {label} of {kind}"]).check()


def test_text_models_refuse_images_and_causal_lm_reads_the_text(tiny_bert_dir, llama_dir):
    from fedsplice.model.verbalizer import verbalizer_logits

    m = TaskModel(ExperimentConfig(model=ModelConfig(name=str(tiny_bert_dir))), CLASSES)
    with pytest.raises(ConfigError, match="holds images"):
        m(samples(2))
    lm = TaskModel(ExperimentConfig(model=ModelConfig(name=llama_dir, task="causal_lm",
                                                      input_template="q: {text} a:")), CLASSES)
    with pytest.raises(ConfigError, match="model.task = 'vlm'"):
        lm(samples(2))
    got = lm.predict([Sample("some/key/7", None, "is it round")], 1)  # the text, never the key
    with torch.no_grad():
        want = verbalizer_logits(lm.backbone, lm.tokenizer, ["q: is it round a:"], [" " + c for c in CLASSES])
    assert torch.allclose(got, want, atol=1e-5)


def test_random_zoo_models_build_once_and_are_labelled():
    from fedsplice.data.zoo import is_random, resolve_model

    a = resolve_model("zoo:tiny-vit")
    assert resolve_model("zoo:tiny-vit") == a and (zoo.Path(a) / "model.safetensors").is_file()
    assert is_random("zoo:tiny-clip") and is_random("zoo:tiny-vit") and not is_random("zoo:minilm")


def test_a_random_zoo_model_is_built_for_real_under_a_meta_device_context(tmp_path, monkeypatch):
    """A plan builds its skeleton under torch.device("meta"); the zoo's random weights it asks for
    on a fresh cache are still made (and saved) as real tensors (the easyvqa configs' first plan)."""
    from safetensors.torch import load_file

    from fedsplice.data.zoo import resolve_model

    monkeypatch.setenv("FEDSPLICE_CACHE", str(tmp_path))
    with torch.device("meta"):
        path = resolve_model("zoo:tiny-vit")
    weights = load_file(str(zoo.Path(path) / "model.safetensors"))
    assert weights and all(t.device.type == "cpu" and not t.is_meta for t in weights.values())


def test_image_tokens_follow_bos(llama_dir, vit_dir):
    """With a tokenizer that adds BOS, the image tokens go after it: [BOS, image, prompt]."""
    from fedsplice.model.verbalizer import pad_embeds

    m = vlm(llama_dir, vit_dir)
    bos = m.tokenizer.bos_token_id
    ids = m.tokenizer("question: hi answer:")["input_ids"]
    assert ids[0] == bos
    x = torch.randn(3, 32)
    emb, mask = pad_embeds(m.backbone, [ids, ids[1:]], [x, None], "cpu", bos)
    we = m.backbone.get_input_embeddings().weight
    n = len(ids) + 3
    assert mask[0].sum() == n and mask[1].sum() == len(ids) - 1
    assert torch.equal(emb[0, 0], we[bos]) and torch.equal(emb[0, 1:4], x)
    assert torch.equal(emb[0, 4], we[ids[1]])


def test_clip_prompt_longer_than_the_text_tower_is_a_config_error(clip_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(clip_dir)
    longest = max(len(tok(f"{c}.", add_special_tokens=False)["input_ids"]) for c in CLASSES)
    n = 2 + 80 + longest  # BOS + context + "label." + EOS
    with pytest.raises(ConfigError, match=f"peft.n_ctx: the longest class sequence has {n} tokens.*takes 77"):
        clip_model(clip_dir, ensemble=False, type="prompt", n_ctx=80)


def test_random_models_are_recognised_by_their_cache_folder():
    from fedsplice.data.zoo import is_random, random_weights, resolve_model

    path = resolve_model("zoo:tiny-clip")
    assert is_random(path) and not is_random(str(zoo.Path(path).parent))
    cfg = ExperimentConfig(model=ModelConfig(name="zoo:smollm2", task="vlm", vision=path))
    assert random_weights(cfg) == [f"model.vision = {path}"]


@pytest.mark.parametrize("tower,layers", [("vision_model", [1]), ("text_model", [])])
def test_clip_image_prefix_cache_reproduces_the_full_forward(clip_dir, tower, layers):
    """LoRA above layer l0 (or only in the text tower): the frozen bottom of the vision tower is
    cached per image and the rest runs on it; logits equal the uncached model's, trained or not."""
    def model(cache):
        cfg = ExperimentConfig(model=ModelConfig(name=clip_dir, logit_scale=100.0),
                               peft=PeftConfig(tower=tower, layers=layers),
                               data=DataConfig(class_prompt="a photo of a {label}."))
        cfg.runtime.cache = cache
        return TaskModel(cfg, CLASSES)

    on, off = model(True), model(False)
    assert on._img_prefix is not None and off._img_prefix is None
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for (n, p), q in zip(on.trainable().items(), off.trainable().values()):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                q.copy_(p)
    items = samples(text=False) + [samples()[0]]  # the last one also has a caption
    for _ in range(2):  # second pass: from the cache
        assert torch.allclose(on.predict(items, 4), off.predict(items, 4), atol=1e-5)
    with on.zero_shot(), off.zero_shot():
        assert torch.allclose(on.predict(items, 4), off.predict(items, 4), atol=1e-5)
    st = on.cache_stats()["image_prefix"]
    assert st["entries"] == 6 and st["hits"] > 0  # 6 distinct images (the last repeats the first)
    on.train()
    F.cross_entropy(on(items), torch.tensor([0, 1, 2, 0, 1, 2, 0])).backward()
    assert all(p.grad is not None for n, p in on.trainable().items() if "lora_A" in n)


def test_clip_pixels_are_preprocessed_once_per_image(clip_dir):
    """LoRA in every vision layer (no frozen prefix): each step runs the whole tower, but an
    image's preprocessed pixels are computed once; the logits equal those of a run without caches."""
    from fedsplice.config import RuntimeConfig

    def model(cache: bool) -> TaskModel:
        cfg = ExperimentConfig(model=ModelConfig(name=clip_dir, logit_scale=100.0), runtime=RuntimeConfig(cache=cache),
                               peft=PeftConfig(tower="vision_model"),
                               data=DataConfig(class_prompt="a photo of a {label}."))
        cfg.check()
        return TaskModel(cfg, CLASSES)

    items = samples(text=False)
    m = model(True)
    first = m.predict(items, 4)
    assert m.cache_stats()["pixels"] == {**m.cache_stats()["pixels"], "entries": 6, "misses": 6, "hits": 0}
    assert torch.equal(m.predict(items, 4), first) and m.cache_stats()["pixels"]["hits"] == 6
    off = model(False)
    assert "pixels" not in off.cache_stats()
    assert torch.allclose(off.predict(items, 4), first, atol=1e-5)
