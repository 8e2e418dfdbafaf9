"""A prepared GPU check (issue 14, item 9): PFAdapter and FedPuReL on random-weight models of real
shapes, on one device in bf16, plus an equality check of the device against the CPU.

    PYTHONPATH=src python scripts/gpu_check.py                  # one GPU: well under 8 minutes
    PYTHONPATH=src python scripts/gpu_check.py --out gpu.md     # the table also as markdown
    PYTHONPATH=src python scripts/gpu_check.py --device cpu --small   # this CPU, tiny shapes (< 1 min)

Needs fedsplice's own dependencies (not Flower); no registry, hub or download. The weights cannot
travel, so it builds them in a temporary folder (`fedsplice.data.tiny` with real shapes; the tiny
offline WordPiece tokenizer makes the vocabulary 633 words, not Qwen2's 151,936 or CLIP's 49,408)
and writes synthetic data there (4 topics of word-salad sentences; 4 colours of noise). The methods'
settings come from the shipped configs (configs/pfadapter-smollm2.toml, fedpurel-lora-fmnist.toml);
only the model, the data and the budget are replaced. Every run goes through `fedsplice.run`.

Rows (model, method, device, precision, step time, tokens or images per second, peak GPU memory):
- a Llama of Qwen2-1.5B's shape (hidden 1536, 28 layers, 12 query / 2 key-value heads, MLP 8960),
  PFAdapter, and a CLIP of ViT-B/16's shape (vision 768 x 12 layers, 224 px in 16 px patches;
  text 512 x 12; projection 512), FedPuReL with LoRA in the image tower: 2 rounds each with
  `runtime.precision` and `model.dtype` bf16; check: both rounds ran with a finite training loss;
- the tiny Llama (hidden 32), PFAdapter, 1 round on the CPU in fp32 and on the device in fp32;
  check: training losses agree to 1e-3 (relative), accuracies and macro-F1 to 1e-3. With
  `--device cpu` that would compare the CPU with itself, so the row compares bf16 autocast with
  fp32 on the CPU instead, to 5e-2; bf16 identical to fp32 is a FAIL (autocast did not act).

Step time and throughput come from torch's global hooks: a step runs from the first forward under
autograd to the optimizer's step (the device synchronized at both ends); tokens are the (padded)
batch x length entering the first transformer layer run with autograd, images the batch entering
the first vision layer; the first step (warm-up) is left out. Peak memory: max_memory_allocated
over the run. Exit status: 0 all PASS, 1 a check failed, 2 the device is missing or a config was refused.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "MPLBACKEND": "Agg", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ.setdefault(_k, _v)  # no hub, no download, no progress bars
REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))  # a checkout that was not `pip install`ed

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn.modules.module import register_module_forward_pre_hook  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

QWEN2_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, initializer_range=0.02, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, max_position_embeddings=2048)
VIT_B16 = dict(vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=224, patch_size=16),
               text=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8),
               projection_dim=512)
SMALL_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, initializer_range=0.02)
SMALL_CLIP = dict(vision=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8),
                  text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
                  projection_dim=16)
TOPICS = {"sports": "game play ball run team fast win", "science": "study earth plant moon system test learn",
          "music": "song sing listen music sound note play", "food": "eat food water fish farm fire hot"}
COLOURS = {"red": (200, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 200), "yellow": (220, 210, 40)}
FP32_TOL, BF16_TOL = 1e-3, 5e-2
LAYERS = ("LlamaDecoderLayer", "CLIPEncoderLayer")


# ----------------------------------------------------------------------------- data and models


def write_text_data(folder: Path, per_class: int, seed: int = 0) -> Path:
    """A CSV of 4 topics: ~24-word sentences of common words with topic words mixed in."""
    import csv

    from fedsplice.data.tiny import TINY_WORDS

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "topics.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        for label, words in TOPICS.items():
            for i in range(per_class):
                n = int(rng.integers(16, 32))
                toks = [str(rng.choice(words.split())) if rng.random() < 0.3 else str(rng.choice(TINY_WORDS))
                        for _ in range(n)]
                w.writerow([label, " ".join(toks) + f" {i}"])
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


def build_models(work: Path, small: bool, device: str) -> dict[str, Path]:
    """The random-weight models of real (or, `small`, tiny) shapes, built on `device` (fast
    random init on a GPU) and saved in bf16; and the tiny Llama (CPU-built, as the zoo's)."""
    from fedsplice.data.tiny import tiny_clip, tiny_llama

    clip, dev = (SMALL_CLIP if small else VIT_B16), (device if device.startswith("cuda") else None)
    return {"llama": tiny_llama(work / "llama", shape=SMALL_LLAMA if small else QWEN2_1_5B, dtype=torch.bfloat16,
                                device=dev),
            "clip": tiny_clip(work / "clip", text=clip["text"], vision=clip["vision"],
                              projection_dim=clip["projection_dim"], dtype=torch.bfloat16, device=dev),
            "tiny": tiny_llama(work / "tiny-llama")}


# ----------------------------------------------------------------------------- configs


def budget(rounds: int, steps: int, batch: int, small: bool) -> dict:
    """The data split and the federation's budget, shared by every run."""
    return {"seed": 0, "data.num_clients": 4, "data.partition": "dirichlet", "data.alpha": 1.0,
            "data.test_per_class": 4 if small else 8, "data.local_test_size": 8 if small else 16,
            "data.holdout_clients": 0, "data.max_per_class": 0, "data.imbalance": 1.0, "data.n_max": 0,
            "client.max_steps": steps, "client.batch_size": batch, "server.rounds": rounds,
            "server.clients_per_round": 2, "eval.every": rounds, "runtime.checkpoint_every": 0,
            "runtime.threads": 1 if small else 0}


def lm_config(model: Path, csv_path: Path, device: str, precision: str, dtype: str, *, rounds: int,
              steps: int, batch: int, small: bool):
    """PFAdapter on a causal LM: configs/pfadapter-smollm2.toml with the model, data and budget replaced."""
    from fedsplice import load_config

    sets = {**budget(rounds, steps, batch, small), "model.name": str(model), "model.max_length": 64,
            "data.dataset": f"csv:{csv_path}", "runtime.device": device, "runtime.precision": precision,
            "model.dtype": dtype}
    return load_config(REPO / "configs" / "pfadapter-smollm2.toml", sets)


def clip_config(model: Path, images: Path, device: str, precision: str, dtype: str, *, rounds: int,
                steps: int, batch: int, small: bool):
    """FedPuReL with LoRA in CLIP's image tower: configs/fedpurel-lora-fmnist.toml, model, data and budget replaced."""
    from fedsplice import load_config

    sets = {**budget(rounds, steps, batch, small), "model.name": str(model), "data.dataset": f"images:{images}",
            "data.class_prompt": "a photo of a {label} square.", "data.class_prompts": [],
            "runtime.device": device, "runtime.precision": precision, "model.dtype": dtype}
    return load_config(REPO / "configs" / "fedpurel-lora-fmnist.toml", sets)


# ----------------------------------------------------------------------------- measuring


@dataclass
class Meter:
    """Step times and tokens (or images) of the training steps of one run, from torch's global
    forward pre-hook and optimizer step post-hook; `width` picks the counted tower's layers."""

    device: torch.device
    width: int
    per_token: bool  # tokens = batch x length; else images = batch
    steps: list[tuple[float, int]] = field(default_factory=list)
    _t0: float | None = None
    _n: int = 0
    _first: int | None = None
    _handles: list = field(default_factory=list)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pre(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        if self._t0 is None:
            self._sync()
            self._t0 = time.perf_counter()
        h = args[0] if args else None
        if type(module).__name__ in LAYERS and torch.is_tensor(h) and h.dim() == 3 and h.shape[-1] == self.width:
            self._first = id(module) if self._first is None else self._first
            if id(module) == self._first:
                self._n += h.shape[0] * (h.shape[1] if self.per_token else 1)

    def _post(self, *_) -> None:
        if self._t0 is not None:
            self._sync()
            self.steps.append((time.perf_counter() - self._t0, self._n))
        self._t0, self._n = None, 0

    def __enter__(self) -> Meter:
        self._handles = [register_module_forward_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        [h.remove() for h in self._handles]

    def summary(self) -> dict:
        """Median step time and throughput over the steps after the first; peak GPU memory."""
        timed = self.steps[1:] if len(self.steps) > 1 else self.steps
        total = sum(t for t, _ in timed)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return {"steps": len(self.steps), "step_s": statistics.median(t for t, _ in timed) if timed else None,
                "rate": sum(n for _, n in timed) / total if total > 0 else None, "peak": peak}


# ----------------------------------------------------------------------------- runs and checks


@dataclass
class Row:
    model: str
    method: str
    device: str
    precision: str
    step_s: float | None
    rate: str  # "1,234 tok/s" / "56 img/s"
    peak: int | None  # bytes; None on a CPU
    check: str
    ok: bool


def timed_run(cfg, out: Path, width: int, per_token: bool):
    """`fedsplice.run(cfg)` under a Meter: (RunResult, the meter's summary)."""
    import fedsplice

    with Meter(torch.device(cfg.runtime.device), width, per_token) as m:
        res = fedsplice.run(cfg, out)
    return res, m.summary()


def round_losses(res) -> list[float]:
    return [r["train_loss"] for r in res.records() if r.get("round", 0) > 0 and "train_loss" in r]


def run_row(label: str, cfg, out: Path, width: int, per_token: bool) -> Row:
    """One timed run; its check: every round ran and its training loss is finite."""
    res, s = timed_run(cfg, out, width, per_token)
    losses = round_losses(res)
    ok = len(losses) == cfg.server.rounds and all(math.isfinite(v) for v in losses)
    return Row(label, cfg.algorithm, cfg.runtime.device, f"{cfg.runtime.precision} (base {cfg.model.dtype})",
               s["step_s"], rate(s["rate"], "tok/s" if per_token else "img/s"), s["peak"],
               f"{'PASS' if ok else 'FAIL'}: {len(losses)} rounds, loss {', '.join(f'{v:.4f}' for v in losses)}", ok)


def max_diff(a, b) -> float:
    """The largest disagreement of two runs: relative on each round's training loss, absolute on
    the GM and PM accuracies and macro-F1."""
    la, lb = round_losses(a), round_losses(b)
    if len(la) != len(lb) or not la:
        return math.inf
    diffs = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(la, lb)]
    for part in ("gm", "pm"):
        for key in ("accuracy", "f1_macro"):
            diffs.append(abs(getattr(a, part)[key] - getattr(b, part)[key]))
    return max(diffs)


def equality_row(models: dict, csv_path: Path, work: Path, device: str) -> Row:
    """The tiny Llama, 1 round: the CPU in fp32 against `device` in fp32 (a CUDA device), or, on the
    CPU, bf16 autocast against fp32 (bf16 identical to fp32 fails: autocast did not act)."""
    on_cpu = torch.device(device).type == "cpu"
    other = ("cpu", "bf16") if on_cpu else (device, "fp32")
    tol = BF16_TOL if on_cpu else FP32_TOL
    kw = dict(rounds=1, steps=2, batch=8, small=True)
    ref, _ = timed_run(lm_config(models["tiny"], csv_path, "cpu", "fp32", "fp32", **kw), work / "eq-ref", 32, True)
    res, s = timed_run(lm_config(models["tiny"], csv_path, other[0], other[1], "fp32", **kw), work / "eq", 32, True)
    d = max_diff(ref, res)
    inert = on_cpu and d == 0.0  # bf16 autocast changed nothing: it did not act
    ok = d <= tol and not inert
    what = "cpu bf16 vs cpu fp32" if on_cpu else f"{device} fp32 vs cpu fp32"
    check = f"{'PASS' if ok else 'FAIL'}: max diff {d:.2e} {'<=' if d <= tol else '>'} {tol:g}"
    return Row("tiny Llama (hidden 32)", "pfadapter", what, other[1], s["step_s"],
               rate(s["rate"], "tok/s"), s["peak"],
               check + (" (identical: bf16 had no effect)" if inert else ""), ok)


# ----------------------------------------------------------------------------- the table


def rate(r: float | None, unit: str) -> str:
    return "n/a" if not r else f"{r:,.0f} {unit}" if r >= 100 else f"{r:.3g} {unit}"


def gib(n: int | None) -> str:
    return "n/a (CPU)" if n is None else f"{n / 2**30:.2f} GiB"


def table(rows: list[Row]) -> str:
    head = ["model", "method", "device", "precision", "step time (s)", "tokens or images / s", "peak GPU memory",
            "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        step = "n/a" if r.step_s is None else f"{r.step_s:.4f}"
        lines.append("| " + " | ".join([r.model, r.method, r.device, r.precision, step, r.rate, gib(r.peak),
                                        r.check]) + " |")
    return "\n".join(lines)


def header(args, device: torch.device, seconds: float) -> str:
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    shapes = ("tiny shapes (--small): Llama hidden 64 x 2 layers, CLIP vision 48 / text 32 x 2 layers, 32 px"
              if args.small else "real shapes: Llama of Qwen2-1.5B (hidden 1536, 28 layers, 12/2 heads, MLP 8960), "
              "CLIP of ViT-B/16 (vision 768 x 12, 224 px / 16 px patches; text 512 x 12; projection 512)")
    return (f"`python scripts/gpu_check.py --device {args.device}{' --small' if args.small else ''}` on {where}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, {seconds:.0f} s in all.\n"
            f"RANDOM weights, {shapes}; vocabulary reduced to the tiny offline tokenizer's (633 words). "
            f"Synthetic data (4 topics / 4 colours); 2 rounds, 2 of 4 clients, {args.steps} steps of "
            f"{args.batch} per client. Step time: median after the first step.")


# ----------------------------------------------------------------------------- main


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--small", action="store_true", help="tiny shapes: a quick run of the same code (CPU tests)")
    p.add_argument("--out", type=Path, help="also write the table as markdown to this file")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="runtime.precision and model.dtype of the two timed runs (default bf16)")
    p.add_argument("--steps", type=int, default=None, help="steps per client and round (default 6; --small 2)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 16; --small 8)")
    p.add_argument("--workdir", type=Path, help="keep the models, data and runs here (default: a temp folder)")
    args = p.parse_args(argv)
    args.steps, args.batch = args.steps or (2 if args.small else 6), args.batch or (8 if args.small else 16)
    return args


def check_device(name: str) -> torch.device:
    """The device, or exit 2 with one line when it is not cpu / cuda / cuda:N or this machine lacks it."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev is None or dev.type not in ("cuda", "cpu"):
        msg = f"gpu_check: --device {name!r}: use cuda, cuda:N or cpu"
    elif dev.type == "cuda" and (n == 0 or (dev.index or 0) >= n):
        msg = (f"gpu_check: --device {name}: this machine has {n} CUDA device(s) (torch {torch.__version__}); "
               f"use --device cpu --small for the CPU check")
    else:
        return dev
    print(msg, file=sys.stderr)
    sys.exit(2)


def run_all(args, work: Path) -> list[Row]:
    """Build the models and data in `work`, then the three rows."""
    size = SMALL_CLIP["vision"]["image_size"] if args.small else VIT_B16["vision"]["image_size"]
    models = build_models(work / "models", args.small, args.device)
    csv_path = write_text_data(work / "data", per_class=24 if args.small else 64)
    images = write_image_data(work / "images", per_class=16 if args.small else 48, size=size)
    kw = dict(rounds=2, steps=args.steps, batch=args.batch, small=args.small)
    p, dev = args.precision, args.device
    llama_w = (SMALL_LLAMA if args.small else QWEN2_1_5B)["hidden_size"]
    vision_w = (SMALL_CLIP if args.small else VIT_B16)["vision"]["hidden_size"]
    llama, clip = ("Llama, --small shape", "CLIP, --small shape") if args.small else (
        "Llama, Qwen2-1.5B shape", "CLIP, ViT-B/16 shape")
    return [run_row(llama, lm_config(models["llama"], csv_path, dev, p, p, **kw), work / "pfadapter", llama_w, True),
            run_row(clip, clip_config(models["clip"], images, dev, p, p, **kw), work / "fedpurel", vision_w, False),
            equality_row(models, csv_path, work, dev)]


def main(argv=None) -> int:
    args = parse(argv)
    device = check_device(args.device)
    from fedsplice.errors import FedspliceError

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.workdir or Path(tmp)
        try:
            rows = run_all(args, work)
        except FedspliceError as e:
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
    text = header(args, device, time.perf_counter() - t0) + "\n\n" + table(rows) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
