"""`fedsplice flower up`: a SuperLink and N SuperNodes on this machine, one run, then teardown.

Everything runs as separate processes on 127.0.0.1 (free ports), exactly as on many hosts:

  flower-superlink   TLS (a throw-away CA + server certificate, `certs.make_tls`) and
                     --enable-supernode-auth; --disable-runtime-dependency-installation (the app
                     needs nothing installed: fedsplice, torch and flwr are already here)
  flwr supernode register <key.pub>   one EC key pair per SuperNode (`certs.make_node_key`)
  flower-supernode   --root-certificates, --auth-supernode-private-key, --node-config node.toml
                     (partition-id, num-partitions, state-dir; device with --devices)
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
teardown, with psutil), `resume` (`fedsplice resume` of a Flower run); this one writes the
Flower App and runs `up`.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from fedsplice.app.flower.cluster import CONNECTION, ISOLATIONS, Cluster, FlowerLaunchError
from fedsplice.app.flower.processes import TAG_VAR, free_port
from fedsplice.app.flower.resume import LAUNCH_FILE, RUN_FILE
from fedsplice.data.assets import atomic_write_json
from fedsplice.errors import ConfigError

__all__ = ["CONNECTION", "ISOLATIONS", "TAG_VAR", "Cluster", "FlowerLaunchError", "free_port", "up", "write_app"]


# ----------------------------------------------------------------------------- the app


def write_app(folder: Path, cfg, out: Path, *, min_nodes: int, node_wait_s: float = 300.0,
              resume: bool = False) -> Path:
    """A Flower App folder (pyproject.toml only) whose components are fedsplice's installed
    ServerApp/ClientApp and whose run config carries the resolved experiment config. `resume`
    is in the config so that `flwr run ... --run-config resume=true` may set it (Flower ignores
    an override of a key the app does not declare)."""
    from fedsplice.config import to_dict
    from fedsplice.runtimes.flower.transport import CONFIG_KEY, MIN_NODES_KEY, NODE_WAIT_KEY, OUT_KEY, RESUME_KEY

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
                       MIN_NODES_KEY: int(min_nodes), NODE_WAIT_KEY: float(node_wait_s), RESUME_KEY: bool(resume)},
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


@dataclass(frozen=True)
class Launch:
    """How `up` deploys a run (`fedsplice flower up`'s options; `fedsplice resume` reads them back
    from the run's launch file). supernodes: None = one per --site-data file, else
    runtime.num_supernodes; insecure: None = runtime.insecure. `site_data`: per-site data
    (data.dataset = "sites"), SuperNode i's own file (node config data-path), one per SuperNode.
    `devices`: SuperNode p's device is devices[p % len(devices)] (node config device); None:
    runtime.devices, cycled the same way; neither: every node uses runtime.device. `resume`:
    continue the run in `out` from its last checkpoint, on new processes over the same SuperNode
    folders (their PRIVATE state). `timeout`: seconds for `flwr run` (None: no limit)."""

    supernodes: int | None = None
    insecure: bool | None = None
    overwrite: bool = False
    isolation: str = "fedsplice"
    quiet: bool = False
    node_wait_s: float = 300.0
    timeout: float | None = None
    resume: bool = False
    site_data: tuple[str, ...] = ()
    devices: tuple[str, ...] | None = None


def up(cfg, out: Path, launch: Launch = Launch(), *, on_cluster: Callable[[Cluster], None] | None = None,
       on_tick: Callable[[Cluster], None] | None = None) -> dict:
    """Run `cfg` on a local Flower deployment (SuperLink + SuperNodes, as `launch` says); write the
    run directory `out` as `fedsplice run` does; tear everything down. Returns results.json.
    `on_cluster(cluster)` runs once the nodes are up, `on_tick(cluster)` while the run goes (a
    caller's fault injection or monitoring)."""
    import dataclasses

    devices = None if launch.devices is None else list(launch.devices)
    rt = cfg.runtime
    site_data = list(launch.site_data)
    n = launch.supernodes or len(site_data) or rt.num_supernodes
    check_sites(cfg, site_data, n)
    per_node = node_entries(n, site_data, node_devices(cfg, devices, n))
    insecure = rt.insecure if launch.insecure is None else launch.insecure
    n_train = cfg.data.num_clients - cfg.data.holdout_clients
    if n > n_train:
        raise ConfigError(f"--supernodes / runtime.num_supernodes = {n} exceeds the {n_train} training clients; "
                          f"a SuperNode with no client would idle")
    if cfg.privacy.secure_aggregation and n != n_train:
        raise ConfigError(f"privacy.secure_aggregation sums one client per SuperNode: --supernodes / "
                          f"runtime.num_supernodes = {n}, set it to the {n_train} training clients")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(rt, kind="flower", num_supernodes=n,
                                                               insecure=insecure))
    out = Path(out)
    root = _prepare_out(out, launch.overwrite, launch.resume)
    say = _printer(launch.quiet)
    say(f"flower: SuperLink + {n} SuperNodes on 127.0.0.1 ({'INSECURE' if insecure else 'TLS + node auth'}) -> {out}"
        + (" (resuming)" if launch.resume else "")
        + (f"; devices {', '.join(e['device'] for e in per_node)}" if devices or rt.devices else ""))
    t0 = time.monotonic()
    old = _install_sigterm()
    try:
        with Cluster(root, insecure=insecure, isolation=launch.isolation, say=say) as cl:
            # how to start it again (`fedsplice resume`), and the tag that finds its processes
            atomic_write_json(root / LAUNCH_FILE, {"isolation": launch.isolation, "node_wait_s": launch.node_wait_s,
                                                   "tag": cl.tag,
                                                   "site_data": site_data, "devices": devices})
            cl.start_superlink()
            cl.add_supernodes(n, per_node=per_node)
            say(f"flower: up in {time.monotonic() - t0:.1f}s (SuperLink {cl.address}); submitting the run")
            if on_cluster:
                on_cluster(cl)
            app = write_app(root / "app", cfg, out, min_nodes=n, node_wait_s=launch.node_wait_s, resume=launch.resume)

            def on_line(line: str) -> None:
                if "[fedsplice]" in line:
                    say(line[line.index("[fedsplice]") + len("[fedsplice] "):])

            rc = cl.run(app, on_line, timeout=launch.timeout, on_tick=(lambda: on_tick(cl)) if on_tick else None)
            left = cl.close()
    finally:
        _restore_sigterm(old)
    return _outcome(out, root, rc, left, say, t0)


def check_sites(cfg, site_data: list[str], n: int) -> None:
    """--site-data goes with data.dataset = "sites": one file per SuperNode, one SuperNode per client."""
    sites = cfg.data.dataset == "sites"
    if site_data and not sites:
        raise ConfigError("--site-data is for per-site data: set data.dataset = 'sites' and data.labels")
    if sites and (len(site_data) != n or n != cfg.data.num_clients):
        raise ConfigError(f"per-site data: give --site-data once per SuperNode, one site per client "
                          f"(data.num_clients = {cfg.data.num_clients}; got {len(site_data)} files for {n} SuperNodes)")


def parse_devices(text: str) -> list[str]:
    """`--devices cuda:0,cuda:1`: the comma-separated names (each is checked by `node_devices`)."""
    names = [d.strip() for d in text.split(",")]
    if not all(names):
        raise ConfigError(f"--devices {text!r}: an empty device name; give comma-separated devices, "
                          f"e.g. --devices cuda:0,cuda:1")
    return names


def node_devices(cfg, devices: list[str] | None, n: int) -> list[str]:
    """Each of the n SuperNodes' device: `devices` (--devices), else runtime.devices, cycled (node
    p gets devices[p % len]); [] when neither is given (each node uses runtime.device). The
    ServerApp and the SuperNodes run on this machine, so runtime.device (the ServerApp's) and every
    node's device are checked and resolved here, before anything starts: a misspelt one or one this
    machine lacks is a one-line ConfigError naming the option."""
    from fedsplice.config.checks import check_device_name
    from fedsplice.model.device import resolve_device

    resolve_device(cfg.runtime.device, "runtime.device")
    field = "runtime.devices" if devices is None else "--devices"
    devices = list(cfg.runtime.devices if devices is None else devices)
    if field == "--devices" and not devices:
        raise ConfigError("--devices: give at least one device, e.g. --devices cuda:0,cuda:1")
    for d in dict.fromkeys(devices):
        check_device_name(field, d)
        resolve_device(d, field)
    return [devices[p % len(devices)] for p in range(n)] if devices else []


def node_entries(n: int, site_data: list[str], devices: list[str]) -> list[dict]:
    """SuperNode i's own node-config entries: its site's data file, its device."""
    entries: list[dict] = [{} for _ in range(n)]
    for i, path in enumerate(site_data):
        entries[i]["data-path"] = path
    for i, d in enumerate(devices):
        entries[i]["device"] = d
    return entries


def _prepare_out(out: Path, overwrite: bool, resume: bool) -> Path:
    """The run directory and a clean `flower/` in it; on resume, only the SuperNodes' PRIVATE
    state (`nodes/node-i/state`), the logs and launch.json stay."""
    from fedsplice.app import rundir
    from fedsplice.runtimes.flower.transport import STATUS_FILE

    if not resume:
        rundir.check_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    root = out / "flower"
    if not resume:
        shutil.rmtree(root, ignore_errors=True)
    stale = [out / STATUS_FILE] + ([] if resume else [out / f for f in ("events.jsonl", "wire.jsonl", RUN_FILE)])
    stale += [p for p in root.glob("*") if p.name not in ("nodes", "logs", LAUNCH_FILE)]
    stale += [p for p in root.glob("nodes/*/*") if p.name != "state"]
    for p in stale:  # of an overwritten run; on resume, what the new processes make again
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    return root


def _outcome(out: Path, root: Path, rc: int, left: list[int], say, t0: float) -> dict:
    from fedsplice.runtimes.flower.transport import STATUS_FILE

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
