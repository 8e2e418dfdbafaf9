"""The Flower ServerApp of fedsplice (Flower 1.42 Message API).

It runs where the SuperLink is: it builds the experiment from the run config and runs
fedsplice's own `runner.run_experiment` — the same round loop, server optimizer, evaluation
and run directory as `fedsplice run` — with `FlowerTransport` as the transport. Every client
task (fit, evaluate, personalize, cold start) is a message to the SuperNode that serves the
client; this process scores only the global test set (GM).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsplice.app import rundir, runner
from fedsplice.data.assets import atomic_write_json
from fedsplice.federation import config_from_text
from fedsplice.runtimes.flower.transport import (CONFIG_KEY, MIN_NODES_KEY, NODE_WAIT_KEY, OUT_KEY, STATUS_FILE,
                                                 FlowerTransport, JsonLog)

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
        "events": events.count,
        "messages": tot["messages"],
        "up_payload_bytes": tot["up_payload_bytes"], "down_payload_bytes": tot["down_payload_bytes"],
        "up_envelope_bytes": tot["up_bytes"] - tot["up_payload_bytes"],
        "uploaded_tensors": tot["up_tensors"],
        # evaluation and the other client tasks (personalize, cold start)
        "eval_down_bytes": tot["eval_down_bytes"], "eval_up_bytes": tot["eval_up_bytes"],
    }


def run_on_grid(grid: Grid, cfg, out: Path, *, min_nodes: int, node_wait_s: float) -> dict:
    """`runner.run_experiment` with the round loop's transport = FlowerTransport(grid)."""
    events = JsonLog(out / "events.jsonl", echo=_say)
    audit = JsonLog(out / "wire.jsonl")
    made = {}

    def make_transport(exp, store):
        made["t"] = FlowerTransport(grid, exp, events=events, audit=audit, min_nodes=min_nodes,
                                    node_wait_s=node_wait_s, say=_say)
        return made["t"]

    results = runner.run_experiment(cfg, out, overwrite=True, quiet=True, make_transport=make_transport,
                                    echo=lambda line: _say("[fedsplice] " + line))
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
                              node_wait_s=float(rc.get(NODE_WAIT_KEY, 300.0)))
        atomic_write_json(status, {"ok": True, "run_id": context.run_id, "time_s": round(time.time() - t0, 1),
                                   "gm_accuracy": results["gm"]["accuracy"], "pm_accuracy": results["pm"]["accuracy"]})
        _say("[fedsplice] ServerApp: done")
    except BaseException as e:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(status, {"ok": False, "run_id": context.run_id, "error": f"{type(e).__name__}: {e}",
                                   "traceback": traceback.format_exc()})
        _say(f"[fedsplice] ServerApp failed: {type(e).__name__}: {e}")
        raise
