"""Where a CPU without AVX-512 computes other last bits: single ops, then the VLM path stage by
stage (scripts/regression.py's tolerances rest on this).

    python benchmarks/isa_kernels.py [--quick]

Each part runs twice, in a fresh process per kernel set (one torch thread): the machine's own
kernels, and torch / MKL / oneDNN / numpy held to AVX2 (scripts/regression.py ISAS["avx2"]). The
table gives, per tensor, whether the two are bitwise equal and their largest difference relative
to the tensor's largest value.
  ops   softmax, log_softmax, scaled-dot-product attention, matmul, linear, exp, silu, sums on
        seeded random inputs;
  vlm   fedavg-lora-easyvqa at the regression budget, client 3's first 4 training samples: the
        image, the processor's pixels, the vision tower, the projector, the dequantised GGUF
        weights, then every module of SmolLM2 in call order up to the first that differs, and
        the logits and loss (skipped by --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ROOT, report  # noqa: E402


def ops() -> dict:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 9, 40, 64, generator=g) for _ in range(3))
    x, w = torch.randn(64, 576, generator=g), torch.randn(576, 576, generator=g)
    return {"softmax": torch.softmax(q @ k.transpose(-1, -2) / 8, -1), "log_softmax": F.log_softmax(x, -1),
            "attention (sdpa)": F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "matmul": q @ k.transpose(-1, -2), "linear": F.linear(x, w), "exp": torch.exp(q), "silu": F.silu(x),
            "sum": x.sum(-1), "mean of squares (rmsnorm)": x.pow(2).mean(-1)}


def vlm() -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F

    import fedsplice
    from fedsplice.federation.experiment import build
    from fedsplice.model.vision import pixel_values

    sys.path.insert(0, str(ROOT / "scripts"))
    import regression

    stem = "fedavg-lora-easyvqa"
    exp = build(fedsplice.load_config(ROOT / "configs" / f"{stem}.toml", regression.overrides(stem)))
    m = exp.model.eval()
    vision, projector = m.vision, m.projector
    assert vision is not None and projector is not None  # a vlm config: a vision tower and its projector
    idx = exp.clients[3].train_idx[:4]
    items, y = [exp.data.train_texts[i] for i in idx], torch.as_tensor(exp.data.train_labels[idx])
    out = {"image": torch.as_tensor(np.stack([np.asarray(s.image, dtype=np.float32) for s in items]))}
    out["pixel values"] = pixel_values(m.image_processor, items, vision)
    with torch.no_grad():
        out["vision tower"] = vision(pixel_values=out["pixel values"]).last_hidden_state
        out["projector"] = projector(out["vision tower"])
    out["LM weights (dequantised)"] = torch.cat([t.float().reshape(-1)
                                                 for n, t in sorted(m.backbone.state_dict().items())
                                                 if "lora_" not in n])
    trace: dict[str, torch.Tensor] = {}

    def hook(mod, inp, o, name):
        o = o[0] if isinstance(o, tuple) else o
        if torch.is_tensor(o) and name not in trace:
            trace[name] = o.detach().clone()

    for name, mod in m.backbone.named_modules():
        if name and "lora_" not in name and "dropout" not in name.lower():
            mod.register_forward_hook(lambda mod, i, o, name=name: hook(mod, i, o, name))
    with torch.no_grad():
        logits = m(items)
    out.update({f"LM: {n.removeprefix('base_model.model.')}": t for n, t in trace.items()})
    out["logits"], out["loss"] = logits, F.cross_entropy(logits, y).reshape(1)
    return out


def child(part: str, dest: str) -> None:
    import torch

    torch.set_num_threads(1)
    torch.save(ops() if part == "ops" else vlm(), dest)


def compare(part: str, a: dict, b: dict) -> list[dict]:
    rows, lm_shown = [], False
    for name, x in a.items():
        y = b[name]
        equal = x.shape == y.shape and bool((x == y).all())
        rel = (float((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30))
               if not equal else 0.0)
        if name.startswith("LM: "):  # the module trace: up to the first module that differs
            if lm_shown:
                continue
            lm_shown = not equal
            if equal and not name.endswith("layers.0.input_layernorm"):
                continue
        rows.append({"part": part, "tensor": name, "bitwise equal": "yes" if equal else "no",
                     "largest difference, relative": "0" if equal else f"{rel:.1e}"})
    return rows


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the single ops only")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import regression
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("ops",) if args.quick else ("ops", "vlm"):
            got = {}
            for isa, env in regression.ISAS.items():
                dest = str(Path(tmp) / f"{part}-{isa}.pt")
                subprocess.run([sys.executable, __file__, "--child", part, dest], cwd=ROOT, check=True,
                               env={**os.environ, **regression.ENV, **env}, capture_output=True)
                got[isa] = torch.load(dest)
            rows += compare(part, got["default"], got["avx2"])
    cpu = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         capture_output=True, text=True).stdout.strip()
    report("isa_kernels", rows, list(rows[0]), args.quick, [
        f"this CPU's own kernels: torch dispatch {cpu}; against avx2: {json.dumps(regression.ISAS['avx2'])}",
        "LM rows: SmolLM2's modules in call order, from layer 0's input norm to the first one that differs; "
        "the modules between them (q, k, v projections) are bitwise equal. The attention core (sdpa) is no module: "
        "its difference shows first in o_proj, whose input it is"])


if __name__ == "__main__":
    main()
