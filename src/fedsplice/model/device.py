"""Where a model runs and in what precision: `runtime.device`, `runtime.precision`, `model.dtype`.

The model, its PEFT tensors and the training loop live on the resolved device; everything that
leaves a client (uploads, stored PRIVATE state, metrics) is moved back to the CPU in float32, so
the store, the wire and the server's float64 math never see a device tensor.

Mixed precision is autocast over the forward and backward passes: the trainable tensors stay
fp32 (master copies the optimizer steps), matmuls run in bf16 / fp16; fp16 adds a gradient
scaler. `model.dtype` is separate: the frozen base weights' own dtype (bf16 halves their memory).
"""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from pathlib import Path

import torch

from fedsplice.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str, field: str = "runtime.device") -> torch.device:
    """"auto": CUDA when present, else MPS, else CPU. A device this machine lacks is an error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"{field} = {name!r}: this machine has no CUDA device (torch.cuda.is_available() "
                              f"is False; torch {torch.__version__}); use 'auto' or 'cpu'")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"{field} = {name!r}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError(f"{field} = 'mps': this machine has no Apple MPS device; use 'auto' or 'cpu'")
    return dev


# Under bf16 autocast a CPU matmul runs in oneDNN, and torch keeps two caches of its compiled kernels
# (oneDNN's and ideep's), 1,024 each by default, each kernel with its own code and buffers. Unpadded
# batches give every sequence length a shape of its own, so both fill: on PFAdapter / MiniLM (3
# rounds, bf16) they held about 800 MB, peak RSS 1,900 MB against 1,070 MB at 64 entries, for 8-10%
# more time a round from the kernels rebuilt (benchmarks/kernel_cache.py). An fp32 matmul uses
# neither. The user's own values of the two variables win.
KERNEL_CACHE = 64
KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches() -> None:
    """Cap both kernel caches at KERNEL_CACHE entries unless the environment sets them. Each cache
    reads its variable when it is first used, so this acts only before the process's first
    oneDNN kernel (`load_pretrained` calls it as a model loads)."""
    for var in KERNEL_CACHE_VARS:
        os.environ.setdefault(var, str(KERNEL_CACHE))


def cpu_bf16() -> str | None:
    """How the CPU computes bf16 natively: "amx" (AMX, Intel Xeon from Sapphire Rapids on),
    "avx512" (AVX-512 BF16 without AMX, e.g. AMD Zen 4), None (AVX2 alone: emulated, slower than
    fp32; bf16 autocast never pays)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    if re.search(r"\bamx_bf16\b", flags):
        return "amx"
    return "avx512" if re.search(r"\bavx512_bf16\b", flags) else None


# bf16 pays on a CPU only for a model wide enough that autocast's casts and per-op costs weigh less
# than what bf16 saves in the matmuls; where that starts depends on the CPU's fp32 rate.
# `python benchmarks/bf16_width.py` (PFAdapter steps of 16 short texts on 4-layer Llamas, 2 threads):
# - "avx512", a 2-core AMD EPYC: bf16 at 0.57x fp32's step speed at width 32, 0.76x at 128, 1.22x
#   at 192, 1.62x at 384 (MiniLM, 384 wide, trains 1.71x faster, benchmarks/precision.py);
# - "amx", a 2-core Intel Xeon, whose fp32 steps run 2x the EPYC's: 0.78x at 384, 0.92x at 512,
#   1.03x at 576, 1.10x at 640, 1.28x at 768, 2.05x at 1536 (FedAvg-LoRA on MiniLM trains 0.66x,
#   PFAdapter on SmolLM2-135M, 576 wide with a narrower MLP, 0.85x). That is LoRA's cost: its rank-r
#   matmuls and the casts of its fp32 factors in every layer, which AMX does not speed up. A run
#   that trains no LoRA runs only the frozen model's matmuls in bf16: FedPuReL-prompt on MiniLM
#   ran a round 1.31x faster in bf16 there (benchmarks/round_time.py). docs/performance.md has the tables.
CPU_BF16_MIN_WIDTH = {"avx512": 192, "amx": 192}
AMX_LORA_MIN_WIDTH = 768  # LoRA on an "amx" CPU


def resolve_precision(name: str, device: torch.device, width: int | None = None, lora: bool = False) -> torch.dtype:
    """The autocast dtype ("fp32": none). "auto" (the default): bf16 where it measured faster
    than fp32, else fp32 (fp16 is never chosen for you: it needs loss scaling):
    - a CUDA device with native bf16 (compute capability 8.0+, Ampere on). `device`'s own
      capability is asked, not GPU 0's, and emulated bf16 (`torch.cuda.is_bf16_supported()`
      says True for it on older GPUs) does not count: it is slower than fp32. "auto" on CUDA also
      lets fp32 matmuls (those outside autocast) use TF32, a process-wide switch
      (torch.backends.cuda.matmul.fp32_precision); "fp32" keeps them IEEE;
    - a CPU with native bf16, for a model whose widest tower is `width` >= CPU_BF16_MIN_WIDTH of
      that CPU's kind, or AMX_LORA_MIN_WIDTH for a run with LoRA configured (`lora`) on a CPU with
      AMX (None: not known, taken as wide)."""
    if name == "auto":
        if device.type == "cuda":
            torch.backends.cuda.matmul.fp32_precision = "tf32"
            return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float32
        kind = cpu_bf16() if device.type == "cpu" else None
        if kind is None:
            return torch.float32
        least = AMX_LORA_MIN_WIDTH if kind == "amx" and lora else CPU_BF16_MIN_WIDTH[kind]
        return torch.bfloat16 if width is None or width >= least else torch.float32
    if name == "fp16" and device.type == "mps":
        raise ConfigError("runtime.precision = 'fp16' is not supported on MPS here; use 'fp32'")
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """torch.autocast for `dtype` on `device`; a no-op context for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, dtype: torch.dtype):
    """fp16 needs its gradients scaled (they underflow otherwise); None for bf16 / fp32. A client
    trains a few steps a round with a fresh scaler, so it starts at 2^10, not torch's 2^16: at
    2^16 the first steps of a round overflowed and were skipped (tests/test_hardware.py's tiny
    FedPuReL run lost every step that way); an overflow still skips its step and halves the scale."""
    if dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
