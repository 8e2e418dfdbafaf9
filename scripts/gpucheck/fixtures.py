"""What every stage runs on: random-weight models of real (or --small) shapes, synthetic data
written to a work folder, and configs taken from the shipped ones with only the model, the data
and the budget replaced. Nothing here downloads: the GPU machine has no registry."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
# a shape: keyword arguments of a transformers config (ints, floats, flags, nested towers)
Shape = dict[str, Any]
QWEN2_1_5B: Shape = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, initializer_range=0.02, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, max_position_embeddings=4096)
QWEN2_VOCAB = 151_936  # the real vocabulary: the LM head is a fifth of the 1.5B model's FLOPs per kept position
QWEN2_7B: Shape = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, initializer_range=0.02, rms_norm_eps=1e-6, vocab_size=152_064,
                       tie_word_embeddings=False, max_position_embeddings=4096)
# google/siglip-so400m-patch14-384's shape as a CLIP vision tower (729 patches + a CLS token)
SO400M: Shape = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                     image_size=384, patch_size=14)
VIT_B16: Shape = dict(vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                  image_size=224, patch_size=16),
                      text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
                      projection_dim=512)
SMALL_LLAMA: Shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, initializer_range=0.02)
SMALL_VISION: Shape = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8)
SMALL_CLIP: Shape = dict(vision=SMALL_VISION, text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4), projection_dim=16)
TOPICS = {"sports": "game play ball run team fast win", "science": "study earth plant moon system test learn",
          "music": "song sing listen music sound note play", "food": "eat food water fish farm fire hot"}
LONG_LABELS = {"sports": "ball game", "science": "earth study", "music": "song note", "food": "fish food"}
COLOURS = {"red": (200, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 200), "yellow": (220, 210, 40)}


def write_text_data(folder: Path, per_class: int, seed: int = 0, *, words: tuple[int, int] = (16, 32),
                    labels: dict[str, str] | None = None, name: str = "topics.csv") -> Path:
    """A CSV of 4 topics: sentences of `words` (low, high) common words with topic words mixed in;
    `labels` renames the classes (multi-word names make multi-token answers)."""
    from fedsplice.data.tiny import TINY_WORDS

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        for label, topic in TOPICS.items():
            for i in range(per_class):
                n = int(rng.integers(*words))
                toks = [str(rng.choice(topic.split())) if rng.random() < 0.3 else str(rng.choice(TINY_WORDS))
                        for _ in range(n)]
                w.writerow([(labels or {}).get(label, label), " ".join(toks) + f" {i}"])
    return path


def write_image_data(folder: Path, per_class: int, size: int, seed: int = 0) -> Path:
    """images:DIR of 4 colours: `size`-pixel PNGs of a class colour plus per-pixel noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label, rgb in COLOURS.items():
        (folder / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            px = np.clip(np.array(rgb) + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(px).save(folder / label / f"{i}.png")
    return folder


def write_vqa_data(folder: Path, per_class: int, size: int) -> Path:
    """A CSV of questions about the colour images (label, text, image): the VLM's input."""
    images = write_image_data(folder / "img", per_class, size)
    path = folder / "vqa.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text", "image"])
        for label in COLOURS:
            for i in range(per_class):
                w.writerow([label, "what colour is the square", str((images / label / f"{i}.png").relative_to(folder))])
    return path


def llama(work: Path, name: str, shape: dict, device: str, dtype=torch.bfloat16) -> Path:
    """A random Llama of `shape` (vocab_size in it, else the tiny tokenizer's), built on `device`
    when that is CUDA (fast random init) and saved in `dtype`, with the tiny tokenizer."""
    from fedsplice.data.tiny import tiny_llama

    return tiny_llama(work / name, shape=shape, dtype=dtype, device=device if device.startswith("cuda") else None)


def clip(work: Path, name: str, shapes: dict, device: str) -> Path:
    from fedsplice.data.tiny import tiny_clip

    return tiny_clip(work / name, text=shapes["text"], vision=shapes["vision"], projection_dim=shapes["projection_dim"],
                     dtype=torch.bfloat16, device=device if device.startswith("cuda") else None)


