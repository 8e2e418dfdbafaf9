"""`fedsplice flower up`: a SuperLink and N SuperNodes on this machine, one run, then teardown.

Everything runs as separate processes on 127.0.0.1 (free ports), exactly as on many hosts:

  flower-superlink   TLS (a throw-away CA + server certificate, `certs.make_tls`) and
                     --enable-supernode-auth; --disable-runtime-dependency-installation (the app
                     needs nothing installed: fedsplice, torch and flwr are already here)
  flwr supernode register <key.pub>   one EC key pair per SuperNode (`certs.make_node_key`)
  flower-supernode   --root-certificates, --auth-supernode-private-key, --node-config node.toml
                     (partition-id, num-partitions, state-dir)
  flwr run <app> --stream   the Flower App written by `write_app`; its ServerApp output is
                     streamed here (lines starting with "[fedsplice]")

`--insecure` drops TLS and with it node authentication (Flower allows authentication only over
TLS); it is refused unless asked for and warned about.

Teardown (success, failure, Ctrl-C, SIGTERM): every process this launcher started, its process
group, every descendant seen while it ran, and — as a last sweep — any process whose
environment carries this run's FEDSPLICE_FLOWER_TAG gets SIGTERM, then SIGKILL after a grace
period. Flower's own children (SuperExec, flwr-serverapp, flwr-clientapp) inherit the tag, and
also watch their parent's pid, so none outlives the run.

Modules: `cluster` (the SuperLink, SuperNodes and `flwr run`), `processes` (process trees and
teardown, with psutil); this one writes the Flower App and runs `up`.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import tomli_w

from fedsplice.app.flower.cluster import CONNECTION, ISOLATIONS, Cluster, FlowerLaunchError
from fedsplice.app.flower.processes import TAG_VAR, free_port
from fedsplice.errors import ConfigError

__all__ = ["CONNECTION", "ISOLATIONS", "TAG_VAR", "Cluster", "FlowerLaunchError", "free_port", "up", "write_app"]


# ----------------------------------------------------------------------------- the app


def write_app(folder: Path, cfg, out: Path, *, min_nodes: int, node_wait_s: float = 300.0) -> Path:
    """A Flower App folder (pyproject.toml only) whose components are fedsplice's installed
    ServerApp/ClientApp and whose run config carries the resolved experiment config."""
    from fedsplice.config import to_dict
    from fedsplice.runtimes.flower.transport import CONFIG_KEY, MIN_NODES_KEY, NODE_WAIT_KEY, OUT_KEY

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    project = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": "fedsplice-run", "version": "0.1.0", "license": "Apache-2.0",
            "description": "fedsplice experiment as a Flower App",
            # Nothing listed on purpose: fedsplice, torch and flwr are installed on every host
            # already; listed, Flower would install them into a fresh env (uv, CUDA torch).
            "dependencies": [],
        },
        "tool": {"flwr": {"app": {
            "publisher": "fedsplice",
            "components": {"serverapp": "fedsplice.app.flower.server:server_app",
                           "clientapp": "fedsplice.runtimes.flower.client:client_app"},
            "config": {CONFIG_KEY: tomli_w.dumps(to_dict(cfg)), OUT_KEY: str(Path(out).resolve()),
                       MIN_NODES_KEY: int(min_nodes), NODE_WAIT_KEY: float(node_wait_s)},
        }}},
    }
    (folder / "pyproject.toml").write_text(tomli_w.dumps(project))
    return folder


# ----------------------------------------------------------------------------- `fedsplice flower up`


def _printer(quiet: bool) -> Callable[[str], None]:
    def say(s: str) -> None:
        if not quiet:
            print(s, file=sys.stderr, flush=True)
    return say


def up(cfg, out: Path, *, supernodes: int | None = None, insecure: bool | None = None, overwrite: bool = False,
       isolation: str = "fedsplice", quiet: bool = False, node_wait_s: float = 300.0, timeout: float | None = None,
       on_cluster: Callable[[Cluster], None] | None = None, on_tick: Callable[[Cluster], None] | None = None) -> dict:
    """Run `cfg` on a local Flower deployment (SuperLink + `supernodes` SuperNodes); write the
    run directory `out` as `fedsplice run` does; tear everything down. Returns results.json."""
    import dataclasses

    from fedsplice.app import rundir
    from fedsplice.runtimes.flower.transport import STATUS_FILE

    rt = cfg.runtime
    n = supernodes or rt.num_supernodes
    insecure = rt.insecure if insecure is None else insecure
    n_train = cfg.data.num_clients - cfg.data.holdout_clients
    if n > n_train:
        raise ConfigError(f"--supernodes / runtime.num_supernodes = {n} exceeds the {n_train} training clients; "
                          f"a SuperNode with no client would idle")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(rt, kind="flower", num_supernodes=n,
                                                               insecure=insecure))
    out = rundir.check_out(Path(out), overwrite)
    out.mkdir(parents=True, exist_ok=True)
    root = out / "flower"
    shutil.rmtree(root, ignore_errors=True)
    for stale in (STATUS_FILE, "events.jsonl", "wire.jsonl"):  # of an overwritten run
        (out / stale).unlink(missing_ok=True)
    say = _printer(quiet)
    say(f"flower: SuperLink + {n} SuperNodes on 127.0.0.1 ({'INSECURE' if insecure else 'TLS + node auth'}) -> {out}")
    t0 = time.monotonic()
    old = _install_sigterm()
    try:
        with Cluster(root, insecure=insecure, isolation=isolation, say=say) as cl:
            cl.start_superlink()
            cl.add_supernodes(n)
            say(f"flower: up in {time.monotonic() - t0:.1f}s (SuperLink {cl.address}); submitting the run")
            if on_cluster:
                on_cluster(cl)
            app = write_app(root / "app", cfg, out, min_nodes=n, node_wait_s=node_wait_s)

            def on_line(line: str) -> None:
                if "[fedsplice]" in line:
                    say(line[line.index("[fedsplice]") + len("[fedsplice] "):])

            rc = cl.run(app, on_line, timeout=timeout, on_tick=(lambda: on_tick(cl)) if on_tick else None)
            left = cl.close()
    finally:
        _restore_sigterm(old)
    status_path = out / STATUS_FILE
    status = json.loads(status_path.read_text()) if status_path.is_file() else None
    if not status or not status.get("ok"):
        why = status["error"] if status else f"the ServerApp wrote no status (flwr run exited {rc})"
        raise FlowerLaunchError(f"the Flower run failed: {why}; logs in {root / 'logs'}")
    if left:
        raise FlowerLaunchError(f"processes left behind after teardown: {left}")
    say(f"flower: done in {time.monotonic() - t0:.1f}s; all processes stopped")
    return json.loads((out / "results.json").read_text())


def _install_sigterm():
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def _restore_sigterm(old) -> None:
    if old is not None:
        signal.signal(signal.SIGTERM, old)
