"""bf16 autocast against fp32 on this CPU by model width: where runtime.precision = "auto" starts
picking bf16 for LoRA (fedsplice.model.device.CPU_BF16_MIN_WIDTH; AMX_LORA_MIN_WIDTH on a CPU with AMX).

    python benchmarks/bf16_width.py [--quick] [--threads 2] [--reps 2] [--widths 384,768,1536]

Per width h: a random 4-layer Llama (h wide, 4 query / 2 key-value heads, MLP 4h, the tiny
offline tokenizer), PFAdapter through `fedsplice.run`, 1 round of 1 client x 8 steps of 16
word-salad texts (16-32 words), in fp32 and in bf16 autocast, the two interleaved `--reps`
times; a step's time from scripts/gpu_check.py's Meter (first forward under autograd to the
optimizer's step), the median over a run's steps after the first, the best of the reps. A whole
step, not a matmul: at small widths autocast's casts and per-op costs outweigh what bf16 saves
in the matmuls. `--quick`: widths 32 and 64, 1 rep, 3 steps (a smoke run). Whether bf16 pays at
all depends on the CPU: with AVX-512 BF16 or AMX matmuls run natively in bf16; with AVX2 alone
they are emulated and slower (`grep -o avx512_bf16 /proc/cpuinfo`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    sys.path.insert(0, str(p))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from gpucheck import fixtures as fx  # noqa: E402
from gpucheck.runs import timed  # noqa: E402

from benchmarks._common import report  # noqa: E402

WIDTHS = (32, 64, 128, 192, 256, 384)


def step_time(model: Path, width: int, data: Path, work: Path, precision: str, steps: int, threads: int) -> float:
    cfg = fx.lm_config(model, data, "cpu", precision, "fp32", rounds=1, steps=steps, batch=16, small=True,
                       **{"runtime.threads": threads, "server.clients_per_round": 1})
    _, s, _ = timed(cfg, work, width)
    return s["step_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="widths 32 and 64, 1 rep, 3 steps (a smoke run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="comma-separated widths to measure")
    args = p.parse_args()
    reps, steps = (1, 3) if args.quick else (args.reps, 8)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = fx.write_text_data(work / "data", 48)
        for h in WIDTHS[:2] if args.quick else [int(w) for w in args.widths.split(",")]:
            shape = dict(hidden_size=h, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=4 * h, initializer_range=0.02)
            model = fx.llama(work, f"llama-{h}", shape, "cpu", dtype=torch.float32)
            best: dict[str, list[float]] = {"fp32": [], "bf16": []}
            for r in range(reps):
                for prec in best:
                    best[prec].append(step_time(model, h, data, work / f"{h}-{prec}-{r}", prec, steps, args.threads))
            f32, b16 = min(best["fp32"]), min(best["bf16"])
            rows.append({"width": h, "fp32 ms / step": f32 * 1e3, "bf16 ms / step": b16 * 1e3,
                         "bf16 speedup": f"{f32 / b16:.2f}x"})
            print(rows[-1], flush=True)
    report("bf16_width", rows, ["width", "fp32 ms / step", "bf16 ms / step", "bf16 speedup"], args.quick,
           [f"PFAdapter on a random 4-layer Llama per width, batch 16 (16-32 words), {steps} steps, {args.threads} "
            f"threads, best of {reps} interleaved runs", "runtime.precision = 'auto' picks bf16 on a CPU with native "
            "bf16 for a model at least fedsplice.model.device.CPU_BF16_MIN_WIDTH wide (LoRA on a CPU with AMX: "
            "AMX_LORA_MIN_WIDTH)"])


if __name__ == "__main__":
    main()
