"""`fedsplice run | resume | compare | report | validate | list | audit | export | leaderboard`, and
the subcommands other packages register (`fedsplice results`: fedsplice.study).
User errors print one line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from fedsplice.errors import ConfigError, FedspliceError, need


def cmd_run(args) -> None:
    from fedsplice.app.rundir import default_out
    from fedsplice.app.runner import console, run_experiment
    from fedsplice.app.summary import print_table
    from fedsplice.federation.validate import load_config

    cfg = load_config(args.config, args.set)
    out = Path(args.out) if args.out else default_out(cfg)
    if cfg.runtime.kind == "flower":  # the same config on Flower's deployment engine (docs/flower.md)
        from fedsplice.app.flower.cli import run_flower

        results = run_flower(cfg, out, overwrite=args.overwrite, quiet=args.quiet)
    else:
        results = run_experiment(cfg, out, overwrite=args.overwrite, quiet=args.quiet)
    if not args.quiet:
        print_table(results)
        console.print(f"results: {out / 'results.json'}")


def cmd_resume(args) -> None:
    from fedsplice.app.flower.resume import is_flower_run
    from fedsplice.app.runner import console, resume_experiment
    from fedsplice.app.summary import print_table

    if is_flower_run(Path(args.run_dir)):  # on the Flower deployment that ran it (docs/flower.md)
        from fedsplice.app.flower.cli import resume_flower

        results = resume_flower(Path(args.run_dir), quiet=args.quiet)
    else:
        results = resume_experiment(Path(args.run_dir), quiet=args.quiet)
    if not args.quiet:
        print_table(results)
        console.print(f"results: {Path(args.run_dir) / 'results.json'}")


def cmd_compare(args) -> None:
    from fedsplice.app.compare import compare
    from fedsplice.app.runner import console

    out = Path(args.out)
    rows = compare(args.configs, args.seeds, args.set, out, quiet=args.quiet, jobs=args.jobs)
    if not args.quiet:
        console.print((out / "table.md").read_text())
        console.print(f"{len(rows)} methods x {args.seeds} seeds: {out / 'table.md'}, {out / 'table.csv'}, "
                      f"plots in {out}")


def cmd_report(args) -> None:
    need("markdown_it", "report", "fedsplice report")
    from fedsplice.app.report import ink, screenshot, write_report

    page = write_report(Path(args.dir), args.out)
    print(f"report: {page}")
    if args.screenshot:
        png = screenshot(page, Path(args.screenshot))
        print(f"screenshot: {png} ({ink(png):.1%} of the pixels not white)")


def cmd_validate(args) -> None:
    from fedsplice.data.report import summary_lines
    from fedsplice.errors import ModelUnavailable
    from fedsplice.federation.plan import plan
    from fedsplice.federation.validate import check_data, load_config

    cfg = load_config(args.config, args.set)
    try:  # the recipe and every combination check, from the model's skeleton: no weights
        planned = plan(cfg)
        print(f"plan: {len(planned.global_names)} GLOBAL and {len(planned.private_names)} PRIVATE tensors")
    except ModelUnavailable as e:  # a hub model offline: the config and data are still checked
        print(f"plan: skipped ({e}); the recipe's checks run when the model can be read")
    if not args.no_data:
        print("\n".join(summary_lines(check_data(cfg))))
    print(f"ok: {args.config or 'embedded default'} ({cfg.algorithm}, {cfg.model.name}, {cfg.data.dataset})")


def _toml(v) -> str:
    """A value as a config file writes it, on one line."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return str(v).lower() if isinstance(v, bool) else json.dumps(v) if isinstance(v, str) else repr(v)


