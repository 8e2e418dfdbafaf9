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
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import tomli_w

from fedsplice.errors import ConfigError, FedspliceError
from fedsplice.runtimes.flower import certs

TAG_VAR = "FEDSPLICE_FLOWER_TAG"
# "fedsplice": SuperNodes with --isolation process, each served by a warm fedsplice executor
# (executor.py); "subprocess": Flower's stock SuperExec, one flwr-clientapp process per message.
ISOLATIONS = ("fedsplice", "subprocess")
CONNECTION = "fedsplice"  # the SuperLink connection's name in the CLI's config.toml


class FlowerLaunchError(FedspliceError):
    """The local Flower deployment could not start, or the run failed; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, starttime) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2:].split()
    return int(rest[1]), int(rest[2]), int(rest[19])


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _proc_stat(int(d))
            if st:
                kids.setdefault(st[0], []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds FEDSPLICE_FLOWER_TAG=tag (zombies excluded)."""
    needle = f"{TAG_VAR}={tag}".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                if Path(f"/proc/{d}/stat").read_text().split(") ")[1][0] != "Z":
                    out.append(int(d))
        except OSError:
            continue
    return out


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    seen: dict[int, int] = field(default_factory=dict)  # pid -> starttime of descendants ever seen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def remember(self) -> None:
        for p in descendants(self.pid):
            st = _proc_stat(p)
            if st:
                self.seen.setdefault(p, st[2])

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _signal_pid(pid: int, sig: int, start: int | None = None) -> None:
    st = _proc_stat(pid)
    if st is None or (start is not None and st[2] != start):
        return  # gone, or the pid was reused
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def stop_procs(procs: list[Proc], tag: str | None, grace: float = 8.0) -> list[int]:
    """SIGTERM everything started (groups, descendants, tagged), SIGKILL what is left; returns
    the pids still alive afterwards (should be [])."""
    for p in procs:
        if p.alive():
            p.remember()

    def everyone() -> list[tuple[int, int | None]]:
        out: list[tuple[int, int | None]] = []
        for p in procs:
            out.append((p.pid, None))
            out.extend(p.seen.items())
        if tag:
            out.extend((pid, None) for pid in tagged(tag))
        return out

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.alive():
                try:
                    os.killpg(p.pid, sig)  # each was started in its own session = group
                except OSError:
                    pass
        for pid, start in everyone():
            _signal_pid(pid, sig, start)
        t0 = time.monotonic()
        while time.monotonic() - t0 < (grace if sig == signal.SIGTERM else 3.0):
            for p in procs:
                p.popen.poll()  # reap our own children
            if not any(_alive(pid, start) for pid, start in everyone()):
                break
            time.sleep(0.1)
    for p in procs:
        try:
            p.popen.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    return [pid for pid, start in everyone() if _alive(pid, start)]


def _alive(pid: int, start: int | None) -> bool:
    st = _proc_stat(pid)
    if st is None or (start is not None and st[2] != start):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------- the app


def write_app(folder: Path, cfg, out: Path, *, min_nodes: int, node_wait_s: float = 300.0) -> Path:
    """A Flower App folder (pyproject.toml only) whose components are fedsplice's installed
    ServerApp/ClientApp and whose run config carries the resolved experiment config."""
    from fedsplice.config import to_dict
    from fedsplice.runtimes.flower.app import CONFIG_KEY, MIN_NODES_KEY, NODE_WAIT_KEY, OUT_KEY

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
            "components": {"serverapp": "fedsplice.runtimes.flower.app:server_app",
                           "clientapp": "fedsplice.runtimes.flower.app:client_app"},
            "config": {CONFIG_KEY: tomli_w.dumps(to_dict(cfg)), OUT_KEY: str(Path(out).resolve()),
                       MIN_NODES_KEY: int(min_nodes), NODE_WAIT_KEY: float(node_wait_s)},
        }}},
    }
    (folder / "pyproject.toml").write_text(tomli_w.dumps(project))
    return folder


# ----------------------------------------------------------------------------- the cluster


