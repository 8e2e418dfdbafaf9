"""Run one experiment end to end into a run directory, on any runtime (in-process by default).

The steps: check the run directory -> build the experiment -> start afresh or restore the last
checkpoint -> the round loop (or one evaluation) -> the client stages after it (personalize,
cold start) -> results.json, results.csv and the plot. Every client-side stage goes through the
runtime's transport, so on Flower it runs on the SuperNodes.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from contextlib import closing, contextmanager
from pathlib import Path

from fedsplice.algorithms import display_name
from fedsplice.app import rundir
from fedsplice.app.console import console, plural
from fedsplice.app.export import write_adapter
from fedsplice.app.progress import RunProgress, headline
from fedsplice.app.summary import data_table, hardware_line, results_table
from fedsplice.app.tracking import Trackers
from fedsplice.app.tracking import check_installed as check_trackers
from fedsplice.config import SITES, ExperimentConfig
from fedsplice.data.report import summary_lines
from fedsplice.data.scenarios import summary_line
from fedsplice.data.zoo import random_label
from fedsplice.errors import ConfigError
from fedsplice.federation import (
    build,
    cold_start,
    evaluate_only,
    make_store,
    movement,
    personalization,
    references,
    run_rounds,
)
from fedsplice.federation import checkpoint as ckpt
from fedsplice.federation.rounds import SECAGG_NEEDS_FLOWER
from fedsplice.federation.validate import load_run_config
from fedsplice.runtimes.inprocess import InProcess
from fedsplice.runtimes.workers import Workers, check_workers


def round_line(r: dict, refs: dict | None = None) -> str:
    """A round's line; with `refs` (the run's references) GM and PM each beside theirs."""
    s = f"{r['phase']} (after round {r['round']})" if "phase" in r else f"round {r['round']:>3}"
    if "train_loss" in r:
        s += f"  loss {r['train_loss']:.3f}  up {r['up_bytes'] / 1e3:.1f} kB  {r['time_s']:.1f}s"
    if "dp_epsilon" in r:
        s += f"  ε {r['dp_epsilon']:.4g}"
    if "dp_local_epsilon" in r:  # DP-SGD: the worst ε among this round's clients
        s += f"  local ε ≤ {r['dp_local_epsilon']:.4g}"
    if r.get("skipped"):
        s += "  SKIPPED (too few valid replies)"
    failed = {k: r[k] for k in ("dropped", "late", "rejected") if r.get(k)}
    if failed:
        s += "  " + " ".join(f"{k} {v}" for k, v in failed.items())
    if "gm" in r:
        s += f"  GM {headline(r['gm'])}"
        s += f" (majority {refs['majority']['gm']['accuracy']:.3f})" if refs else ""
        s += f"  PM {headline(r['pm'])}"
        s += f" (local prior {refs['local_prior']['pm']['accuracy']:.3f})" if refs else ""
    return s


def _space_needed(cfg: ExperimentConfig, exp) -> int:
    """An upper bound on what the run writes: kept checkpoints (+1 being written), the disk store."""
    private = sum(exp.init_params[n].numel() * exp.init_params[n].element_size() for n in exp.private_names)
    one = ckpt.estimate_bytes({n: exp.init_params[n] for n in exp.global_names}, private, len(exp.train_ids))
    kept = (cfg.runtime.keep_checkpoints + 1) * one if cfg.runtime.checkpoint_every else 0
    store = len(exp.train_ids) * private * 3 if cfg.runtime.store == "disk" else 0
    return kept + store + ckpt.MIN_FREE


def resume_experiment(out: Path, quiet: bool = False, progress: Callable[[dict], None] | None = None) -> dict:
    """Continue the run in `out` from its last complete checkpoint, with its own config.toml."""
    out = Path(out)
    if not out.is_dir():
        raise ConfigError(f"{out}: no such run directory; give the --out of a `fedsplice run`")
    if not (out / "config.toml").is_file():
        raise ConfigError(f"{out}: no config.toml, so not a fedsplice run directory (or it was "
                          f"killed before it started); start it again with `fedsplice run --out {out} --overwrite`")
    if (out / "flower-run.json").is_file():  # its PRIVATE state is on the SuperNodes, not in the checkpoints
        raise ConfigError(f"{out} is a Flower run: resume it with `fedsplice resume {out}` (it restarts on Flower)")
    return run_experiment(load_run_config(out / "config.toml"), out, quiet=quiet, resume=True, progress=progress)


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
    """A resumed run's client states, metrics so far, checkpoints and random streams (None: a fresh run)."""
    if loaded is None:
        return
    ckpt.restore_store(store, loaded.clients)
    log.lines = list(loaded.metrics_lines)  # drops rounds logged after the checkpoint
    rundir.atomic_write_text(log.path, "\n".join(log.lines) + "\n")
    checkpointer.follow(loaded.state.round, loaded.path)
    ckpt.restore_rng(loaded)


