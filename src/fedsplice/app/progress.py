"""A run's progress: the stage, client tasks done, elapsed time and an ETA weighted by what each
stage's tasks cost (`task_costs`), as a rich bar on a terminal, as lines in a log, and as events
for `compare`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedsplice.app.console import console
from fedsplice.config import ExperimentConfig
from fedsplice.federation.train import planned_steps


def clock(seconds: float | None) -> str:
    """h:mm:ss or m:ss; "?" before there is anything to estimate from."""
    if seconds is None:
        return "?"
    m, sec = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m}:{sec:02d}"


def acc_text(v) -> str:
    return "—" if v is None else f"{v:.3f}"  # null in results.json: an undefined metric


def headline(m: dict) -> str:
    """A model's metrics in a few words: "acc 0.512"; free-text answers (model.task = "generate"):
    "loss 2.341 ROUGE-L 0.123"."""
    if "response_loss" in m:
        return f"loss {acc_text(m['response_loss'])} ROUGE-L {acc_text(m['rouge_l'])}"
    return f"acc {acc_text(m['accuracy'])}"


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
            where += f", GM {headline(rec['gm'])}, PM {headline(rec['pm'])}"
    return (f"{where}: {ev['done']}/{ev['total']} client tasks, {clock(ev['elapsed_s'])} elapsed, "
            f"ETA {clock(ev['eta_s'])}")


TICK_S = 30.0  # a line stream (compare, a log file) says where the run is at least this often
_STAGES = {"fit": "train", "evaluate": "evaluate", "personalize": "personalize", "cold_start": "cold start"}


class RunProgress:
    """One run's progress in client tasks (fit, evaluate, personalize, cold start: all count, so the
    ETA covers evaluation too), as a rich bar on a terminal, as lines when stderr is a file, and
    as events for `progress(event)` (compare). It is the run's `Observer`
    (fedsplice.federation.calls), set as its transport's `observer`: the round loop's calls tell
    it when they begin and end, so every stage names itself ("round 3/10 train", "round 3/10
    evaluate", "cold start") on any runtime; a runtime ticks it (`client_done`) as each client
    task ends where it can tell (InProcess, Workers), and the rest of a call's tasks count when
    the call returns (Flower). It watches only: a run returns the same with or without it.

    An event: kind ("stage" when one starts, "round" when a round is logged, with its `record`;
    "tick" when nothing was said for TICK_S), stage, phase, round, rounds, done, total,
    elapsed_s, eta_s (None until a task is done)."""

    def __init__(self, cfg: ExperimentConfig, exp, start: int, quiet: bool,
                 on_event: Callable[[dict], None] | None = None):
        self.rounds = cfg.server.rounds if exp.recipe.trains else 0
        self.round, self.phase = (0, "evaluate") if start == 0 else (start + 1, "train")
        self.planned, self.cost = _planned_tasks(cfg, exp, start), task_costs(cfg, exp)
        self.total, self.done = sum(self.planned.values()), 0
        self.done_by = dict.fromkeys(self.planned, 0)  # per stage: tasks ended, seconds spent in it
        self.spent = dict.fromkeys(self.planned, 0.0)
        self.quiet, self.on_event = quiet, on_event
        self.lines = not quiet and not console.is_terminal  # a log file: lines, no animation
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("client tasks"), TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
                            console=console, disable=quiet or self.lines, transient=True)
        self.task = self.bar.add_task(self.stage(), total=self.total, eta="?")
        self._fitted: set[int] = set()
        self._in_call = 0
        self.t0 = self._said = self._phase_t0 = time.perf_counter()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)

    def __enter__(self) -> RunProgress:
        self.bar.start()
        if not self.quiet or self.on_event is not None:
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
        ev = {"kind": kind, "stage": self.stage(), "phase": self.phase, "round": self.round,
              "rounds": self.rounds, "done": self.done, "total": self.total, "elapsed_s": now - self.t0,
              "eta_s": self.eta(now), **extra}
        if self.on_event is not None:
            self.on_event(ev)
        if self.lines and kind != "round":  # the round line itself is printed by the runner
            console.print(progress_line(ev), markup=False, highlight=False, soft_wrap=True)

    def eta(self, now: float) -> float | None:
        """Seconds left: each stage's tasks left x their cost (`task_costs`) x that stage's own pace
        (seconds spent in it per unit of work done), or the run's mean pace for a stage not seen
        yet. It grows while a long task runs and nothing ends. None before a task has ended."""
        spent = {**self.spent, self.phase: self.spent.get(self.phase, 0.0) + now - self._phase_t0}
        worked = {k: n * self.cost.get(k, 1.0) for k, n in self.done_by.items()}
        if not sum(worked.values()):
            return None
        pace = (now - self.t0) / sum(worked.values())  # a stage not seen yet goes at the run's mean pace
        return sum(max(n - self.done_by.get(k, 0), 0) * self.cost.get(k, 1.0)
                   * (spent.get(k, 0.0) / worked[k] if worked.get(k) else pace) for k, n in self.planned.items())

    def _heartbeat(self) -> None:
        while not self._stop.wait(2.0):
            now = time.perf_counter()
            self.bar.update(self.task, eta=clock(self.eta(now)))
            if (self.lines or self.on_event is not None) and now - self._said >= TICK_S:
                self._emit("tick")

    def _advance(self, n: int) -> None:
        self.done += n
        self.done_by[self.phase] = self.done_by.get(self.phase, 0) + n
        if self.done > self.total:  # more tasks than planned (a runtime's own retries)
            self.total = self.done
            self.planned[self.phase] = max(self.planned.get(self.phase, 0), self.done_by[self.phase])
        self.bar.update(self.task, completed=self.done, total=self.total, eta=clock(self.eta(time.perf_counter())))

    def _begin(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[self.phase] = self.spent.get(self.phase, 0.0) + now - self._phase_t0
        self.phase, self._in_call, self._phase_t0 = phase, 0, now
        self.bar.update(self.task, description=self.stage())
        self._emit("stage")

    def client_done(self, task: str = "") -> None:
        """One client task has ended (the runtime's tick)."""
        self._in_call += 1
        self._advance(1)

    def round_done(self, record: dict) -> None:
        self._emit("round", record=record)

    def begin(self, task: str, rnd: int, cids: list[int]) -> None:
        """A call of the transport begins: its stage starts."""
        if task == "fit":
            if rnd in self._fitted:  # a retry: its clients were not in the plan
                self.total += len(cids)
                self.planned["train"] += len(cids)
            self._fitted.add(rnd)
            self.round = rnd
        self._begin("train" if task == "fit" else _STAGES.get(task, task))

    def end(self, task: str, cids: list[int]) -> None:
        """The call returned: the tasks the runtime did not tick (dropped clients, or a runtime
        that reports none) count now."""
        self._advance(len(cids) - self._in_call)


def _planned_tasks(cfg: ExperimentConfig, exp, start: int) -> dict[str, int]:
    """The client tasks a run from round `start` asks for, by stage: fits, evaluations,
    personalize, cold start."""
    stage = exp.recipe.personalize
    n = {"personalize": len(exp.train_ids) if stage and stage.after else 0, "cold start": 0, "train": 0}
    if not exp.recipe.trains:
        return {**n, "evaluate": len(exp.train_ids)}  # one evaluation
    R, every = cfg.server.rounds, cfg.eval.every
    evals = (start == 0) + sum(r % every == 0 or r == R for r in range(start + 1, R + 1))
    n["train"] = sum(len(exp.sampling[r - 1]) for r in range(start + 1, R + 1))
    return {**n, "evaluate": evals * len(exp.train_ids), "cold start": len(exp.holdout_ids)}


def task_costs(cfg: ExperimentConfig, exp) -> dict[str, float]:
    """What one client task of each stage costs, in sample forwards (a training sample counts 3:
    forward and backward), for the ETA: stages differ by 100x (a 5-epoch cold start against one
    local test set), so counting tasks alone mispredicts. An evaluation carries its share of GM."""
    cc, b = cfg.client, cfg.client.batch_size
    local = float(np.mean([len(c.test_idx) for c in exp.clients])) if exp.clients else 1.0
    steps = [planned_steps(len(exp.clients[k].train_idx), cc, None) for k in exp.train_ids]
    fit = 3.0 * b * float(np.mean(steps)) if steps else 1.0
    epochs = cfg.eval.cold_start_epochs
    cold = [3.0 * epochs * len(exp.clients[k].train_idx) + (epochs + 1) * len(exp.clients[k].test_idx)
            for k in exp.holdout_ids]
    rounds = exp.recipe.personalize.after_rounds if exp.recipe.personalize else 0
    return {"train": fit, "evaluate": local + exp.data.global_test_size / max(len(exp.train_ids), 1),
            "personalize": fit * max(rounds, 1) + local, "cold start": float(np.mean(cold)) if cold else 1.0}
