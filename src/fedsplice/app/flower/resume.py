"""Resuming a Flower run: the run key, the ledger the ServerApp keeps, and `fedsplice resume`.

A Flower run's directory holds `flower-run.json`, written by the ServerApp:

    run_key   a random id made at the first start. The SuperNodes keep the run's PRIVATE state
              under it (`state-dir/run-<key>/`); Flower's run id changes when a run is resumed,
              the key does not.
    starts    one entry per start: Flower's run id and the round it continued from.
    rounds    per round, what results.json's "flower" table had counted by the end of that round
              (message and byte totals, events logged), so that a run resumed from that round's
              checkpoint gives the figures of a run that never stopped.

The server's checkpoints hold no PRIVATE tensor (those never leave the nodes); the nodes roll
their own state back to the checkpoint's round (`fedsplice.runtimes.flower.nodestate.rollback`).

`fedsplice resume OUT` of a run of `fedsplice flower up` (`flower/launch.json` is there) starts a
new local SuperLink and SuperNodes on the same node folders and submits the run with
`resume = true` (`cli.resume_flower`); a run on a remote deployment is resumed by resubmitting
its Flower App with that run config. No flwr import here.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

from fedsplice.data.assets import atomic_write_json
from fedsplice.errors import ConfigError
from fedsplice.federation import checkpoint as ckpt

RUN_FILE = "flower-run.json"
LAUNCH_FILE = "launch.json"  # under OUT/flower/: how `fedsplice flower up` started the run


@dataclass
class Start:
    """This start of a Flower run: its key, the round it continues from (0: the beginning), and
    the ledger entry of that round (None at the beginning)."""

    path: Path
    info: dict
    round: int
    resumed: dict | None = None

    @property
    def key(self) -> str:
        return self.info["run_key"]

    def note(self, rnd: int, totals: dict, events: int) -> None:
        """The ledger after the round's last message (its checkpoint is written next)."""
        self.info["rounds"][str(rnd)] = {"totals": dict(totals), "events": events}
        atomic_write_json(self.path, self.info)


def begin(out: Path, resume: bool, run_id: int) -> Start:
    """Record this start in OUT/flower-run.json; on resume, the last checkpoint's round and ledger."""
    out, path = Path(out), Path(out) / RUN_FILE
    info = json.loads(path.read_text()) if resume and path.is_file() else None
    cps = ckpt.checkpoints(out / ckpt.DIRNAME) if resume else []
    rnd = cps[-1][0] if cps else 0
    if rnd and (info is None or str(rnd) not in info.get("rounds", {})):
        raise ConfigError(f"{out}: checkpoint of round {rnd} but no record of it in {RUN_FILE}, so the "
                          "SuperNodes' PRIVATE state cannot be matched to it; start the run again (--overwrite)")
    if info is None:
        info = {"run_key": uuid.uuid4().hex, "starts": [], "rounds": {}}
    info["starts"].append({"run_id": int(run_id), "from_round": rnd})
    info["rounds"] = {r: v for r, v in info["rounds"].items() if int(r) <= rnd}  # later ones are redone
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, info)
    return Start(path, info, rnd, info["rounds"][str(rnd)] if rnd else None)


def is_flower_run(out: Path) -> bool:
    """Whether `out` is the run directory of a Flower run (its ServerApp started)."""
    return (Path(out) / RUN_FILE).is_file()
