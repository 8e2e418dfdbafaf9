"""`fedsplice flower ...`: up (local deployment), app (a Flower App folder for `flwr run`),
certs (TLS + SuperNode keys for a multi-host deployment), executor (the warm ClientApp
executor next to a SuperNode). Registered by fedsplice.app.cli; imports flwr only when run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> None:
    f = sub.add_parser("flower", help="run on Flower's deployment engine (SuperLink + SuperNodes)",
                       description="Run fedsplice experiments on Flower (flwr 1.42); see docs/flower.md.")
    fs = f.add_subparsers(dest="flower_cmd", required=True)

    u = fs.add_parser("up", help="start a SuperLink and N SuperNodes here, run CONFIG, tear down")
    u.add_argument("config", nargs="?", type=Path)
    u.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    u.add_argument("--out", help="run directory (default runs/<algorithm>-<time>)")
    u.add_argument("--supernodes", type=int, default=None, metavar="N",
                   help="SuperNodes to start (default runtime.num_supernodes); node p serves clients cid %% N == p")
    u.add_argument("--insecure", action="store_true", default=None,
                   help="no TLS, no SuperNode authentication (trusted loopback only)")
    u.add_argument("--isolation", choices=["fedsplice", "subprocess"], default="fedsplice",
                   help="fedsplice: a warm executor per SuperNode (default); subprocess: Flower's stock "
                        "SuperExec, one Python process per message (slow: it reloads the model each time)")
    u.add_argument("--overwrite", action="store_true", help="reuse a non-empty run directory")
    u.add_argument("--site-data", action="append", default=[], metavar="SPEC",
                   help="per-site data (data.dataset = 'sites'): SuperNode i's own file, e.g. csv:site0.csv; "
                        "once per SuperNode")
    u.add_argument("--devices", metavar="LIST",
                   help="comma-separated devices, cycled over the SuperNodes (node p gets the (p mod len)-th), "
                        "e.g. cuda:0,cuda:1; each node's model trains there (node config device). Default: "
                        "runtime.devices, else every node uses runtime.device")
    u.add_argument("--quiet", action="store_true")
    u.set_defaults(fn=cmd_up)

    a = fs.add_parser("app", help="write a Flower App folder for CONFIG (multi-host: `flwr run APP_DIR`)")
    a.add_argument("config", nargs="?", type=Path)
    a.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a.add_argument("--app-dir", required=True, help="the folder to write (pyproject.toml)")
    a.add_argument("--out", required=True, help="the run directory, on the SuperLink's host")
    a.add_argument("--min-nodes", type=int, default=None,
                   help="SuperNodes to wait for (default runtime.num_supernodes)")
    a.set_defaults(fn=cmd_app)

    c = fs.add_parser("certs", help="a CA + SuperLink certificate and SuperNode key pairs (cryptography)")
    c.add_argument("--out", required=True, help="folder to write ca.crt, server.pem, server.key, node-*/")
    c.add_argument("--host", action="append", default=[], help="the SuperLink's DNS name or IP (repeatable)")
    c.add_argument("--nodes", type=int, default=2, help="SuperNode key pairs to make")
    c.add_argument("--days", type=int, default=365)
    c.set_defaults(fn=cmd_certs)

    e = fs.add_parser("executor", help="serve a SuperNode's ClientApp tasks in one warm process")
    e.add_argument("--runtime-api-address", required=True, help="the SuperNode's --port, as host:port")
    e.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    e.set_defaults(fn=cmd_executor)


def need_flower(feature: str) -> None:
    """Flower and the launcher's process tools are an extra: one line where they are missing."""
    from fedsplice.errors import need

    for module in ("flwr", "psutil", "cryptography"):
        need(module, "flower", feature)


def run_flower(cfg, out: Path, overwrite: bool = False, quiet: bool = False, **launch) -> dict:
    """`up` with the launch options `launch` (fields of `launcher.Launch`)."""
    need_flower("runtime.kind = 'flower'")
    from fedsplice.app.flower.launcher import Launch, up

    return up(cfg, out, Launch(overwrite=overwrite, quiet=quiet, **launch))


