"""The GPU acceptance check (issue 27): fedsplice's training path on one CUDA device, stage by
stage, on random-weight models of real shapes; a table (markdown and JSON) and an exit code.

    python scripts/gpu_check.py                          # every stage on cuda
    python scripts/gpu_check.py --only preflight,parity  # some stages (a short lease)
    python scripts/gpu_check.py --json gpu.json --out gpu.md
    python scripts/gpu_check.py --device cpu --small     # this CPU, tiny shapes: the same code

What the machine needs: Python 3.11+, torch, transformers 5, peft, safetensors, tokenizers,
numpy and Pillow (bitsandbytes for the quant and memory stages: without it they say SKIP). The
check needs no registry, hub or download, and not this repository's venv: it puts the checkout's
`src` on sys.path itself, so the working tree is all that travels. It never reads the zoo: the
weights are random, built on the device in a temporary folder (`fedsplice.data.tiny` with real
shapes; the tiny offline tokenizer, 633 words, stands in for every tokenizer, while the models
keep their real vocabulary sizes where a stage says so), and the data are synthetic (4 topics of
word-salad sentences; 4 colours of noise; questions about the colours for the VLM). Settings come
from the shipped configs; only the model, the data and the budget are replaced.

Stages (gpucheck/stages.py, gpucheck/scale.py, gpucheck/clients.py), in order:
  preflight      versions; what precision "auto" resolves to; the bf16 and fp32 matmul rate
                 (8192^3), the peak that utilisation is measured against
  parity         tiny BERT, Llama, CLIP, 1 round: CUDA fp32 = CPU fp32 within 1e-3 (losses
                 relative; accuracy, macro-F1 absolute); on a CPU: bf16 within 5e-2 of fp32
  precision      Qwen2-1.5B-shaped Llama (PFAdapter) and ViT-B/16-shaped CLIP (FedPuReL-LoRA),
                 2 rounds in --precision: finite losses; then fp16, whose scaler must step
  quant          nf4 and int8 bases: LoRA A and B both move; names equal the unquantized model's;
                 a round trip into a fresh quantized model is exact (tensors and predictions)
  checkpointing  2-word answers (the verbalizer's full path), real vocabulary: on = off, and on
                 CUDA less peak memory
  throughput     batch x length sweep (8x256, 16x512, 32x512) on the 1.5B shape with its real
                 vocabulary: tokens/s, utilisation, syncs per step (profiler, first point)
  memory         configs/pfadapter-qwen2-7b-nf4.toml on Qwen2-7B + SigLIP-so400m shapes under
                 a 48 GiB cap (--mem-cap-gib)
  workers        runtime.workers = 2 on the one device = workers = 1
  clients        8, 32, 128 clients a round on the Qwen2-1.5B shape (PFAdapter), one after another
                 and together (runtime.batch_train): clients trained per hour, peak memory and
                 memory per added client; the two agree (gpucheck/clients.py)

Utilisation = tokens/s x 4 N (N: the decoder layers' linear weights; a LoRA step's forward and
input-gradient matmuls) / the preflight's matmul rate at the same precision. A step runs from the
first forward under autograd to the optimizer's step; the first step is left out. Exit status: 0
every row PASS or SKIP, 1 a row FAILed (an exception inside a stage is that stage's FAIL row),
2 the device is missing or a config was refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "MPLBACKEND": "Agg", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ.setdefault(_k, _v)  # no hub, no download, no progress bars
HERE = Path(__file__).resolve().parent
for _p in (HERE.parent / "src", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))  # a checkout that was not `pip install`ed; the gpucheck package

import torch  # noqa: E402
from gpucheck import clients, scale, stages  # noqa: E402
from gpucheck.measure import Row, table  # noqa: E402
from gpucheck.runs import Ctx  # noqa: E402

STAGES = {"preflight": stages.preflight, "parity": stages.parity, "precision": stages.precision,
          "quant": stages.quant, "checkpointing": scale.checkpointing, "throughput": scale.throughput,
          "memory": scale.memory, "workers": stages.workers, "clients": clients.clients}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--small", action="store_true", help="tiny shapes: a quick run of the same code (CPU tests)")
    p.add_argument("--only", default=",".join(STAGES), help=f"comma-separated stages (default all: {','.join(STAGES)})")
    p.add_argument("--out", type=Path, help="also write the table as markdown to this file")
    p.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="runtime.precision and model.dtype of the real-shape runs (default bf16)")
    p.add_argument("--steps", type=int, default=None, help="steps per client and round (default 6; --small 2)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 16; --small 8)")
    p.add_argument("--mem-cap-gib", type=float, default=48.0, help="the memory stage's cap (default 48)")
    p.add_argument("--workdir", type=Path, help="keep the models, data and runs here (default: a temp folder)")
    args = p.parse_args(argv)
    args.steps, args.batch = args.steps or (2 if args.small else 6), args.batch or (8 if args.small else 16)
    args.stages = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in args.stages if s not in STAGES]
    if bad or not args.stages:
        p.error(f"--only {args.only!r}: unknown stage(s) {bad}; use some of {', '.join(STAGES)}")
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


def run_stages(args, work: Path) -> list[Row]:
    """Each chosen stage in order; a stage that raises (not a refused config) becomes its FAIL row."""
    from fedsplice.errors import FedspliceError

    ctx, rows = Ctx(args.device, args.small, work, args.precision, args.steps, args.batch, args.mem_cap_gib), []
    for name in args.stages:
        t0 = time.perf_counter()
        try:
            got = STAGES[name](ctx)
        except FedspliceError:
            raise
        except Exception as e:  # noqa: BLE001 -- the table must say which stage broke, and go on
            last = traceback.extract_tb(e.__traceback__)[-1]
            got = [Row(name, "the stage raised", args.device, "-",
                       check=f"FAIL: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                             f"({Path(last.filename).name}:{last.lineno})", ok=False)]
        rows += got
        print(f"gpu_check: {name}: {time.perf_counter() - t0:.0f} s, "
              f"{sum(not r.ok for r in got)} of {len(got)} rows failed", file=sys.stderr, flush=True)
    return rows


def header(args, device: torch.device, seconds: float) -> str:
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    shapes = ("tiny shapes (--small)" if args.small
              else "real shapes (Qwen2-1.5B, ViT-B/16, Qwen2-7B + so400m)")
    return (f"`python scripts/gpu_check.py --device {args.device}{' --small' if args.small else ''} --only "
            f"{','.join(args.stages)}` on {where}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, {seconds:.0f} s in all. RANDOM weights, {shapes}; the tiny offline "
            f"tokenizer (633 words); synthetic data; {args.steps} steps of {args.batch} per client where a stage "
            f"does not say otherwise. Step time: median after the first step.")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: a reader never sees half a table


def main(argv=None) -> int:
    args = parse(argv)
    device = check_device(args.device)
    from fedsplice.errors import FedspliceError

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        try:
            rows = run_stages(args, args.workdir or Path(tmp))
        except FedspliceError as e:
            print(f"gpu_check: {e}", file=sys.stderr)
            return 2
    head = header(args, device, time.perf_counter() - t0)
    text = head + "\n\n" + table(rows) + "\n"
    print(text)
    if args.out:
        write(args.out, text)
    if args.json:
        write(args.json, json.dumps({"header": head, "rows": [r.json() for r in rows]}, indent=1) + "\n")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
