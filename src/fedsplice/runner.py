"""Run one experiment end to end into a run directory (the simulation runtime)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedsplice import rundir
from fedsplice.algorithms import display_name
from fedsplice.config import ExperimentConfig
from fedsplice.experiment import build
from fedsplice.simulation import cold_start, run_rounds
from fedsplice.store import make_store

console = Console(stderr=True)


def _round_line(r: dict) -> str:
    s = f"round {r['round']:>3}"
    if "train_loss" in r:
        s += f"  loss {r['train_loss']:.3f}  up {r['up_bytes'] / 1e3:.1f} kB  {r['time_s']:.1f}s"
    if "gm" in r:
        s += f"  GM acc {r['gm']['accuracy']:.3f}  PM acc {r['pm']['accuracy']:.3f}"
    return s


def run_experiment(cfg: ExperimentConfig, out: Path, overwrite: bool = False, quiet: bool = False) -> dict:
    rundir.check_out(out, overwrite)  # fail before the slow build, and write nothing yet
    t0 = time.perf_counter()
    name = display_name(cfg)
    if not quiet:
        console.print(f"[bold]{name}[/] on {cfg.data.dataset} with {cfg.model.name} -> {out}")
    exp = build(cfg)
    out = rundir.prepare(out, overwrite)
    rundir.write_config(out, cfg)
    store = make_store(cfg.runtime.store, out / "client_state")
    log = rundir.MetricsLog(out / "metrics.jsonl")
    total = cfg.server.rounds * cfg.server.clients_per_round
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=quiet, transient=True) as bar:
        task = bar.add_task("client updates", total=total)

        def on_round(record: dict) -> None:
            log.append(record)
            if not quiet:
                bar.console.print(_round_line(record))

        final = run_rounds(exp, store, on_round, progress=lambda: bar.advance(task))
    records = log.records()
    last = records[-1]
    rounds = cfg.server.rounds
    results = {
        "algorithm": name,
        "method": cfg.algorithm,
        "server_optimizer": cfg.server.optimizer,
        "rounds": rounds,
        "seed": cfg.seed,
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "num_classes": len(exp.data.class_names),
        "gm": last["gm"],
        "pm": last["pm"],
        "zero_shot_gm": records[0]["gm"],
        "communication": {
            "up_bytes": final["up_bytes"], "down_bytes": final["down_bytes"],
            "up_bytes_per_round": final["up_bytes"] / rounds,
            "down_bytes_per_round": final["down_bytes"] / rounds,
            "up_bytes_per_client_round": final["up_bytes"] / (rounds * cfg.server.clients_per_round),
        },
        "params": {"global": sum(exp.init_params[n].numel() for n in exp.global_names),
                   "private": sum(exp.init_params[n].numel() for n in exp.private_names)},
    }
    if exp.holdout_ids:
        if not quiet:
            console.print(f"cold start: {len(exp.holdout_ids)} held-out clients, "
                          f"{cfg.eval.cold_start_epochs} local epochs")
        results["cold_start"] = cold_start(exp, final["global_params"])
    results["time_s"] = round(time.perf_counter() - t0, 1)
    rundir.write_results(out, results)
    rundir.plot_accuracy(out, records, name)
    return results
