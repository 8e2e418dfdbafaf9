"""Where the time goes: one whole `fedsplice run` (interpreter start and imports included) cut
into stages, and the mean of one round, on MiniLM and on SmolLM2.

    python benchmarks/profile_run.py [--quick] [--only minilm|smollm2] [--rounds N] [--set k=v ...]
                                     [--cprofile N]

Each workload runs in a fresh process through the same code as `fedsplice run` (the runner:
build, round loop, checkpoints, cold start, results.json/csv, the plot), with wall-clock timers
wrapped around the functions that make up each stage (no change to fedsplice itself). Timers
are exclusive: a stage's seconds leave out the stages nested in it (wire encode/decode inside a
client's fit counts as serialization, not training), so the stages add up to the wall time and
"other" is what no timer covers (progress, console, glue). `--cprofile N` also runs the child
under cProfile and prints its N most expensive functions (cumulative; timers then read high).

Stages: interpreter start; imports; setup (config, data, HF backbone load, PEFT + model parts,
zero-shot caches, run directory); round-0 evaluation (GM, per-client); client training
(forward, backward, the rest: optimizer, batching, parameter loads); serialization (wire
encode/decode/compress); server (gather checks, aggregation); global evaluation (GM);
per-client evaluation (PM); checkpoint writes; metrics.jsonl; cold start; results + plot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

T_MAIN = time.time()  # before any heavy import: the child's "imports" stage starts here

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import FP32, child_or_main, run_script_child  # noqa: E402

WORKLOADS = {
    # FedAvg-LoRA on MiniLM, 10 clients (2 held out), 4 per round: the round_time / naive-loop workload
    "minilm": ("fedavg-lora-minilm.toml", []),
    # SmolLM2-135M (causal LM, verbalizer scoring): a minimal run, it is ~50x slower per step
    "smollm2": ("pfadapter-smollm2.toml", ["data.num_clients=3",
                                           "data.holdout_clients=1", "server.clients_per_round=1",
                                           "client.max_steps=2", "data.test_per_class=2",
                                           "data.local_test_size=8", "eval.cold_start_epochs=1",
                                           "client.batch_size=8"]),
}
# --quick: a smoke run on the tiny random models (benchmarks/_common.py quick_sets) with these budgets
QUICK = {"minilm": ["client.max_steps=2", "data.test_per_class=2", "data.local_test_size=4"],
         "smollm2": ["client.max_steps=1"]}

ORDER = ["interpreter start", "imports", "setup", "round-0 evaluation", "client training", "serialization",
         "server", "global evaluation (GM)", "per-client evaluation (PM)", "checkpoint writes", "metrics.jsonl",
         "cold start", "results + plot", "other"]


# ----------------------------------------------------------------------------- the child
class Timers:
    """Exclusive wall-clock time per stage name, overall and per round."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.per_round: dict[int, dict[str, float]] = {}
        self.stack: list[list] = []  # [name, seconds spent in nested stages]
        self.rnd = 0  # the round being run; -1 after the round loop
        self.post = False

    def add(self, name: str, dt: float) -> None:
        self.total[name] = self.total.get(name, 0.0) + dt
        if not self.post:
            d = self.per_round.setdefault(self.rnd, {})
            d[name] = d.get(name, 0.0) + dt

    def group(self) -> str:
        return self.stack[-1][0].split(":")[0] if self.stack else "other"

    def wrap(self, fn, name):
        """fn timed under `name` (a str, or name(*args) -> str, or a callable of the timers' state)."""
        timers = self

        def timed(*a, **k):
            n = name(*a, **k) if callable(name) else name
            timers.stack.append([n, 0.0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                _, inner = timers.stack.pop()
                timers.add(n, dt - inner)
                if timers.stack:
                    timers.stack[-1][1] += dt

        timed.__wrapped__ = fn
        return timed

    def patch(self, owner: object, attr: str, name: object) -> None:
        """owner.attr (a class in a module, a method of a class) replaced by its `wrap`: through
        setattr, as a type checker rightly refuses assignments to a class or a method."""
        setattr(owner, attr, self.wrap(getattr(owner, attr), name))


def instrument(T: Timers) -> None:
    import fedsplice.app.rundir as rundir
    import fedsplice.app.runner as runner
    import fedsplice.federation.checkpoint as ckpt
    import fedsplice.federation.experiment as experiment
    import fedsplice.federation.rounds as rounds
    import fedsplice.federation.train as train
    import fedsplice.model.taskmodel as taskmodel
    import fedsplice.runtimes.inprocess as inprocess
    from fedsplice.core import wire

    ev = lambda *a, **k: "round-0 evaluation: GM" if T.rnd == 0 else "global evaluation (GM)"  # noqa: E731

    experiment.build_data = T.wrap(experiment.build_data, "setup: data")
    taskmodel.load_backbone = T.wrap(taskmodel.load_backbone, "setup: HF backbone load")
    T.patch(experiment, "TaskModel", "setup: PEFT + model parts")
    experiment.zero_shot_caches = T.wrap(experiment.zero_shot_caches, "setup: zero-shot caches")
    runner.build = T.wrap(runner.build, "setup: other (recipe, server)")
    runner.data_table = T.wrap(runner.data_table, "setup: run directory + data report")
    runner._prepare_dir = T.wrap(runner._prepare_dir, "setup: run directory + data report")
    runner._start = T.wrap(runner._start, "setup: run directory + data report")

    orig_gather = rounds.gather

    def gather(transport, rnd, *a, **k):
        T.rnd = rnd
        return orig_gather(transport, rnd, *a, **k)

    rounds.gather = T.wrap(gather, "server: gather + checks")
    rounds.aggregate = T.wrap(rounds.aggregate, "server: aggregation")
    rounds.deltas = T.wrap(rounds.deltas, "server: aggregation")
    rounds.evaluate_global = T.wrap(rounds.evaluate_global, ev)
    inprocess.fit_client = T.wrap(inprocess.fit_client, "client training: other (params, store, optimizer, batching)")
    # inside a client's fit these are "client training: ..."; inside cold start "cold start: ..."
    train.backward = T.wrap(train.backward, lambda *a, **k: f"{T.group()}: backward")
    train.cross_entropy_objective = T.wrap(train.cross_entropy_objective,
                                           lambda *a, **k: f"{T.group()}: forward + loss")

    def task_name(task, *a, **k):
        if task == "evaluate":
            return "round-0 evaluation: per-client" if T.rnd == 0 else "per-client evaluation (PM)"
        return {"cold_start": "cold start", "personalize": "personalize"}.get(task, task)

    inprocess.client_task = T.wrap(inprocess.client_task, task_name)
    # the model's own scoring inside an evaluation stage: "<stage>: model predict" (the rest: scoring)
    T.patch(taskmodel.TaskModel, "predict", lambda *a, **k: f"{T.group()}: model predict")
    for f in ("encode", "decode", "compress", "decode_update"):
        setattr(wire, f, T.wrap(getattr(wire, f), f"serialization: wire {f}"))
    T.patch(ckpt.Checkpointer, "save", "checkpoint writes")
    T.patch(rundir.MetricsLog, "append", "metrics.jsonl")

    orig_cold = runner.cold_start

    def cold(*a, **k):
        T.post = True
        return orig_cold(*a, **k)

    runner.cold_start = T.wrap(cold, "cold start: other")
    orig_results = runner.results_table

    def results(*a, **k):
        T.post = True
        return orig_results(*a, **k)

    runner.results_table = T.wrap(results, "results + plot: results table")
    rundir.write_results = T.wrap(rundir.write_results, "results + plot: results.json/csv")
    rundir.plot_accuracy = T.wrap(rundir.plot_accuracy, "results + plot: plot (matplotlib)")


def child(job: dict) -> None:
    import tempfile

    t_start = job["t_launch"]
    T = Timers()
    T.add("interpreter start", T_MAIN - t_start)
    t0 = time.perf_counter()
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import fedsplice.app.runner  # noqa: F401
    from fedsplice.federation.validate import load_config
    T.add("imports", time.perf_counter() - t0)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    instrument(T)
    from fedsplice.app.runner import run_experiment

    prof = None
    if job.get("cprofile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t1 = time.perf_counter()
    cfg = load_config(Path(job["config"]), FP32 + job["set"])
    T.add("setup: config", time.perf_counter() - t1)
    with tempfile.TemporaryDirectory() as tmp:
        res = T.wrap(run_experiment, "other")(cfg, Path(tmp) / "run", quiet=False)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(job["cprofile"])
        print(s.getvalue(), file=sys.stderr)
    wall = time.time() - t_start
    print(json.dumps({"wall_s": wall, "stages": T.total, "per_round": T.per_round,
                      "gm_accuracy": res["gm"]["accuracy"], "pm_accuracy": res["pm"]["accuracy"],
                      "threads": torch.get_num_threads()}))


# ----------------------------------------------------------------------------- the parent
def run_child(job: dict) -> dict:
    out, err = run_script_child(__file__, {**job, "t_launch": time.time()})
    if job.get("cprofile"):
        print(err[err.find("   ncalls"):] if "ncalls" in err else err[-6000:])
    return out


def group_of(name: str) -> str:
    return name.split(":")[0]


def main() -> None:
    from benchmarks._common import ROOT, quick_sets, report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny random models, fewer steps")
    ap.add_argument("--only", action="append", default=[], choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default: minilm 3, smollm2 2; quick 2 / 1)")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides for every workload")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the child (0: torch's default)")
    ap.add_argument("--cprofile", type=int, default=0, help="also print the N top functions (cumulative)")
    args = ap.parse_args()
    load = os.getloadavg()
    rows, detail = [], []
    for name, (cfg_name, extra) in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        rounds = args.rounds or {"minilm": 3, "smollm2": 2}[name] - (1 if args.quick else 0)
        config = ROOT / "configs" / cfg_name
        tiny = quick_sets(config, Path(tempfile.mkdtemp(prefix="profile-quick-")), budget=False) if args.quick else []
        sets = tiny + extra + [f"server.rounds={rounds}"] + (QUICK[name] if args.quick else []) + args.set
        r = run_child({"config": str(ROOT / "configs" / cfg_name), "set": sets, "threads": args.threads,
                       "cprofile": args.cprofile})
        wall, st = r["wall_s"], r["stages"]
        st["other"] = st.get("other", 0.0) + wall - sum(st.values())  # what no timer covers
        groups: dict[str, float] = {}
        for k, v in st.items():
            groups[group_of(k)] = groups.get(group_of(k), 0.0) + v
        label = f"{name} ({rounds} rounds)"
        for g in sorted(groups, key=lambda g: ORDER.index(g) if g in ORDER else 99):
            rows.append({"workload": label, "stage": g, "seconds": groups[g],
                         "share": f"{100 * groups[g] / wall:.1f}%"})
        rows.append({"workload": label, "stage": "**total (wall)**", "seconds": wall, "share": "100%"})
        # one round: the mean over rounds 1..R of each stage
        per = {int(k): v for k, v in r["per_round"].items() if int(k) >= 1}
        mean: dict[str, float] = {}
        for d in per.values():
            for k, v in d.items():
                mean[k] = mean.get(k, 0.0) + v / len(per)
        rnd_total = sum(mean.values())
        for k in sorted(mean, key=lambda k: (ORDER.index(group_of(k)) if group_of(k) in ORDER else 99, k)):
            detail.append({"workload": label, "part": "one round (mean of rounds 1..R)", "stage": k, "seconds": mean[k],
                           "share": f"{100 * mean[k] / rnd_total:.1f}%"})
        detail.append({"workload": label, "part": "one round (mean of rounds 1..R)", "stage": "**round total**",
                       "seconds": rnd_total, "share": "100%"})
        for k in sorted(st, key=lambda k: (ORDER.index(group_of(k)) if group_of(k) in ORDER else 99, k)):
            if ":" in k:
                detail.append({"workload": label, "part": "whole run, detail", "stage": k, "seconds": st[k],
                               "share": f"{100 * st[k] / wall:.1f}%"})
        print(f"  {label}: wall {wall:.1f} s, GM {r['gm_accuracy']:.3f}, threads {r['threads']}", flush=True)
    load_after = os.getloadavg()
    notes = [f"load average (1 min) {load[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} cpus: "
             "other processes share this machine, so read shares of wall time rather than absolute seconds.",
             "Whole run as `fedsplice run` does it (runner.run_experiment, in-process runtime, checkpoint every "
             "round, cold start of the held-out clients, results.json/csv and the plot), in a fresh process; "
             "interpreter start and imports included. Timers are exclusive (nested stages are not double-counted); "
             "'other' is what no timer covers (progress lines, console, glue).",
             "minilm: configs/fedavg-lora-minilm.toml (FedAvg-LoRA, 10 clients, 2 held out, 4 per round, 10 steps "
             "of 16, eval every round); smollm2: configs/pfadapter-smollm2.toml (PFAdapter), 3 clients "
             "(1 held out), 1 per round, 2 steps of 8, 2 test texts a class, 1 cold-start epoch.",
             "'model predict' is TaskModel.predict inside that stage; the stage's other seconds are parameter "
             "loads and scoring (metrics)."]
    cols = ["workload", "stage", "seconds", "share"]
    md = report("profile_run", rows, cols, args.quick, notes)
    # the detail table goes under the main one in the same .md (the .csv keeps the main table)
    from benchmarks._common import RESULTS, fmt
    from fedsplice.data.assets import atomic_write_bytes

    dcols = ["workload", "part", "stage", "seconds", "share"]
    table = ["| " + " | ".join(dcols) + " |", "|" + "---|" * len(dcols)]
    table += ["| " + " | ".join(fmt(r[c]) for c in dcols) + " |" for r in detail]
    detail_md = "\n## Detail: one round, and every timed stage of the whole run\n\n" + "\n".join(table) + "\n"
    print(detail_md)
    stem = "profile_run" + ("-quick" if args.quick else "")
    atomic_write_bytes(RESULTS / f"{stem}.md", (md + detail_md).encode())


if __name__ == "__main__":
    child_or_main(child, main)