def cmd_list(args) -> None:
    if args.what == "algorithms":
        from fedsplice.algorithms import available

        for name, a in available().items():  # built-ins, registered ones and installed entry points
            print(f"{name:12s} {a.description}" + (f"  [{a.paper}]" if a.paper else ""))
            if dataclasses.is_dataclass(a.params) and dataclasses.fields(a.params):  # its settings, as TOML
                try:
                    shown = [f"{k} = {_toml(v)}" for k, v in dataclasses.asdict(a.params()).items()]
                except TypeError:  # a user's dataclass with required fields: their names
                    shown = [f.name for f in dataclasses.fields(a.params)]
                print(f"{'':12s} [method] " + ", ".join(shown))
        print("server optimizers: fedavg, fedavgm, fedadam, fedyogi, fedadagrad ([server] optimizer)")
        from fedsplice.algorithms.switches import SWITCHES

        for name, sw in SWITCHES.items():  # composed onto any method: [switch.NAME] turns one on
            try:
                shown = [f"{k} = {_toml(v)}" for k, v in dataclasses.asdict(sw.params()).items()]
            except TypeError:  # a user's dataclass with required fields: their names
                shown = [f.name for f in dataclasses.fields(sw.params)]
            print(f"switch {name}: {sw.description}  [{sw.paper}]\n{'':12s} [switch.{name}] " + ", ".join(shown))
    elif args.what == "datasets":
        from fedsplice.data.datasets import describe_datasets

        # Sizes are the measured sample counts: an official train/test split, or all samples
        # (the balanced test set is then drawn from them). Listing downloads nothing.
        for d in describe_datasets():
            size = (f"{d['n_train']:,} train / {d['n_test']:,} test" if d["n_test"]
                    else f"{d['n_train']:,} samples")
            print(f"{d['name']:14s} {d['modality']:10s} {d['classes']:>3} classes  {size:26s} "
                  f"{d['download_mb']:6.1f} MB  {'fetched' if d['fetched'] else 'not fetched':11s}"
                  f"  ({d['source']})")
    else:
        from fedsplice.data.zoo import describe_models

        for m in describe_models():
            print(f"{m['name']:14s} {m['description']}  {'fetched' if m['fetched'] else 'not fetched'}")


def cmd_audit(args) -> int:
    from fedsplice.app.audit import audit

    return audit(Path(args.run_dir), [Path(p) for p in args.sites])


def cmd_export(args) -> int:
    from fedsplice.app.export import export

    meta = export(Path(args.run_dir), Path(args.out), args.client, args.merge)
    who = "the global model" if args.client is None else f"client {args.client}"
    print(f"{who} of {args.run_dir} (round {meta['round']}) -> {args.out}: "
          f"{meta['lora_tensors']} LoRA tensors (PEFT format), {len(meta['parts'])} other parts"
          + (", merged model in merged/" if args.merge else ""))
    return 0


def cmd_leaderboard(args) -> None:
    from fedsplice.app.leaderboard import leaderboard_row, markdown

    print(markdown(leaderboard_row(Path(args.run_dir), args.benchmark)))


