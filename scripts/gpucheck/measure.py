"""Measuring a run: the Meter (training steps timed and their tokens counted through torch's
global hooks), the achievable matmul rate, useful FLOPs per token, CUDA synchronisations per
step from the profiler, and the Row every stage returns (markdown and JSON)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

LAYERS = ("LlamaDecoderLayer", "CLIPEncoderLayer", "BertLayer")
# a CUDA call that makes the host wait: what `.item()`, `float(t)`, `.cpu()` and pageable copies do
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
STEP_RANGE = "gpu_check_train_step"


@dataclass
class Meter:
    """Step times and tokens (or images) of the training steps of one run: a step runs from the
    first forward under autograd to the optimizer's step, the device synchronized at both ends
    (outside the profiler range the step is marked with, so the meter's own syncs are not
    counted). Tokens: those of every pass of the step through the first layer of `width`."""

    device: torch.device
    width: int
    per_token: bool  # tokens = batch x length; else images = batch
    steps: list[tuple[float, int]] = field(default_factory=list)
    _t0: float | None = None
    _n: int = 0
    _first: int | None = None
    _range: torch.autograd.profiler.record_function | None = None
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
            self._range = torch.autograd.profiler.record_function(STEP_RANGE)
            self._range.__enter__()
        h = args[0] if args else None
        if type(module).__name__ in LAYERS and torch.is_tensor(h) and h.dim() == 3 and h.shape[-1] == self.width:
            self._first = id(module) if self._first is None else self._first
            if id(module) == self._first:  # every pass of the step (a gradient checkpoint's recompute
                self._n += h.shape[0] * (h.shape[1] if self.per_token else 1)  # fires no hook)

    def _post(self, *_) -> None:
        if self._t0 is not None:
            if self._range is not None:  # always, with _t0: both are set in _pre
                self._range.__exit__(None, None, None)
            self._sync()
            self.steps.append((time.perf_counter() - self._t0, self._n))
        self._t0, self._n, self._range = None, 0, None

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


def syncs_per_step(prof) -> float | None:
    """CUDA calls that block the host, inside the training steps' ranges, per step."""
    events = list(prof.events())
    spans = [e.time_range for e in events if e.name == STEP_RANGE]
    if not spans:
        return None
    inside = sum(1 for e in events if e.name in SYNC_CALLS
                 and any(s.start <= e.time_range.start and e.time_range.end <= s.end for s in spans))
    return inside / len(spans)


def peak_flops(device: torch.device, dtype: torch.dtype, n: int, reps: int = 5) -> float:
    """Measured FLOP/s of an n x n x n matmul in `dtype` (the best of `reps` after a warm-up)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b  # synchronous on a CPU; on CUDA the synchronize below waits for it
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def llama_train_flops(shape: dict) -> float:
    """Useful FLOPs per token of a LoRA training step on a Llama of `shape`: the frozen decoder
    layers' linear weights twice forward-equivalent for the input gradients, 2 x 2 x N in all
    (the few LoRA weights and attention's L-dependent products are left out; the LM head runs at
    the kept positions only, so it is per sequence, not per token)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    return 4.0 * per_layer * layers


@dataclass
class Row:
    stage: str
    what: str
    device: str
    precision: str
    step_s: float | None = None
    rate: float | None = None
    unit: str = ""
    utilisation: float | None = None  # useful FLOP/s over the preflight's measured matmul rate
    syncs_per_step: float | None = None
    peak_bytes: int | None = None
    check: str = ""
    ok: bool = True

    def json(self) -> dict:
        return asdict(self)


def verdict(ok: bool, text: str) -> tuple[str, bool]:
    return f"{'PASS' if ok else 'FAIL'}: {text}", ok


def skipped(stage: str, what: str, device: str, why: str) -> Row:
    """A stage this machine cannot run (no CUDA, no bitsandbytes): said, not passed silently."""
    return Row(stage, what, device, "-", check=f"SKIP: {why}", ok=True)


def rate_text(r: float | None, unit: str) -> str:
    return "n/a" if not r else f"{r:,.0f} {unit}" if r >= 100 else f"{r:.3g} {unit}"


def table(rows: list[Row]) -> str:
    head = ["stage", "what", "device", "precision", "step (s)", "throughput", "utilisation", "syncs / step",
            "peak GPU memory", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.stage, r.what, r.device, r.precision, "n/a" if r.step_s is None else f"{r.step_s:.4f}",
                 rate_text(r.rate, r.unit), "n/a" if r.utilisation is None else f"{100 * r.utilisation:.1f}%",
                 "n/a" if r.syncs_per_step is None else f"{r.syncs_per_step:.1f}",
                 "n/a" if r.peak_bytes is None else f"{r.peak_bytes / 2**30:.2f} GiB", r.check]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
