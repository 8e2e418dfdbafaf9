"""Bytes per round by method, and with a compressed upload (fp16; int8 + error feedback), against
the accuracy it costs.

    python benchmarks/comm.py [--quick]

FedAvg-LoRA and PFAdapter on the shipped MiniLM configs (same data, clients, sampling and
seed), each with client.upload = fp32 / fp16 / int8. Bytes are the measured serialized
uploads (safetensors, headers included), averaged over rounds. Target (issue 8): a compressed
upload ≤ 25% of FedAvg-LoRA's fp32 bytes at ≤ 0.5 points of accuracy lost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ROOT, in_subprocess, report  # noqa: E402

METHODS = {"FedAvg-LoRA": "fedavg-lora-minilm.toml", "PFAdapter": "pfadapter-minilm.toml"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny random models, 2 short rounds")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per run (default 5, quick 2)")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    common = [f"server.rounds={rounds}", f"eval.every={rounds}", "eval.cold_start_epochs=0", "data.holdout_clients=0"]
    rows = []
    for method, cfg in METHODS.items():
        for codec in ("fp32", "fp16", "int8"):
            r = in_subprocess("_run", {"config": str(ROOT / "configs" / cfg), "quick": args.quick,
                                       "set": common + [f"client.upload='{codec}'"]})
            rows.append({"method": method, "upload": codec, "up_bytes_per_round": int(r["up_bytes_per_round"]),
                         "gm_accuracy": r["gm_accuracy"], "pm_accuracy": r["pm_accuracy"]})
            print(f"  {method} {codec}: {rows[-1]['up_bytes_per_round']:,} B/round, GM {r['gm_accuracy']:.3f}",
                  flush=True)
    ref = rows[0]["up_bytes_per_round"]
    base = {r["method"]: r for r in rows if r["upload"] == "fp32"}
    for r in rows:
        r["vs_fedavg_lora_fp32"] = r["up_bytes_per_round"] / ref
        b = base[r["method"]]
        r["gm_loss_pts"] = 100 * (b["gm_accuracy"] - r["gm_accuracy"])
        r["pm_loss_pts"] = 100 * (b["pm_accuracy"] - r["pm_accuracy"])
        if r["upload"] != "fp32":
            ok = r["vs_fedavg_lora_fp32"] <= 0.25 and r["gm_loss_pts"] <= 0.5 and r["pm_loss_pts"] <= 0.5
            r["target ≤25% at ≤0.5 pts"] = "yes" if ok else "no"
    report("comm", rows, ["method", "upload", "up_bytes_per_round", "vs_fedavg_lora_fp32", "gm_accuracy",
                          "gm_loss_pts", "pm_accuracy", "pm_loss_pts", "target ≤25% at ≤0.5 pts"], args.quick, [
        f"{rounds} rounds, 4 of 10 clients per round, MiniLM, LoRA r=8 on q,k,v,o; accuracy after the last round "
        f"(GM: global test set, 380 texts; PM: mean over the 10 clients' local test sets).",
        "fp16 / int8 send the round's update (trained − received); int8: one float32 scale per tensor, the "
        "rounding error is kept on the client and added to its next update (error feedback).",
        "loss_pts: accuracy points lost against the same method's fp32 run (negative = gained)."])


if __name__ == "__main__":
    main()