def add_plugin_parsers(sub) -> None:
    """Subcommands that other packages register under the entry-point group "fedsplice.commands"
    (each an `add_parser(subparsers)`): `fedsplice results` comes from fedsplice.study this way,
    so the library never imports the study package."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group="fedsplice.commands"), key=lambda e: e.name):
        ep.load()(sub)


def main(argv=None) -> int:
    """Longer than 60 lines: one argparse declaration per subcommand, read top to bottom."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = argparse.ArgumentParser(prog="fedsplice", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run an experiment (no CONFIG: the embedded default)")
    r.add_argument("config", nargs="?", type=Path)
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    r.add_argument("--out", help="run directory (default runs/<algorithm>-<time>)")
    r.add_argument("--overwrite", action="store_true", help="reuse a non-empty run directory")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(fn=cmd_run)
    rs = sub.add_parser("resume", help="continue a killed run (also a Flower one) from its last complete checkpoint")
    rs.add_argument("run_dir", metavar="RUN_DIR", help="the --out of the run (its config.toml is used)")
    rs.add_argument("--quiet", action="store_true")
    rs.set_defaults(fn=cmd_resume)
    c = sub.add_parser("compare", help="run configs x seeds on the same clients and sampling; table + plots")
    c.add_argument("configs", nargs="+", type=Path, metavar="CONFIG")
    c.add_argument("--seeds", type=int, default=1, help="seeds per config: seed, seed+1, ... (default 1)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field of every config")
    c.add_argument("--out", required=True, help="comparison directory; run again to finish an interrupted one")
    c.add_argument("--jobs", type=int, default=1,
                   help="runs at once, each in its own process with cores/jobs torch threads (default 1)")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(fn=cmd_compare)
    rp = sub.add_parser("report", help="one self-contained HTML page (tables, plots) of a run or comparison")
    rp.add_argument("dir", metavar="RUN_OR_COMPARE_DIR")
    rp.add_argument("--out", type=Path, help="HTML file (default DIR/report.html)")
    rp.add_argument("--screenshot", metavar="PNG", help="also render the page with headless Chromium into PNG")
    rp.set_defaults(fn=cmd_report)
    v = sub.add_parser("validate", help="check a config, plan its model and read its data, without loading weights")
    v.add_argument("config", nargs="?", type=Path)
    v.add_argument("--no-data", action="store_true", help="check the config only; do not read the data")
    v.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    v.set_defaults(fn=cmd_validate)
    ls = sub.add_parser("list", help="list algorithms, datasets or models")
    ls.add_argument("what", choices=["algorithms", "datasets", "models"])
    ls.set_defaults(fn=cmd_list)
    au = sub.add_parser("audit", help="check what left each site (its ledger) against the server's view and the split")
    au.add_argument("run_dir", metavar="RUN_DIR", help="the --out of a run or of `fedsplice flower up`")
    au.add_argument("--sites", action="append", default=[], metavar="PATH",
                    help="a site's ledger folder or site-*.jsonl from another host (repeatable)")
    au.set_defaults(fn=cmd_audit)
    ex = sub.add_parser("export", help="a run's adapters as a PEFT folder (PeftModel.from_pretrained), the rest beside")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="the --out of a run")
    ex.add_argument("out", metavar="OUT", help="the folder to write")
    who = ex.add_mutually_exclusive_group(required=True)
    who.add_argument("--client", type=int, metavar="K", help="client K's model (GLOBAL + its PRIVATE tensors)")
    who.add_argument("--global", dest="global_model", action="store_true",
                     help="the global model (GLOBAL + the PRIVATE tensors' initial values, as GM scores it)")
    ex.add_argument("--merge", action="store_true", help="also write the base with the LoRA merged in (OUT/merged)")
    ex.set_defaults(fn=cmd_export)
    lb = sub.add_parser("leaderboard", help="a FlowerTune run as a row of the FlowerTune LLM leaderboard's table")
    lb.add_argument("run_dir", metavar="RUN_DIR", help="the --out of a run of configs/flowertune-*.toml")
    lb.add_argument("--benchmark", metavar="NAME",
                    help="the run's global test set is this benchmark (e.g. PubMedQA): fill its cell from GM")
    lb.set_defaults(fn=cmd_leaderboard)
    from fedsplice.app.flower.cli import add_parser as add_flower_parser  # `fedsplice flower up|app|certs|executor`

    add_flower_parser(sub)
    add_plugin_parsers(sub)
    args = p.parse_args(argv)
    try:
        rc = args.fn(args)  # audit: 1 on a mismatch
    except FedspliceError as e:
        # a config error is one line (a value's control characters escaped); a launch error may
        # carry a process's log tail
        print(f"fedsplice: error: {one_line(str(e)) if isinstance(e, ConfigError) else e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedsplice: interrupted", file=sys.stderr)
        return 130
    return rc or 0


def one_line(text: str) -> str:
    """An error as one printable line: a control character a config value brought in (a
    newline, or \\x1e, which str.splitlines also breaks at) is shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


if __name__ == "__main__":
    sys.exit(main())
