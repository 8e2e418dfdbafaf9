"""Run one experiment end to end into a run directory, on any runtime (in-process by default).

The steps: check the run directory -> build the experiment -> start afresh or restore the last
checkpoint -> the round loop (or one evaluation) -> the client stages after it (personalize,
cold start) -> results.json, results.csv and the plot. Every client-side stage goes through the
runtime's transport, so on Flower it runs on the SuperNodes.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedsplice.algorithms import display_name
from fedsplice.app import rundir
from fedsplice.config import ExperimentConfig
from fedsplice.data.scenarios import summary_line
from fedsplice.data.zoo import random_label, random_weights
from fedsplice.errors import ConfigError
from fedsplice.federation import build, cold_start, evaluate_only, make_store, personalization, run_rounds
from fedsplice.federation import checkpoint as ckpt
from fedsplice.federation.validate import load_config
from fedsplice.runtimes.inprocess import InProcess

console = Console(stderr=True)


def print_table(results: dict) -> None:
    """The end-of-run summary: GM and PM, traffic, and the random-weights warning."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{results['algorithm']} — {results['dataset']}, {results['rounds']} rounds")
    for col in ("", "accuracy", "F1 macro", "std", "min"):
        t.add_column(col)
    gm, pm = results["gm"], results["pm"]
    t.add_row("GM (global test)", f"{gm['accuracy']:.4f}", f"{gm['f1_macro']:.4f}", "", "")
    t.add_row("PM (all clients)", f"{pm['accuracy']:.4f}", f"{pm['f1_macro']:.4f}",
              f"{pm['accuracy_std']:.4f}", f"{pm['accuracy_min']:.4f}")
    c = results["communication"]
    t.caption = (f"upload {c['up_bytes'] / 1e6:.2f} MB total, {c['up_bytes_per_round'] / 1e3:.1f} kB/round; "
                 f"download {c['down_bytes'] / 1e6:.2f} MB")
    Console().print(t)
    if results.get("random_weights"):
        Console().print(f"[bold red]RANDOM WEIGHTS ({', '.join(results['random_weights'])}): these numbers "
                        f"test the code path, not the method[/]")


def round_line(r: dict) -> str:
    s = f"round {r['round']:>3}"
    if "train_loss" in r:
        s += f"  loss {r['train_loss']:.3f}  up {r['up_bytes'] / 1e3:.1f} kB  {r['time_s']:.1f}s"
    if r.get("skipped"):
        s += "  SKIPPED (too few valid replies)"
    failed = {k: r[k] for k in ("dropped", "late", "rejected") if r.get(k)}
    if failed:
        s += "  " + " ".join(f"{k} {v}" for k, v in failed.items())
    if "gm" in r:
        s += f"  GM acc {r['gm']['accuracy']:.3f}  PM acc {r['pm']['accuracy']:.3f}"
    return s


def _space_needed(cfg: ExperimentConfig, exp) -> int:
    """An upper bound on what the run writes: kept checkpoints (+1 being written), the disk store."""
    private = sum(exp.init_params[n].numel() * exp.init_params[n].element_size() for n in exp.private_names)
    one = ckpt.estimate_bytes({n: exp.init_params[n] for n in exp.global_names}, private, len(exp.train_ids))
    kept = (cfg.runtime.keep_checkpoints + 1) * one if cfg.runtime.checkpoint_every else 0
    store = len(exp.train_ids) * private * 3 if cfg.runtime.store == "disk" else 0
    return kept + store + ckpt.MIN_FREE


def resume_experiment(out: Path, quiet: bool = False) -> dict:
    """Continue the run in `out` from its last complete checkpoint, with its own config.toml."""
    out = Path(out)
    if not out.is_dir():
        raise ConfigError(f"{out}: no such run directory; give the --out of a `fedsplice run`")
    if not (out / "config.toml").is_file():
        raise ConfigError(f"{out}: no config.toml, so not a fedsplice run directory (or it was "
                          f"killed before it started); start it again with `fedsplice run --out {out} --overwrite`")
    return run_experiment(load_config(out / "config.toml"), out, quiet=quiet, resume=True)


