"""Training-step time of a ViT-B/16-sized CLIP with LoRA in the image tower, with and without the
frozen-prefix cache (docs/design.md §7).

    python benchmarks/clip_prefix.py [--quick]

No registry package ships CLIP weights, so the model is a RANDOM CLIP with ViT-B/16's shapes
(vision: 12 layers, hidden 768, 224x224 images in 16x16 patches; text: 12 layers, hidden 512),
built in-process and saved once to a temporary folder: step time depends on the shapes, not on
the weights. Variants: LoRA r=8 on q,k,v,o in all 12 vision layers; in the last 2 layers without
the cache (the full forward still runs); in the last 2 layers with the cache (hidden states
entering layer 10 computed once per image). One client, batch 16 Fashion-MNIST images, the
same images every repeat after a warm-up pass that fills the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = ap.parse_args()
    steps, repeats = (2, 2) if args.quick else (4, 3)

    import numpy as np
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    from fedsplice.config import ClientConfig, DataConfig, ExperimentConfig, ModelConfig, PeftConfig
    from fedsplice.core.context import TrainContext
    from fedsplice.data import tiny, zoo
    from fedsplice.data.datasets import load_dataset
    from fedsplice.federation.train import local_train
    from fedsplice.model.taskmodel import TaskModel

    tmp = Path(tempfile.mkdtemp(prefix="clip-b16-"))
    tok = zoo.tiny_tokenizer(style="clip")
    text = CLIPTextConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
    cfg = CLIPConfig(text_config=text.to_dict(), vision_config=CLIPVisionConfig(patch_size=16).to_dict())
    tiny.build_seeded(lambda: CLIPModel(cfg), 0).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    zoo.tiny_image_processor(224).save_pretrained(tmp)

    ds = load_dataset("fashion_mnist", test_per_class=1)
    n = 16 * steps
    items, labels = ds.train_texts[:n], ds.train_labels[:n]
    variants = {"LoRA in all 12 layers": ([], True), "LoRA in layers 10-11, no cache": ([10, 11], False),
                "LoRA in layers 10-11, prefix cache": ([10, 11], True)}
    times: dict[str, list[float]] = {}
    for name, (layers, cache) in variants.items():
        ec = ExperimentConfig(model=ModelConfig(name=str(tmp)), peft=PeftConfig(tower="vision_model", layers=layers),
                              data=DataConfig(class_prompt="a photo of a {label}."))
        ec.runtime.cache = cache
        m = TaskModel(ec, ds.class_names)
        cc = ClientConfig(batch_size=16, max_steps=steps, lr=1e-3)
        times[name] = []
        for rep in range(repeats + 1):  # repeat 0 warms up (and fills the cache)
            t0 = time.perf_counter()
            local_train(m, items, labels, cfg=cc, keep_opt=set(), opt_state={},
                        rng=np.random.default_rng(rep), ctx=TrainContext())
            if rep:
                times[name].append((time.perf_counter() - t0) / (16 * steps))
        del m
    ref = statistics.median(times["LoRA in all 12 layers"])
    rows = [{"variant": k, "images_per_s": 1 / statistics.median(v), "speedup": ref / statistics.median(v)}
            for k, v in times.items()]
    report("clip_prefix", rows, ["variant", "images_per_s", "speedup"], args.quick, [
        f"RANDOM-weight CLIP with ViT-B/16 shapes (timing only), fp32, batch 16, {steps} steps per timed "
        f"call, median of {repeats}; torch threads {torch.get_num_threads()}.",
        "speedup: against LoRA in all 12 vision layers. The cached run reuses the hidden states "
        "entering layer 10 of the same images (filled during the warm-up pass)."])


if __name__ == "__main__":
    main()