def resume_flower(out: Path, quiet: bool = False) -> dict:
    """`fedsplice resume OUT` of a Flower run: relaunch the local deployment that ran it (`up`),
    or say how to resubmit it to a remote one."""
    import json

    need_flower("resuming a Flower run")

    from fedsplice.app.flower.processes import tagged
    from fedsplice.app.flower.resume import LAUNCH_FILE
    from fedsplice.errors import ConfigError
    from fedsplice.federation.validate import load_run_config

    out = Path(out)
    launch = out / "flower" / LAUNCH_FILE
    if not (out / "config.toml").is_file():
        raise ConfigError(f"{out}: no config.toml, the Flower run was stopped before it started; start it "
                          f"again with `fedsplice flower up CONFIG --out {out} --overwrite`")
    if not launch.is_file():
        raise ConfigError(
            f"{out} is a Flower run on a remote deployment: restart its SuperNodes with the same node config "
            f"(state-dir, partition-id), then resubmit its Flower App with `flwr run APP_DIR CONNECTION "
            f"--run-config resume=true --stream` (APP_DIR: `fedsplice flower app CONFIG --out {out} ...`)")
    how = json.loads(launch.read_text())
    left = sorted(p.pid for p in tagged(how["tag"]))
    if left:
        pids = " ".join(map(str, left))
        raise ConfigError(f"{out}: processes of this run are still running (pids {pids}); let it finish, "
                          f"or stop them (kill {pids}) and resume again")
    cfg = load_run_config(out / "config.toml")
    return run_flower(cfg, out, quiet=quiet, resume=True, supernodes=cfg.runtime.num_supernodes,
                      insecure=cfg.runtime.insecure, isolation=how["isolation"], node_wait_s=float(how["node_wait_s"]),
                      site_data=tuple(how.get("site_data", [])),
                      devices=None if how.get("devices") is None else tuple(how["devices"]))


def cmd_up(args) -> None:
    from fedsplice.app.rundir import default_out
    from fedsplice.app.summary import print_table
    from fedsplice.federation.validate import load_config
    need_flower("fedsplice flower up")
    from fedsplice.app.flower.launcher import parse_devices

    devices = None if args.devices is None else tuple(parse_devices(args.devices))
    cfg = load_config(args.config, args.set)
    out = Path(args.out) if args.out else default_out(cfg)
    results = run_flower(cfg, out, overwrite=args.overwrite, quiet=args.quiet, supernodes=args.supernodes,
                         insecure=args.insecure, isolation=args.isolation, site_data=tuple(args.site_data or ()),
                         devices=devices)
    if not args.quiet:
        print_table(results)
        print(f"results: {out / 'results.json'}", file=sys.stderr)


def cmd_app(args) -> None:
    import dataclasses

    from fedsplice.federation.validate import load_config
    need_flower("fedsplice flower app")
    from fedsplice.app.flower.launcher import write_app

    cfg = load_config(args.config, args.set)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, kind="flower"))
    n = args.min_nodes or cfg.runtime.num_supernodes
    path = write_app(Path(args.app_dir), cfg, Path(args.out), min_nodes=n)
    print(f"Flower App written to {path}; run it with: flwr run {path} <superlink-connection> --stream\n"
          f"(resume a stopped run from its last checkpoint: add --run-config resume=true)")


def cmd_certs(args) -> None:
    need_flower("fedsplice flower certs")
    from fedsplice.runtimes.flower.certs import make_node_key, make_tls

    out = Path(args.out)
    tls = make_tls(out, hosts=args.host or None, days=args.days)
    print(f"CA: {tls.ca_cert}\nSuperLink certificate: {tls.server_cert}\nSuperLink key: {tls.server_key}")
    for i in range(args.nodes):
        k = make_node_key(out / f"node-{i}", "auth-key")
        print(f"SuperNode {i}: private key {k.private}, public key {k.public}")


def cmd_executor(args) -> None:
    need_flower("fedsplice flower executor")
    from fedsplice.runtimes.flower.executor import run_executor

    run_executor(args.runtime_api_address, args.parent_pid)


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd", required=True))
    a = p.parse_args()
    a.fn(a)
