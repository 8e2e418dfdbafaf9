"""The cost of Flower's SecAgg+ (privacy.secure_aggregation) per round, against plain Flower, on a
real local deployment (`fedsplice flower up`: SuperLink + N SuperNodes on 127.0.0.1, TLS on).

    python benchmarks/secagg.py [--quick] [--nodes 3,5,10] [--rounds 3]

PFAdapter on the shipped MiniLM config, one client per SuperNode, every client sampled every
round (N clients, clients_per_round = N), the same seed for both runs of a pair. Per run: the
median wall time of a round's fit (metrics.jsonl time_s of rounds >= 2: round 1 pays the nodes'
warm-up), the bytes one client sends and receives per round (every message of the four SecAgg+
stages, as serialized by Flower), and the final GM/PM (equal within SecAgg+'s quantization).
Runs one at a time; each run's processes are its own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import FP32, ROOT, quick_sets, report  # noqa: E402

CONFIG = ROOT / "configs" / "pfadapter-minilm.toml"


def one(n: int, rounds: int, secure: bool, quick: bool) -> dict:
    import json

    from fedsplice.app.flower import launcher
    from fedsplice.federation.validate import load_config

    sets = [f"data.num_clients={n}", "data.holdout_clients=0", f"server.clients_per_round={n}",
            f"server.rounds={rounds}", f"eval.every={rounds}", "eval.cold_start_epochs=0",
            f"privacy.secure_aggregation={'true' if secure else 'false'}"]
    # quick: a smoke run on the tiny model (rounds and clients stay the command line's)
    tiny = quick_sets(CONFIG, Path(tempfile.mkdtemp(prefix="secagg-quick-")), budget=False) if quick else []
    sets = tiny + sets + (["client.max_steps=2", "data.test_per_class=2", "data.local_test_size=4"] if quick
                          else ["client.max_steps=8"])
    cfg = load_config(CONFIG, FP32 + sets)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        t0 = time.perf_counter()
        res = launcher.up(cfg, out, launcher.Launch(supernodes=n, overwrite=True, quiet=True))
        wall = time.perf_counter() - t0
        recs = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()][1:]
    later = [r["time_s"] for r in recs if r["round"] >= 2] or [r["time_s"] for r in recs]
    return {"supernodes": n, "aggregation": "SecAgg+" if secure else "plain",
            "round_s": statistics.median(later),
            "up_kb_per_client_round": sum(r["up_bytes"] for r in recs) / (n * len(recs)) / 1e3,
            "down_kb_per_client_round": sum(r["down_bytes"] for r in recs) / (n * len(recs)) / 1e3,
            "gm_accuracy": res["gm"]["accuracy"], "pm_accuracy": res["pm"]["accuracy"], "run_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny random model, 3 SuperNodes, 2 rounds")
    ap.add_argument("--nodes", default="", help="SuperNode counts (comma list; default 3,5,10, quick 3)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 3, quick 2)")
    args = ap.parse_args()
    args.nodes = args.nodes or ("3" if args.quick else "3,5,10")
    args.rounds = args.rounds or (2 if args.quick else 3)
    rows = []
    for n in [int(x) for x in args.nodes.split(",")]:
        pair = {}
        for secure in (False, True):
            r = pair[secure] = one(n, args.rounds, secure, args.quick)
            print(f"  {n} nodes, {r['aggregation']}: {r['round_s']:.2f} s/round, up {r['up_kb_per_client_round']:.0f} "
                  f"kB/client/round, GM {r['gm_accuracy']:.3f} PM {r['pm_accuracy']:.3f}", flush=True)
            rows.append(r)
        s, p = pair[True], pair[False]
        s["time_overhead"] = f"{s['round_s'] / p['round_s']:.2f}x"
        s["up_overhead"] = f"{s['up_kb_per_client_round'] / p['up_kb_per_client_round']:.2f}x"
        s["down_overhead"] = f"{s['down_kb_per_client_round'] / p['down_kb_per_client_round']:.2f}x"
    cols = ["supernodes", "aggregation", "round_s", "time_overhead", "up_kb_per_client_round", "up_overhead",
            "down_kb_per_client_round", "down_overhead", "gm_accuracy", "pm_accuracy", "run_s"]
    notes = [f"PFAdapter, {CONFIG.name}, {args.rounds} rounds, every client every round, one client per "
             "SuperNode, TLS on, SecAgg+ with privacy.secagg_* defaults (shares: all sampled clients, "
             "threshold: half, clipping range 8, 2^22 levels)",
             "round_s: median fit time of rounds >= 2 (ServerApp's round loop: the messages, local training, "
             "aggregation); kB: serialized Flower messages per client per round",
             "SecAgg+ uploads the update's masked vector (int64 per coordinate, vs fp32) plus keys and shares"]
    report("secagg" + ("" if args.nodes == "3,5,10" else "-" + args.nodes.replace(",", "-")), rows, cols,
           args.quick, notes, "secagg")


if __name__ == "__main__":
    main()
