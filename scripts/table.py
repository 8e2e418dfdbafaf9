"""Print a markdown table (GM, PM, bytes) from run directories' results.json.

    for c in pfadapter fedavg-lora fedyogi-lora local; do
        fedsplice run configs/$c-minilm.toml --out runs/table/$c --overwrite; done
    python scripts/table.py runs/table/*
"""

import json
import sys
from pathlib import Path


def main(dirs: list[str]) -> None:
    print("| method | GM acc | GM F1 | PM acc (mean ± std) | PM min | PM F1 | cold start 0→5 ep | up kB/round | vs FedAvg-LoRA |")
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
    main(sys.argv[1:])
