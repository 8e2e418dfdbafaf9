"""Run one experiment end to end into a run directory, on any runtime (in-process by default).

The steps: check the run directory -> build the experiment -> start afresh or restore the last
checkpoint -> the round loop (or one evaluation) -> the client stages after it (personalize,
cold start) -> results.json, results.csv and the plot. Every client-side stage goes through the
runtime's transport, so on Flower it runs on the SuperNodes.
"""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from fedsplice.algorithms import display_name
from fedsplice.app import rundir
from fedsplice.app.console import console, make_console, plural
from fedsplice.app.summary import data_table, hardware_line, results_table
from fedsplice.config import SITES, ExperimentConfig
from fedsplice.data.report import summary_lines
from fedsplice.data.scenarios import summary_line
from fedsplice.data.zoo import random_label
from fedsplice.errors import ConfigError
from fedsplice.federation import build, cold_start, evaluate_only, make_store, personalization, run_rounds
from fedsplice.federation import checkpoint as ckpt
from fedsplice.federation.validate import load_config
from fedsplice.runtimes.inprocess import InProcess
from fedsplice.runtimes.workers import Workers, check_workers


def print_table(results: dict) -> None:
    """The end-of-run summary: GM and PM, traffic, and the random-weights warning."""
    from rich.table import Table

    t = Table(title=f"{results['algorithm']} — {results['dataset']}, {plural(results['rounds'], 'round')}")
    for col in ("", "accuracy", "F1 macro", "std", "min"):
        t.add_column(col)
    gm, pm = results["gm"], results["pm"]
    t.add_row("GM (global test)", f"{gm['accuracy']:.4f}", f"{gm['f1_macro']:.4f}", "", "")
    t.add_row("PM (all clients)", f"{pm['accuracy']:.4f}", f"{pm['f1_macro']:.4f}",
              f"{pm['accuracy_std']:.4f}", f"{pm['accuracy_min']:.4f}")
    c = results["communication"]
    t.caption = (f"upload {c['up_bytes'] / 1e6:.2f} MB total, {c['up_bytes_per_round'] / 1e3:.1f} kB/round; "
                 f"download {c['down_bytes'] / 1e6:.2f} MB")
    out = make_console()
    out.print(t)
    if results.get("random_weights"):
        out.print(f"[bold red]RANDOM WEIGHTS ({', '.join(results['random_weights'])}): these numbers "
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


def clock(seconds: float | None) -> str:
    """h:mm:ss or m:ss; "?" before there is anything to estimate from."""
    if seconds is None:
        return "?"
    m, sec = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m}:{sec:02d}"


def acc_text(v) -> str:
    return "—" if v is None else f"{v:.3f}"  # null in results.json: an undefined metric


def progress_line(ev: dict) -> str:
    """A progress event as one line: `round 3/10 evaluate: 40/140 client tasks, 1:02 elapsed, ETA 2:15`."""
    where = ev["stage"]
    if ev["kind"] == "round":
        rec = ev["record"]
        where = (f"{rec['phase']} done" if "phase" in rec
                 else f"round {rec['round']}/{ev['rounds']} done" if ev["rounds"] else "evaluation done")
        if "train_loss" in rec:
            where += f", loss {rec['train_loss']:.3f}"
        if "gm" in rec:
            where += f", GM acc {acc_text(rec['gm']['accuracy'])}, PM acc {acc_text(rec['pm']['accuracy'])}"
    return (f"{where}: {ev['done']}/{ev['total']} client tasks, {clock(ev['elapsed_s'])} elapsed, "
            f"ETA {clock(ev['eta_s'])}")


TICK_S = 30.0  # a line stream (compare, a log file) says where the run is at least this often
_STAGES = {"fit": "train", "evaluate": "evaluate", "personalize": "personalize", "cold_start": "cold start"}