def vision_tower(work: Path, name: str, shape: dict, device: str) -> Path:
    """A random CLIP vision tower of `shape`, saved in bf16 with an image processor of its size."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from fedsplice.data.tiny import build_seeded, tiny_image_processor

    out = work / name
    model = build_seeded(lambda: CLIPVisionModel(CLIPVisionConfig(**shape)), 0,
                         device if device.startswith("cuda") else None)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tiny_image_processor(shape["image_size"]).save_pretrained(out)
    del model
    return out


class Budget(TypedDict):
    """The budget keywords of lm_config and clip_config, as one stage passes them to several runs."""

    rounds: int
    steps: int
    batch: int
    small: bool


def budget(rounds: int, steps: int, batch: int, small: bool, clients: int = 2) -> dict:
    """The data split and the federation's budget, shared by every run."""
    return {"seed": 0, "data.num_clients": 4, "data.partition": "dirichlet", "data.alpha": 1.0,
            "data.test_per_class": 4 if small else 8, "data.local_test_size": 8 if small else 16,
            "data.holdout_clients": 0, "data.max_per_class": 0, "data.imbalance": 1.0, "data.n_max": 0,
            "client.max_steps": steps, "client.batch_size": batch, "server.rounds": rounds,
            "server.clients_per_round": clients, "eval.every": rounds, "runtime.checkpoint_every": 0,
            "runtime.threads": 1 if small else 0}


def config(shipped: str, sets: dict):
    from fedsplice import load_config

    return load_config(REPO / "configs" / shipped, sets)


def lm_config(model: Path, csv_path: Path, device: str, precision: str, dtype: str, *, rounds: int = 1,
              steps: int = 2, batch: int = 8, small: bool = True, max_length: int = 64, **extra):
    """PFAdapter on a causal LM: configs/pfadapter-smollm2.toml with the model, data and budget replaced."""
    return config("pfadapter-smollm2.toml", {
        **budget(rounds, steps, batch, small), "model.name": str(model), "model.max_length": max_length,
        "data.dataset": f"csv:{csv_path}", "runtime.device": device, "runtime.precision": precision,
        "model.dtype": dtype, **extra})


def bert_config(model: Path, csv_path: Path, device: str, precision: str, **extra):
    """PFAdapter on a BERT-style encoder: configs/pfadapter-minilm.toml, model, data and budget replaced."""
    return config("pfadapter-minilm.toml", {
        **budget(1, 2, 8, True), "model.name": str(model), "data.dataset": f"csv:{csv_path}",
        "runtime.device": device, "runtime.precision": precision, **extra})


def clip_config(model: Path, images: Path, device: str, precision: str, dtype: str, *, rounds: int = 1,
                steps: int = 2, batch: int = 8, small: bool = True, **extra):
    """FedPuReL with LoRA in CLIP's image tower: configs/fedpurel-lora-fmnist.toml, model, data and budget replaced."""
    return config("fedpurel-lora-fmnist.toml", {
        **budget(rounds, steps, batch, small), "model.name": str(model), "data.dataset": f"images:{images}",
        "data.class_prompt": "a photo of a {label} square.", "data.class_prompts": [],
        "runtime.device": device, "runtime.precision": precision, "model.dtype": dtype, **extra})


def vlm_config(lm: Path, vision: Path, vqa: Path, device: str, *, steps: int, small: bool):
    """configs/pfadapter-qwen2-7b-nf4.toml (the VLM, nf4, checkpointing, its batch of 16) with the
    model weights, the data and the budget replaced: 1 round of 2 clients."""
    return config("pfadapter-qwen2-7b-nf4.toml", {
        **budget(1, steps, 16, small), "model.name": str(lm), "model.vision": str(vision),
        "data.dataset": f"csv:{vqa}", "runtime.device": device, "eval.batch_size": 16})
