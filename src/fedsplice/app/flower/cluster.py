"""A SuperLink and SuperNodes as separate processes on 127.0.0.1, and one `flwr run` on them.

Used by `fedsplice flower up` (`launcher.up`); see the launcher's docstring for the commands.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomli_w

from fedsplice.app.flower.processes import TAG_VAR, Proc, free_port, stop_procs
from fedsplice.errors import ConfigError, FedspliceError
from fedsplice.runtimes.flower import certs

# "fedsplice": SuperNodes with --isolation process, each served by a warm fedsplice executor
# (executor.py); "subprocess": Flower's stock SuperExec, one flwr-clientapp process per message.
ISOLATIONS = ("fedsplice", "subprocess")
CONNECTION = "fedsplice"  # the SuperLink connection's name in the CLI's config.toml


class FlowerLaunchError(FedspliceError):
    """The local Flower deployment could not start, or the run failed; the message says why."""


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
        self.supernodes: dict[int | str, Proc] = {}  # partition i, or the name of an extra one
        self.executors: dict[int | str, Proc] = {}
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

    def __enter__(self) -> Cluster:
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
        conn: dict[str, str | bool] = {"address": self.address}
        if self.insecure:
            conn["insecure"] = True
        else:
            assert self.tls is not None  # made above (not insecure)
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

    def add_supernodes(self, n: int, extra: dict | None = None, per_node: list[dict] | None = None) -> None:
        """Register n node keys (in parallel), then start n SuperNodes, partition i of n; `per_node`:
        node i's own node-config entries (its site's data file)."""
        keys = {}
        if not self.insecure:
            for i in range(n):
                keys[i] = certs.make_node_key(self.root / "nodes" / f"node-{i}", "auth-key")
            with ThreadPoolExecutor(n) as pool:
                ids = list(pool.map(lambda i: self.register(keys[i].public), range(n)))
            self.node_ids.update(dict(enumerate(ids)))
        for i in range(n):
            self.start_supernode(i, self.node_config(i, n, {**(extra or {}), **(per_node[i] if per_node else {})}),
                                 keys.get(i))

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
            assert self.tls is not None  # made by start_superlink
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
            p.kill_tree(sig)
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
        dead_nodes: set[int | str] = set()
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