class Cluster:
    """A SuperLink and SuperNodes on loopback, under `root`, torn down on exit."""

    def __init__(self, root: Path, *, insecure: bool = False, isolation: str = "fedsplice",
                 say: Callable[[str], None] = print, env: dict | None = None):
        if isolation not in ISOLATIONS:
            raise ConfigError(f"--isolation {isolation!r}: choose one of {', '.join(ISOLATIONS)}")
        self.root = Path(root).resolve()
        self.insecure = insecure
        self.isolation = isolation
        self.say = say
        self.tag = uuid.uuid4().hex
        self.procs: list[Proc] = []
        self.supernodes: dict[int, Proc] = {}
        self.executors: dict[int, Proc] = {}
        self.node_ids: dict[int, int] = {}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.tls: certs.TLSFiles | None = None
        bindir = str(Path(sys.executable).parent)
        self.env = {**os.environ, **(env or {}), TAG_VAR: self.tag, "PYTHONUNBUFFERED": "1",
                    "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
        self.env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        self.env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
        self.env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.25")
        for k in ("FLWR_HOME",):
            self.env.pop(k, None)

    # -- lifecycle

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> list[int]:
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # a 2nd Ctrl-C must not cut teardown short
        try:
            left = stop_procs(self.procs, self.tag)
        finally:
            if main:
                signal.signal(signal.SIGINT, old)
        if left:
            self.say(f"warning: processes still alive after teardown: {left}")
        return left

    def _spawn(self, name: str, cmd: list[str], home: Path, log: Path) -> Proc:
        home.mkdir(parents=True, exist_ok=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        f = log.open("ab")
        popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**self.env, "FLWR_HOME": str(home)}, cwd=str(home),
                                 start_new_session=True)
        f.close()
        p = Proc(name, popen, log)
        self.procs.append(p)
        return p

    def _cli(self, args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
        home = self.root / "cli"
        r = subprocess.run(["flwr", *args], capture_output=True, text=True, timeout=timeout,
                           env={**self.env, "FLWR_HOME": str(home)}, cwd=str(home), start_new_session=True)
        return r

    # -- SuperLink

    def start_superlink(self, timeout: float = 90.0) -> None:
        link = self.root / "superlink"
        cmd = ["flower-superlink", "--port", str(self.port), "--host", "127.0.0.1",
               "--disable-runtime-dependency-installation"]
        if self.insecure:
            self.say("WARNING: --insecure: no TLS and no SuperNode authentication; anyone who can "
                     "reach the port can join or read the traffic. Use only on a trusted loopback.")
            cmd.append("--insecure")
        else:
            self.tls = certs.make_tls(self.root / "certs")
            cmd += ["--ssl-ca-certfile", str(self.tls.ca_cert), "--ssl-certfile", str(self.tls.server_cert),
                    "--ssl-keyfile", str(self.tls.server_key), "--enable-supernode-auth"]
        self.superlink = self._spawn("superlink", cmd, link, self.root / "logs" / "superlink.log")
        cli = self.root / "cli"
        cli.mkdir(parents=True, exist_ok=True)
        conn = {"address": self.address}
        if self.insecure:
            conn["insecure"] = True
        else:
            conn["root-certificates"] = str(self.tls.ca_cert)
        (cli / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: conn}}))
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.superlink.alive():
                raise FlowerLaunchError(f"the SuperLink exited (code {self.superlink.popen.returncode}):\n"
                                        f"{self.superlink.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                if "Uvicorn running" in self.superlink.log.read_text(errors="replace"):
                    self.superlink.remember()
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise FlowerLaunchError(f"the SuperLink did not start within {timeout:.0f}s:\n{self.superlink.tail()}")

    # -- SuperNodes

    def register(self, public_key: Path) -> int:
        r = self._cli(["supernode", "register", str(public_key), CONNECTION, "--format", "json"])
        try:
            data = json.loads(r.stdout[r.stdout.index("{"):])
            return int(data["node-id"])
        except (ValueError, KeyError):
            raise FlowerLaunchError(f"`flwr supernode register {public_key.name}` failed:\n"
                                    f"{r.stdout}\n{r.stderr}") from None

    def node_config(self, i: int, n: int, extra: dict | None = None) -> Path:
        folder = self.root / "nodes" / f"node-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        nc = {"partition-id": i, "num-partitions": n, "state-dir": str(folder / "state"), **(extra or {})}
        path = folder / "node.toml"
        path.write_text(tomli_w.dumps(nc))
        return path

    def add_supernodes(self, n: int, extra: dict | None = None) -> None:
        """Register n node keys (in parallel), then start n SuperNodes, partition i of n."""
        keys = {}
        if not self.insecure:
            for i in range(n):
                keys[i] = certs.make_node_key(self.root / "nodes" / f"node-{i}", "auth-key")
            with ThreadPoolExecutor(n) as pool:
                ids = list(pool.map(lambda i: self.register(keys[i].public), range(n)))
            self.node_ids.update(dict(enumerate(ids)))
        for i in range(n):
            self.start_supernode(i, self.node_config(i, n, extra), keys.get(i))

    def start_supernode(self, i: int, node_config: Path, key: certs.NodeKey | None,
                        name: str | None = None) -> Proc:
        """Start SuperNode `i` (its own folder, log and executor); `name` starts an extra one
        (e.g. a test's intruder) under that name instead, leaving node i alone."""
        folder = self.root / "nodes" / (name or f"node-{i}")
        runtime_port = free_port()
        cmd = ["flower-supernode", "--superlink", self.address, "--port", str(runtime_port),
               "--node-config", str(node_config)]
        if self.isolation == "fedsplice":
            cmd += ["--isolation", "process"]
        if self.insecure:
            cmd.append("--insecure")
        else:
            cmd += ["--root-certificates", str(self.tls.ca_cert)]
            if key is not None:
                cmd += ["--auth-supernode-private-key", str(key.private)]
        slot = name or i
        name = name or f"supernode-{i}"
        p = self._spawn(name, cmd, folder / "home", self.root / "logs" / f"{name}.log")
        self.supernodes[slot] = p
        if self.isolation == "fedsplice":
            self.executors[slot] = self._spawn(
                f"executor-{slot}", [sys.executable, "-m", "fedsplice.runtimes.flower.executor",
                                     "--runtime-api-address", f"127.0.0.1:{runtime_port}", "--parent-pid", str(p.pid)],
                folder / "home", self.root / "logs" / f"executor-{slot}.log")
        return p

    def kill_supernode(self, i: int, sig: int = signal.SIGKILL) -> None:
        """What a host failure looks like: the SuperNode and everything under it die at once."""
        for p in (self.supernodes[i], self.executors.get(i)):
            if p is None:
                continue
            p.remember()
            try:
                os.killpg(p.pid, sig)
            except OSError:
                pass
            for pid, start in p.seen.items():
                _signal_pid(pid, sig, start)
            p.popen.wait(timeout=10)

    def watch(self) -> None:
        for p in self.procs:
            if p.alive():
                p.remember()

    # -- the run

    def run(self, app: Path, on_line: Callable[[str], None], *, timeout: float | None = None,
            on_tick: Callable[[], None] | None = None) -> int:
        """`flwr run app --stream`: submit and stream until the run ends; returns its exit code."""
        log = self.root / "logs" / "run.log"
        home = self.root / "cli"
        f = log.open("a")
        popen = subprocess.Popen(["flwr", "run", str(app), CONNECTION, "--stream"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                 env={**self.env, "FLWR_HOME": str(home)}, cwd=str(home),
                                 start_new_session=True)
        proc = Proc("flwr-run", popen, log)
        self.procs.append(proc)
        lines: queue.Queue = queue.Queue()

        def pump():
            for line in popen.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        t0 = time.monotonic()
        dead_nodes: set[int] = set()
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                f.write(line)
                f.flush()
                on_line(line.rstrip("\n"))
            self.watch()
            if not self.superlink.alive():
                raise FlowerLaunchError(f"the SuperLink died (code {self.superlink.popen.returncode}):\n"
                                        f"{self.superlink.tail()}")
            for i, p in self.supernodes.items():
                if not p.alive() and i not in dead_nodes:
                    dead_nodes.add(i)
                    self.say(f"warning: SuperNode {i} exited (code {p.popen.returncode}); "
                             f"its log: {p.log}")
            if on_tick:
                on_tick()
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise FlowerLaunchError(f"the run did not finish within {timeout:.0f}s")
        popen.wait()
        f.close()
        return popen.returncode


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
    from fedsplice.runtimes.flower.app import STATUS_FILE

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