def _start(cfg: ExperimentConfig, out: Path, overwrite: bool, resume: bool):
    """Fail early on a bad run directory; on resume, the last complete checkpoint (or None)."""
    last_ckpt = None
    if not resume:
        rundir.check_out(out, overwrite)  # fail before the slow build, and write nothing yet
    else:
        out = Path(out)
        ckpt.remove_partial(out / ckpt.DIRNAME)  # a write that was killed
        last_ckpt = ckpt.latest(out / ckpt.DIRNAME)
        if last_ckpt is not None:
            ckpt.check(last_ckpt, cfg)
    ckpt.check_writable(out)
    ckpt.check_space(out, ckpt.MIN_FREE)
    return last_ckpt


def _prepare_dir(cfg: ExperimentConfig, exp, out: Path, loaded, overwrite: bool, resume: bool, quiet: bool) -> Path:
    """A new run: a clean directory with config.toml. A resumed one: drop what came after the checkpoint."""
    if loaded is None:  # a new run, or one killed before its first checkpoint: start afresh
        out = rundir.prepare(out, overwrite or resume)
        shutil.rmtree(out / ckpt.DIRNAME, ignore_errors=True)
        rundir.write_config(out, cfg)
    else:
        if not quiet:
            console.print(f"resuming after round {loaded.state.round} from {loaded.path}")
        shutil.rmtree(out / "client_state", ignore_errors=True)  # may hold state of later rounds
        for stale in ("results.json", "results.csv", "accuracy.png"):
            (out / stale).unlink(missing_ok=True)
    if exp.scenario:  # the realised scenario (who lost what); rebuilt identically on resume
        rundir.atomic_write_json(out / "scenario.json", exp.scenario)
        if not quiet:
            console.print(summary_line(exp.scenario), soft_wrap=True, markup=False)
    else:
        (out / "scenario.json").unlink(missing_ok=True)  # from an earlier run in this folder
    return out


def _restore(loaded, store, log, checkpointer) -> None:
    ckpt.restore_store(store, loaded.clients)
    log.lines = list(loaded.metrics_lines)  # drops rounds logged after the checkpoint
    rundir.atomic_write_text(log.path, "\n".join(log.lines) + "\n")
    checkpointer.follow(loaded.state.round, loaded.path)
    ckpt.restore_rng(loaded)


def _train(cfg, exp, store, log, loaded, checkpointer, make_transport, echo, quiet: bool):
    """The round loop (or one evaluation) and the personalization stage, with a progress bar.
    Returns the final server state and the transport (the later stages use it too)."""
    every = cfg.runtime.checkpoint_every

    def on_state(state: ckpt.RoundState) -> None:
        if every and (state.round % every == 0 or state.round == cfg.server.rounds):
            checkpointer.save(state, store, log.lines)

    done = loaded.state.round if loaded is not None else 0
    total = (cfg.server.rounds - done) * cfg.server.clients_per_round
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=quiet, transient=True) as bar:
        task = bar.add_task("client updates", total=total)

        def on_round(record: dict) -> None:
            log.append(record)
            if echo is not None:
                echo(round_line(record))
            if not quiet:
                bar.console.print(round_line(record))
                for e in record.get("events", []):
                    bar.console.print(f"  client {e['client']} {e['event']}: {e['reason']}")

        transport = (make_transport(exp, store) if make_transport
                     else InProcess(exp, store, progress=lambda: bar.advance(task)))
        if exp.recipe.trains:
            final = run_rounds(exp, store, on_round, transport=transport,
                               start=loaded.state if loaded is not None else None, on_state=on_state)
        else:
            final = evaluate_only(exp, transport, on_round)
        if exp.recipe.personalize:
            if not quiet:
                bar.console.print("personalization (local, no traffic) on every training client")
            pm = personalization(exp, transport, final["global_params"])
            last = log.records()[-1]
            on_round({"round": last["round"], "phase": "personalization", "gm": last["gm"], "pm": pm})
    return final, transport


