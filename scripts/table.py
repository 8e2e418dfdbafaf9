"""Print a markdown table (GM, PM, bytes) from run directories' results.json.

    for c in pfadapter fedavg-lora fedyogi-lora local; do
        fedsplice run configs/$c-minilm.toml --out runs/table/$c --overwrite; done
    python scripts/table.py runs/table/*
"""

import json
import sys
from pathlib import Path


def fmt(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def longtail(dirs: list[str]) -> None:
    print("| method | GM all | GM many | GM med | GM few | GM β(0.1) | GM head bias "
          "| PM all | PM many | PM med | PM few | PM β(0.1) | up kB/round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in dirs:
        r = json.loads((Path(d) / "results.json").read_text())
        gm, pm = r["gm"], r["pm"]
        cells = [fmt(gm[k]) for k in ("accuracy", "many", "medium", "few", "balancedness_0.1", "head_bias")]
        cells += [fmt(pm[k]) for k in ("accuracy", "many", "medium", "few", "balancedness_0.1")]
        up = r["communication"]["up_bytes_per_round"]
        print(f"| {r['algorithm']} | " + " | ".join(cells) + f" | {up / 1e3:.1f} |")


def main(dirs: list[str]) -> None:
    print("| method | GM acc | GM F1 | PM acc (mean ± std) | PM min | PM F1 | cold start 0→5 ep | up kB/round "
          "| vs FedAvg-LoRA |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [json.loads((Path(d) / "results.json").read_text()) for d in dirs]
    ref = next((r["communication"]["up_bytes"] for r in rows if r["algorithm"] == "fedavg-lora"), None)
    for r in rows:
        gm, pm, c = r["gm"], r["pm"], r["communication"]
        cs = r.get("cold_start", {}).get("accuracy")
        cold = f"{cs[0]:.3f}→{cs[-1]:.3f}" if cs else "–"
        rel = f"{100 * c['up_bytes'] / ref:.1f}%" if ref else "–"
        print(f"| {r['algorithm']} | {gm['accuracy']:.3f} | {gm['f1_macro']:.3f} | "
              f"{pm['accuracy']:.3f} ± {pm['accuracy_std']:.3f} | {pm['accuracy_min']:.3f} | "
              f"{pm['f1_macro']:.3f} | {cold} | {c['up_bytes_per_round'] / 1e3:.1f} | {rel} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--longtail"]:
        longtail(sys.argv[2:])
    else:
        main(sys.argv[1:])
