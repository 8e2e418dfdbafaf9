"""The Flower ServerApp of fedsplice (Flower 1.42 Message API).

It runs where the SuperLink is: it builds the experiment from the run config and runs
fedsplice's own `runner.run_experiment` — the same round loop, server optimizer, evaluation
and run directory as `fedsplice run` — with `FlowerTransport` as the transport. Every client
task (fit, evaluate, personalize, cold start) is a message to the SuperNode that serves the
client; this process scores only the global test set (GM).

Run config `resume = true` continues the run in out-dir from its last checkpoint (`runner`
restores the GLOBAL tensors, server optimizer, RNGs and metrics lines; the SuperNodes roll
their PRIVATE state back to that round, see `resume.py`), with the same outputs as a run that
never stopped.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsplice.app import rundir, runner
from fedsplice.app.flower.resume import Start, begin
from fedsplice.data.assets import atomic_write_json
from fedsplice.federation import config_from_text
from fedsplice.runtimes.flower.transport import (
    CONFIG_KEY,
    MIN_NODES_KEY,
    NODE_WAIT_KEY,
    OUT_KEY,
    RESUME_KEY,
    STATUS_FILE,
    FlowerTransport,
    JsonLog,
)

server_app = ServerApp()


def _say(line: str) -> None:
    print(line, flush=True)  # the ServerApp's stdout is streamed by `flwr run --stream` / `flwr log`


def flower_totals(t: FlowerTransport, events: JsonLog) -> dict:
    """results.json's "flower" table. The simulation runtime's figures for the same tensors
    (safetensors payloads; one broadcast per sampled client) compare one to one for uploads:
    Flower's up_bytes are the payload plus the message envelope. Downloads do not: Flower sends
    one message per SuperNode per round, however many of its clients were sampled (docs/flower.md)."""
    tot = t.totals
    return {
        "supernodes": len(set(t.owner.values())) if t.owner else 0,
        "secure_aggregation": t.exp.cfg.privacy.secure_aggregation,
        "events": events.count,
        "messages": tot["messages"],
        "up_payload_bytes": tot["up_payload_bytes"], "down_payload_bytes": tot["down_payload_bytes"],
        "up_envelope_bytes": tot["up_bytes"] - tot["up_payload_bytes"],
        "uploaded_tensors": tot["up_tensors"],
        # evaluation and the other client tasks (personalize, cold start)
        "eval_down_bytes": tot["eval_down_bytes"], "eval_up_bytes": tot["eval_up_bytes"],
    }


AFTER_ROUNDS = ("personalize", "cold_start")  # client tasks after the last round's checkpoint


class LedgerTransport(FlowerTransport):
    """FlowerTransport that notes, after each round's fit and evaluation, what a resume from
    that round's checkpoint needs for results.json's "flower" table, and starts from it."""

    def __init__(self, grid, exp, *, start: Start, **kw):
        super().__init__(grid, exp, run_key=start.key, rollback=start.round, **kw)
        self.start = start

    def _connect(self) -> None:
        super()._connect()
        if self.start.resumed is not None:  # its totals hold the first start's query already
            self.totals = dict(self.start.resumed["totals"])

    def fit(self, rnd, cids, down):
        replies = super().fit(rnd, cids, down)
        self.start.note(rnd, self.totals, self.events.count)
        return replies

    def fit_secure(self, rnd, cids, down):
        secured = super().fit_secure(rnd, cids, down)
        self.start.note(rnd, self.totals, self.events.count)
        return secured

    def run(self, task, cids, down):
        results = super().run(task, cids, down)
        if task not in AFTER_ROUNDS:
            self.start.note(self.round, self.totals, self.events.count)
        return results


def run_on_grid(grid: Grid, cfg, out: Path, *, min_nodes: int, node_wait_s: float, resume: bool = False,
                run_id: int = 0, poll_s: float = 0.5) -> dict:
    """`runner.run_experiment` with the round loop's transport = FlowerTransport(grid); `resume`:
    continue the run in `out` from its last checkpoint."""
    start = begin(out, resume, run_id)
    if start.round:
        _say(f"[fedsplice] resuming after round {start.round}; the SuperNodes roll their PRIVATE state back to it")
    # events.jsonl as at the checkpoint (its rounds are redone); wire.jsonl audits every message ever sent
    events = JsonLog(out / "events.jsonl", echo=_say, keep=start.resumed["events"] if start.resumed else 0)
    audit = JsonLog(out / "wire.jsonl", keep=None if resume else 0)
    made = {}

    def make_transport(exp, store):
        made["t"] = LedgerTransport(grid, exp, start=start, events=events, audit=audit, min_nodes=min_nodes,
                                    node_wait_s=node_wait_s, say=_say, poll_s=poll_s)
        return made["t"]

    results = runner.run_experiment(cfg, out, overwrite=True, resume=resume, quiet=True,
                                    make_transport=make_transport, echo=lambda line: _say("[fedsplice] " + line))
    if "t" in made:
        results["flower"] = flower_totals(made["t"], events)
        rundir.write_results(out, results)
    return results


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    out = Path(str(rc[OUT_KEY]))
    status = out / STATUS_FILE
    t0 = time.time()
    try:
        cfg = config_from_text(str(rc[CONFIG_KEY]))
        _say(f"[fedsplice] ServerApp: {cfg.algorithm} on {cfg.data.dataset}, {cfg.server.rounds} rounds -> {out}")
        results = run_on_grid(grid, cfg, out, min_nodes=int(rc.get(MIN_NODES_KEY, 1)),
                              node_wait_s=float(rc.get(NODE_WAIT_KEY, 300.0)), run_id=context.run_id,
                              resume=str(rc.get(RESUME_KEY, False)).lower() in ("true", "1"))
        atomic_write_json(status, {"ok": True, "run_id": context.run_id, "time_s": round(time.time() - t0, 1),
                                   # generated answers (model.task = "generate") have no accuracy: None
                                   "gm_accuracy": results["gm"].get("accuracy"),
                                   "pm_accuracy": results["pm"].get("accuracy")})
        _say("[fedsplice] ServerApp: done")
    except BaseException as e:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(status, {"ok": False, "run_id": context.run_id, "error": f"{type(e).__name__}: {e}",
                                   "traceback": traceback.format_exc()})
        _say(f"[fedsplice] ServerApp failed: {type(e).__name__}: {e}")
        raise
