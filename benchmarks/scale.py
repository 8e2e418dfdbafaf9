"""Time per round and peak RSS as the number of clients grows (10, 100, 1,000) and as the
clients per round grow (2, 4, 8).

    python benchmarks/scale.py [--quick]

PFAdapter on MiniLM (configs/pfadapter-minilm.toml) over the whole fortunes training set
(5,857 texts, IID so 1,000 clients each get some), PRIVATE state in the disk store
(runtime.store = "disk"), one backbone in one process, clients trained one after another.
Each setting runs in its own process (its own peak RSS). Target (issue 8): RSS at 1,000
clients ≤ RSS at 10 clients + 1 GiB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ROOT, in_subprocess, report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: tiny random models, 1 round of 2 steps, 4 clients a round")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per setting (default 3, quick 1)")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    steps = 2 if args.quick else 10
    cfg = str(ROOT / "configs" / "pfadapter-minilm.toml")
    common = [f"server.rounds={rounds}", f"eval.every={rounds}", "eval.cold_start_epochs=0",
              "data.holdout_clients=0", "data.partition='iid'", "data.max_per_class=0",
              "data.local_test_size=2", f"client.max_steps={steps}", "runtime.store='disk'"]
    settings = [(n, 4) for n in (10, 100, 1000)] + ([] if args.quick else [(100, m) for m in (2, 8)])
    rows = []
    for n, m in settings:
        r = in_subprocess("_run", {"config": cfg, "skip_round0_eval": True, "quick": args.quick,
                                   "set": common + [f"data.num_clients={n}", f"server.clients_per_round={m}"]})
        rows.append({"clients": n, "per_round": m, "train_round_s": r["mean_train_s"],
                     "round_s_with_eval": r["mean_round_s"], "setup_s": r["setup_s"], "peak_rss_mb": r["peak_rss_mb"],
                     "built_rss_mb": r["built_rss_mb"], "store_mb": r["store_bytes"] / 2**20,
                     "store_files": r["store_files"],
                     "store_kb_per_client": r["store_bytes"] / 1024 / max(r["store_files"], 1)})
        print(f"  {n} clients, {m} per round: {r['mean_train_s']:.1f} s/round, {r['peak_rss_mb']:.0f} MB", flush=True)
    rss10 = rows[0]["peak_rss_mb"]
    for r in rows:
        r["rss_vs_10_clients_mb"] = r["peak_rss_mb"] - rss10
        if r["clients"] > 10 and r["built_rss_mb"] is not None:  # what one more client holds in memory
            r["built_kb_per_added_client"] = 1024 * (r["built_rss_mb"] - rows[0]["built_rss_mb"]) / (r["clients"] - 10)
    grow = rows[2]["peak_rss_mb"] - rss10
    cols = ["clients", "per_round", "train_round_s", "round_s_with_eval", "setup_s", "peak_rss_mb",
            "rss_vs_10_clients_mb", "built_rss_mb", "built_kb_per_added_client", "store_mb", "store_files",
            "store_kb_per_client"]
    report("scale", rows, cols, args.quick, [
        f"{rounds} round(s), at most {steps} local steps of batch 16 per client (with 1,000 clients a client "
        "holds ~6 texts, so its steps are smaller: compare train_round_s across clients-per-round, not across N); "
        "train_round_s: the round without its evaluation; round_s_with_eval adds the last round's GM + PM over "
        "ALL clients (2 local test texts each), which grows with the number of clients by design: PM is over "
        "every client (each one loads its PRIVATE tensors from the disk store and scores its local test texts). "
        "No evaluation before round 1.",
        "built_rss_mb: RSS once the run is built (data, clients, model, caches; before round 1); "
        "built_kb_per_added_client: its growth over the 10-client run per added client (the peak is the "
        "training step's, which depends on the clients' sizes, not their number; the three 100-client rows "
        "build the same run, so their spread is the noise); store_mb, "
        "store_files: the disk store at the end, a file per client that has trained (its PRIVATE tensors "
        "and their optimizer state, on disk, not in memory); store_kb_per_client: store_mb per file.",
        f"target RSS(1,000) ≤ RSS(10) + 1,024 MB: {'met' if grow <= 1024 else 'missed'} ({grow:+.0f} MB)."])


if __name__ == "__main__":
    main()