class RunProgress:
    """One run's progress in client tasks (fit, evaluate, personalize, cold start: all count, so the
    ETA covers evaluation too), as a rich bar on a terminal, as lines when stderr is a file, and
    as events for `progress(event)` (compare). It wraps the run's transport, so every stage names
    itself ("round 3/10 train", "round 3/10 evaluate", "cold start") on any runtime: InProcess
    ticks as each client ends (`client_done`), other runtimes when a call returns.

    An event: kind ("stage" when one starts, "round" when a round is logged, with its `record`;
    "tick" when nothing was said for TICK_S), stage, phase, round, rounds, done, total,
    elapsed_s, eta_s (None until a task is done)."""

    def __init__(self, cfg: ExperimentConfig, exp, start: int, quiet: bool,
                 on_event: Callable[[dict], None] | None = None):
        self.rounds = cfg.server.rounds if exp.recipe.trains else 0
        self.round, self.phase = (0, "evaluate") if start == 0 else (start + 1, "train")
        self.total, self.done, self.inner = _planned_tasks(cfg, exp, start), 0, None
        self.quiet, self.on_event = quiet, on_event
        self.lines = not quiet and not console.is_terminal  # a log file: lines, no animation
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("client tasks"), TimeElapsedColumn(), TextColumn("ETA"),
                            TimeRemainingColumn(), console=console, disable=quiet or self.lines,
                            transient=True, speed_estimate_period=3600)  # ETA: the run's mean pace
        self.task = self.bar.add_task(self.stage(), total=self.total)
        self._fitted: set[int] = set()
        self._in_call = 0
        self.t0 = self._said = time.perf_counter()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)

    def __enter__(self) -> "RunProgress":
        self.bar.start()
        if self.on_event is not None or self.lines:
            self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join()
        self.bar.stop()

    def stage(self) -> str:
        if self.rounds and self.phase in ("train", "evaluate"):
            return f"round {self.round}/{self.rounds} {self.phase}"
        return self.phase

    def _emit(self, kind: str, **extra) -> None:
        self._said = now = time.perf_counter()
        done, elapsed = self.done, now - self.t0
        ev = {"kind": kind, "stage": self.stage(), "phase": self.phase, "round": self.round,
              "rounds": self.rounds, "done": done, "total": self.total, "elapsed_s": elapsed,
              "eta_s": elapsed / done * (self.total - done) if done else None, **extra}
        if self.on_event is not None:
            self.on_event(ev)
        if self.lines and kind != "round":  # the round line itself is printed by the runner
            console.print(progress_line(ev), markup=False, highlight=False, soft_wrap=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(TICK_S / 3):
            if time.perf_counter() - self._said >= TICK_S:
                self._emit("tick")

    def _advance(self, n: int) -> None:
        self.done += n
        if self.done > self.total:  # more tasks than planned (a runtime's own retries)
            self.total = self.done
        self.bar.update(self.task, completed=self.done, total=self.total)

    def _begin(self, phase: str) -> None:
        self.phase, self._in_call = phase, 0
        self.bar.update(self.task, description=self.stage())
        self._emit("stage")

    def client_done(self, task: str = "") -> None:
        """InProcess's `progress`: one client task has ended."""
        self._in_call += 1
        self._advance(1)

    def round_done(self, record: dict) -> None:
        self._emit("round", record=record)

    def fit(self, rnd: int, cids: list[int], down: bytes):
        if rnd in self._fitted:  # a retry: its clients were not in the plan
            self.total += len(cids)
        self._fitted.add(rnd)
        self.round = rnd
        self._begin("train")
        replies = self.inner.fit(rnd, cids, down)
        self._advance(len(cids) - self._in_call)  # dropped clients, or a runtime that reports none
        return replies

    def run(self, task: str, cids: list[int], down: bytes) -> dict:
        self._begin(_STAGES.get(task, task))
        out = self.inner.run(task, cids, down)
        self._advance(len(cids) - self._in_call)
        return out

    def __getattr__(self, name):  # anything else the runtime offers
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def _planned_tasks(cfg: ExperimentConfig, exp, start: int) -> int:
    """The client tasks a run from round `start` asks for: fits, evaluations, personalize, cold start."""
    n = len(exp.train_ids) if exp.recipe.personalize else 0
    if not exp.recipe.trains:
        return n + len(exp.train_ids)  # one evaluation
    R, every = cfg.server.rounds, cfg.eval.every
    evals = (start == 0) + sum(r % every == 0 or r == R for r in range(start + 1, R + 1))
    fits = sum(len(exp.sampling[r - 1]) for r in range(start + 1, R + 1))
    return n + fits + evals * len(exp.train_ids) + len(exp.holdout_ids)


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
    return run_experiment(load_config(out / "config.toml"), out, quiet=quiet, resume=True, progress=progress)


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


def _train(cfg, exp, store, log, loaded, checkpointer, make_transport, echo, track: RunProgress):
    """The round loop (or one evaluation) and the personalization stage, every client task through
    `track` (the progress). Returns the final server state and the transport (later stages use it)."""
    every = cfg.runtime.checkpoint_every

    def on_state(state: ckpt.RoundState) -> None:
        if every and (state.round % every == 0 or state.round == cfg.server.rounds):
            checkpointer.save(state, store, log.lines)

    def on_round(record: dict) -> None:
        log.append(record)
        if echo is not None:
            echo(round_line(record))
        if not track.quiet:
            console.print(round_line(record))
            for e in record.get("events", []):
                console.print(f"  client {e['client']} {e['event']}: {e['reason']}")
        track.round_done(record)

    track.inner = (make_transport(exp, store) if make_transport
                   else InProcess(exp, store, progress=track.client_done))
    if isinstance(track.inner, Workers):  # it also ticks as each client's reply arrives
        track.inner.progress = track.client_done
    if exp.recipe.trains:
        final = run_rounds(exp, store, on_round, transport=track,
                           start=loaded.state if loaded is not None else None, on_state=on_state)
    else:
        final = evaluate_only(exp, track, on_round)
    if exp.recipe.personalize:
        if not track.quiet:
            console.print("personalization (local, no traffic) on every training client")
        pm = personalization(exp, track, final["global_params"])
        last = log.records()[-1]
        on_round({"round": last["round"], "phase": "personalization", "gm": last["gm"], "pm": pm})
    return final, track


def _say_data(data: dict, quiet: bool, echo) -> None:
    """The data report's lines (sizes, split, drops, warnings) before training (data.json and
    results.json keep them)."""
    for line in summary_lines(data):
        if echo is not None:
            echo(line)
        if not quiet:
            console.print(line, soft_wrap=True, markup=False, style="bold yellow" if line.startswith("warning") else None)


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
    if cfg.data.dataset == SITES and make_transport is None:
        raise ConfigError("data.dataset = 'sites': each Flower SuperNode brings its own file, so it runs on Flower "
                          "(`fedsplice flower up --site-data csv:A --site-data csv:B ...`, or runtime.kind = "
                          "'flower'); in simulation give one data set (csv:PATH, ...) instead")
    last_ckpt = _start(cfg, out, overwrite, resume)
    t0 = time.perf_counter()
    name = display_name(cfg)
    if not quiet:
        console.print(f"[bold]{name}[/] on {cfg.data.dataset} with {cfg.model.name} -> {out}")
        if random_label(cfg):
            console.print(f"[bold red]{random_label(cfg)}[/]")
    exp = build(cfg)  # a missing or broken asset (model, data set) fails here, before training
    if not quiet:
        console.print(hardware_line(cfg, exp), markup=False, highlight=False)
    data = data_table(exp)
    _say_data(data, quiet, echo)
    ckpt.check_space(out, _space_needed(cfg, exp))
    loaded = ckpt.load(last_ckpt, cfg, exp.sampling) if last_ckpt is not None else None
    out = _prepare_dir(cfg, exp, out, loaded, overwrite, resume, quiet)
    rundir.atomic_write_json(out / "data.json", data)  # readable while the run goes on
    log = rundir.MetricsLog(out / "metrics.jsonl")
    checkpointer = ckpt.Checkpointer(out, cfg, exp.sampling, cfg.runtime.keep_checkpoints)
    with (client_side(cfg, exp, make_store(cfg.runtime.store, out / "client_state"), make_transport)
          as (store, make_transport),
          RunProgress(cfg, exp, loaded.state.round if loaded is not None else 0, quiet, progress) as track):
        if loaded is not None:
            _restore(loaded, store, log, checkpointer)
        final, transport = _train(cfg, exp, store, log, loaded, checkpointer, make_transport, echo, track)
        records = log.records()
        results = results_table(cfg, exp, name, records, final)
        if exp.holdout_ids and exp.recipe.trains:
            if not quiet:
                console.print(f"cold start: {plural(len(exp.holdout_ids), 'held-out client')}, "
                              f"{plural(cfg.eval.cold_start_epochs, 'local epoch')}")
            results["cold_start"] = cold_start(exp, transport, final["global_params"])
    results["time_s"] = round(time.perf_counter() - t0, 1)
    rundir.write_results(out, results)
    rundir.plot_accuracy(out, records, name + (" (RANDOM WEIGHTS)" if results["random_weights"] else ""))
    return results
