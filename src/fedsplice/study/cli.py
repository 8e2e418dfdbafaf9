"""`fedsplice results SUITE`: registered under the entry-point group "fedsplice.commands"
(pyproject.toml), which the library's CLI loads without importing this package by name."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_results(args: argparse.Namespace) -> None:
    from fedsplice.study.results import run_suite

    doc = run_suite(args.suite, Path(args.out), Path(args.doc), seeds=args.seeds, jobs=args.jobs, quiet=args.quiet,
                    command=args.command or "", records=Path(args.records) if args.records else None)
    print(f"results: {doc} (tables and plots in {doc.with_suffix('')})")


def add_parser(sub: argparse._SubParsersAction) -> None:
    rr = sub.add_parser("results", help="run a results suite (the papers' tables) and write its markdown page")
    rr.add_argument("suite", type=Path, metavar="SUITE", help="e.g. configs/results/suite.toml")
    rr.add_argument("--out", default="runs/results", help="where the runs go (default runs/results); resumable")
    rr.add_argument("--doc", default="docs/results.md", help="the page to write (default docs/results.md)")
    rr.add_argument("--seeds", type=int, help="override the suite's seeds")
    rr.add_argument("--jobs", type=int, help="override the suite's runs at once")
    rr.add_argument("--records", help="keep finished runs' small files here and restore them (docs/results/records)")
    rr.add_argument("--command", help=argparse.SUPPRESS)  # how the page says it was made (make results)
    rr.add_argument("--quiet", action="store_true")
    rr.set_defaults(fn=cmd_results)