def _results(cfg: ExperimentConfig, exp, name: str, records: list[dict], final: dict) -> dict:
    last = records[-1]
    rounds = cfg.server.rounds if exp.recipe.trains else 0
    results = {
        "algorithm": name,
        "method": cfg.algorithm,
        "server_optimizer": cfg.server.optimizer,
        "rounds": rounds,
        "seed": cfg.seed,
        "model": cfg.model.name,
        **({"vision": cfg.model.vision} if cfg.model.vision else {}),
        "random_weights": random_weights(cfg),  # non-empty: results of random models, not of the method
        "dataset": cfg.data.dataset,
        "num_classes": len(exp.data.class_names),
        "train_counts": exp.caches["train_counts"].tolist(),
        "imbalance_measured": float(exp.caches["train_counts"].max() / max(exp.caches["train_counts"].min(), 1)),
        "gm": last["gm"],
        "pm": last["pm"],
        "zero_shot_gm": records[0]["gm"],
        "communication": {
            "up_bytes": final["up_bytes"], "down_bytes": final["down_bytes"],
            "up_bytes_per_round": final["up_bytes"] / max(rounds, 1),
            "down_bytes_per_round": final["down_bytes"] / max(rounds, 1),
            "up_bytes_per_client_round": final["up_bytes"] / max(rounds * cfg.server.clients_per_round, 1),
        },
        "params": {"global": sum(exp.init_params[n].numel() for n in exp.global_names),
                   "private": sum(exp.init_params[n].numel() for n in exp.private_names)},
        "failures": {**{k: sum(r.get(k, 0) for r in records) for k in ("dropped", "late", "rejected")},
                     "skipped_rounds": sum(bool(r.get("skipped")) for r in records)},
    }
    purified = [r["purified_steps"] for r in records if "purified_steps" in r]
    if purified:
        results["purified_fraction"] = float(sum(purified) / len(purified))
    return results


def run_experiment(cfg: ExperimentConfig, out: Path, overwrite: bool = False, quiet: bool = False,
                   resume: bool = False, make_transport=None, echo=None) -> dict:
    """Run `cfg` into the run directory `out`, checkpointing every `runtime.checkpoint_every`
    rounds. `resume=True` continues the run already in `out` from its last complete checkpoint
    (from the start if it has none) and gives the same metrics.jsonl and results.json as an
    uninterrupted run, apart from the wall-clock `time_s` fields. `make_transport(exp, store)`
    gives the round loop another runtime (Flower); `echo(line)` also receives each round line."""
    last_ckpt = _start(cfg, out, overwrite, resume)
    t0 = time.perf_counter()
    name = display_name(cfg)
    if not quiet:
        console.print(f"[bold]{name}[/] on {cfg.data.dataset} with {cfg.model.name} -> {out}")
        if random_label(cfg):
            console.print(f"[bold red]{random_label(cfg)}[/]")
    exp = build(cfg)  # a missing or broken asset (model, data set) fails here, before training
    ckpt.check_space(out, _space_needed(cfg, exp))
    loaded = ckpt.load(last_ckpt, cfg, exp.sampling) if last_ckpt is not None else None
    out = _prepare_dir(cfg, exp, out, loaded, overwrite, resume, quiet)
    store = make_store(cfg.runtime.store, out / "client_state")
    log = rundir.MetricsLog(out / "metrics.jsonl")
    checkpointer = ckpt.Checkpointer(out, cfg, exp.sampling, cfg.runtime.keep_checkpoints)
    if loaded is not None:
        _restore(loaded, store, log, checkpointer)
    final, transport = _train(cfg, exp, store, log, loaded, checkpointer, make_transport, echo, quiet)
    records = log.records()
    results = _results(cfg, exp, name, records, final)
    if exp.holdout_ids and exp.recipe.trains:
        if not quiet:
            console.print(f"cold start: {len(exp.holdout_ids)} held-out clients, "
                          f"{cfg.eval.cold_start_epochs} local epochs")
        results["cold_start"] = cold_start(exp, transport, final["global_params"])
    results["time_s"] = round(time.perf_counter() - t0, 1)
    rundir.write_results(out, results)
    rundir.plot_accuracy(out, records, name + (" (RANDOM WEIGHTS)" if results["random_weights"] else ""))
    return results
