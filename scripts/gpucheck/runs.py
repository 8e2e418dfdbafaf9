"""What the stages share: the Ctx (device, shapes, the work folder, models and data built once),
a timed run through `fedsplice.run`, and how two runs are compared."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpucheck import fixtures as fx
from gpucheck.measure import Meter, llama_train_flops, syncs_per_step

FP32_TOL, BF16_TOL = 1e-3, 5e-2


@dataclass
class Ctx:
    device: str
    small: bool
    work: Path
    precision: str = "bf16"
    steps: int = 6
    batch: int = 16
    mem_cap_gib: float = 48.0
    peak: dict = field(default_factory=dict)  # precision -> measured matmul FLOP/s (preflight)
    _paths: dict = field(default_factory=dict)

    @property
    def dev(self) -> torch.device:
        return torch.device(self.device)

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"

    def once(self, key: str, make):
        """A model or data set built on first use and shared by the stages after it."""
        if key not in self._paths:
            self._paths[key] = make()
        return self._paths[key]

    def text(self) -> Path:
        return self.once("text", lambda: fx.write_text_data(self.work / "data", per_class=24 if self.small else 64))

    def images(self, size: int) -> Path:
        return self.once(f"img{size}", lambda: fx.write_image_data(self.work / f"img{size}", 16 if self.small else 48,
                                                                   size))

    def llama_shape(self, vocab: bool = False) -> dict:
        shape = fx.SMALL_LLAMA if self.small else fx.QWEN2_1_5B
        return {**shape, "vocab_size": fx.QWEN2_VOCAB} if vocab and not self.small else dict(shape)

    def llama(self, vocab: bool = False) -> Path:
        name = "qwen-vocab" if vocab and not self.small else "llama"
        return self.once(name, lambda: fx.llama(self.work / "models", name, self.llama_shape(vocab), self.device))


def timed(cfg, out: Path, width: int, per_token: bool = True, profile: bool = False):
    """`fedsplice.run(cfg)` under a Meter (and the profiler): (RunResult, summary, syncs per step)."""
    import fedsplice

    syncs, dev = None, torch.device(cfg.runtime.device)
    with Meter(dev, width, per_token) as m:
        if profile and dev.type == "cuda":
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                res = fedsplice.run(cfg, out)
            syncs = syncs_per_step(prof)
        else:
            res = fedsplice.run(cfg, out)
    return res, m.summary(), syncs


def losses(res) -> list[float]:
    return [r["train_loss"] for r in res.records() if r.get("round", 0) > 0 and "train_loss" in r]


def max_diff(a, b) -> float:
    """The largest disagreement of two runs: relative on each round's training loss, absolute on
    the GM and PM accuracies and macro-F1."""
    la, lb = losses(a), losses(b)
    if len(la) != len(lb) or not la:
        return math.inf
    diffs = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(la, lb)]
    for part in ("gm", "pm"):
        for key in ("accuracy", "f1_macro"):
            diffs.append(abs(getattr(a, part)[key] - getattr(b, part)[key]))
    return max(diffs)


def utilisation(ctx: Ctx, rate: float | None, shape: dict, precision: str) -> float | None:
    peak = ctx.peak.get(precision)
    return rate * llama_train_flops(shape) / peak if rate and peak else None


def loss_text(ls: list[float]) -> str:
    return ", ".join(f"{v:.4f}" for v in ls) or "none"