def _train(cfg, exp, store, log, loaded, checkpointer, make_transport, echo, track: RunProgress, refs=None,
           trackers: Trackers | None = None, marks: dict[str, float] | None = None):
    """The round loop (or one evaluation) and the personalization stage, every client task watched
    by `track` (the progress, the transport's observer) and each round logged to `trackers`.
    `marks["round0"]`: when round 0's evaluation was logged. Returns the final server state and the
    transport (later stages use it)."""
    every, adapters = cfg.runtime.checkpoint_every, cfg.runtime.save_adapter_every

    def on_state(state: ckpt.RoundState) -> None:
        if every and (state.round % every == 0 or state.round == cfg.server.rounds):
            checkpointer.save(state, store, log.lines)
        if adapters and (state.round % adapters == 0 or state.round == cfg.server.rounds):
            write_adapter(exp, state.global_params, checkpointer.root.parent / f"peft_{state.round}")

    def on_round(record: dict) -> None:
        if marks is not None and record["round"] == 0 and "phase" not in record:
            marks.setdefault("round0", time.perf_counter())
        log.append(record)
        if trackers is not None:
            trackers.round(record)
        if echo is not None:
            echo(round_line(record, refs))
        if not track.quiet:
            console.print(round_line(record, refs))
            for e in record.get("events", []):
                console.print(f"  client {e['client']} {e['event']}: {e['reason']}")
        track.round_done(record)

    transport = make_transport(exp, store) if make_transport else InProcess(exp, store)
    transport.observer = track  # the progress watches the loop's calls; a runtime that can tell ticks it
    if exp.recipe.trains:
        final = run_rounds(exp, on_round, transport=transport,
                           start=loaded.state if loaded is not None else None, on_state=on_state)
    else:
        final = evaluate_only(exp, transport, on_round)
    if exp.recipe.personalize and exp.recipe.personalize.after:
        if not track.quiet:
            console.print("personalization (local, no traffic) on every training client")
        pm = personalization(exp, transport, final["global_params"])
        last = log.records()[-1]
        on_round({"round": last["round"], "phase": "personalization", "gm": last["gm"], "pm": pm})
    return final, transport


def _say_data(data: dict, quiet: bool, echo) -> None:
    """The data report's lines (sizes, split, drops, warnings) before training (data.json and
    results.json keep them)."""
    for line in summary_lines(data):
        if echo is not None:
            echo(line)
        if not quiet:
            console.print(line, soft_wrap=True, markup=False,
                          style="bold yellow" if line.startswith("warning") else None)


@contextmanager
def client_side(cfg: ExperimentConfig, exp, store, make_transport):
    """(the store, the transport maker) of the run: as given (this process, or Flower), or
    `runtime.workers` worker processes, which hold the clients' state from then on and are shut
    down when the block ends, however it ends (error, Ctrl-C)."""
    if cfg.runtime.workers == 1 or make_transport is not None:
        yield store, make_transport
        return
    with Workers(exp, store) as pool:
        yield pool.store, lambda exp, store: pool


def _setup(t0: float, marks: dict[str, float]) -> dict[str, float | None]:
    """Wall seconds before round 1: `build_s` from the run's start to its round loop (weights,
    data, references, caches), `round0_s` the round-0 evaluation (None: a resumed run)."""
    r0 = marks.get("round0")
    return {"build_s": round(marks["rounds"] - t0, 1), "round0_s": round(r0 - marks["rounds"], 3) if r0 else None}


def _clocks(t0: float, c0: float) -> dict[str, float]:
    """Wall seconds since t0, and CPU seconds of this process since c0 (every thread): a pause or a
    second run on the cores adds nothing to the latter, so `fedsplice results` can sum a
    from-scratch cost from runs of several sittings."""
    return {"time_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}


def run_experiment(cfg: ExperimentConfig, out: Path, overwrite: bool = False, quiet: bool = False,
                   resume: bool = False, make_transport=None, echo=None,
                   progress: Callable[[dict], None] | None = None) -> dict:
    """Run `cfg` into the run directory `out`, checkpointing every `runtime.checkpoint_every`
    rounds. `resume=True` continues the run already in `out` from its last complete checkpoint
    (from the start if it has none) and gives the same metrics.jsonl and results.json as an
    uninterrupted run, apart from the wall-clock `time_s` fields. `make_transport(exp, store)`
    gives the round loop another runtime (Flower); `echo(line)` also receives each round line;
    `progress(event)` the progress events (`RunProgress`), quiet or not."""
    check_workers(cfg, make_transport)
    check_trackers(cfg)
    if cfg.data.dataset == SITES and make_transport is None:
        raise ConfigError("data.dataset = 'sites': each Flower SuperNode brings its own file, so it runs on Flower "
                          "(`fedsplice flower up --site-data csv:A --site-data csv:B ...`, or runtime.kind = "
                          "'flower'); in simulation give one data set (csv:PATH, ...) instead")
    if cfg.privacy.secure_aggregation and make_transport is None:
        raise ConfigError(SECAGG_NEEDS_FLOWER)
    last_ckpt = _start(cfg, out, overwrite, resume)
    t0, c0 = time.perf_counter(), time.process_time()
    name = display_name(cfg)
    if not quiet:
        console.print(f"[bold]{name}[/] on {cfg.data.dataset} with {cfg.model.name} -> {out}")
        if random_label(cfg):
            console.print(f"[bold red]{random_label(cfg)}[/]")
    exp = build(cfg)  # a missing or broken asset (model, data set) fails here, before training
    exp.ledger = out / "ledger"  # what each client sent, and what the server received (`fedsplice audit`)
    if not quiet:
        console.print("\n".join([hardware_line(cfg, exp), *exp.batch_notes]), markup=False, highlight=False)
    data, refs = data_table(exp), references(exp)
    _say_data(data, quiet, echo)
    ckpt.check_space(out, _space_needed(cfg, exp))
    loaded = ckpt.load(last_ckpt, cfg, exp.sampling) if last_ckpt is not None else None
    out = _prepare_dir(cfg, exp, out, loaded, overwrite, resume, quiet)
    rundir.atomic_write_json(out / "data.json", data)  # readable while the run goes on
    log = rundir.MetricsLog(out / "metrics.jsonl")
    checkpointer = ckpt.Checkpointer(out, cfg, exp.sampling, cfg.runtime.keep_checkpoints)
    trackers = Trackers(cfg, out, name)
    with (client_side(cfg, exp, make_store(cfg.runtime.store, out / "client_state"), make_transport)
          as (store, make_transport),
          RunProgress(cfg, exp, loaded.state.round if loaded is not None else 0, quiet, progress) as track,
          closing(trackers)):
        _restore(loaded, store, log, checkpointer)
        marks = {"rounds": time.perf_counter()}
        final, transport = _train(cfg, exp, store, log, loaded, checkpointer, make_transport, echo, track, refs,
                                  trackers, marks)
        records = log.records()
        results = results_table(cfg, exp, name, records, final, refs)
        results["movement"] = movement(exp, final["global_params"], store)
        if exp.holdout_ids and exp.recipe.trains:
            if not quiet:
                console.print(f"cold start: {plural(len(exp.holdout_ids), 'held-out client')}, "
                              f"{plural(cfg.eval.cold_start_epochs, 'local epoch')}")
            results["cold_start"] = cold_start(exp, transport, final["global_params"])
        results.update(_clocks(t0, c0), setup=_setup(t0, marks))
        trackers.final(results)
    for line in results["warnings"] if echo is not None else ():  # the CLI prints them under its table
        echo(line)
    rundir.write_results(out, results)
    rundir.plot_accuracy(out, records, name + (" (RANDOM WEIGHTS)" if results["random_weights"] else ""))
    return results
