"""Where a results-suite run came from, and whether a later invocation may reuse it.

Each finished run of `fedsplice results` gets provenance.json: the commit it ran at and a hash
of the regression goldens (tests/regression/golden, which pin the numbers of every shipped
config: a change to a method's math changes them). A finished run is reused only while its
config equals the one planned now (a setting added since takes its default) and the goldens
that existed at its commit are unchanged (goldens of configs added since do not count);
otherwise it is moved aside (OUT/stale/...) and run again. Nothing is deleted.

With a records folder (`--records`, `make results`: docs/results/records, committed), the small
files of every finished run (results.json, metrics.jsonl, config.toml, provenance.json) are
copied there after the suite, and copied back into OUT before it. A fresh clone then rebuilds
the page without running anything, and a suite can be completed over several sittings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

from fedsplice.app.rundir import atomic_write_json
from fedsplice.config import to_dict
from fedsplice.data.assets import atomic_write_bytes
from fedsplice.errors import ConfigError
from fedsplice.federation.validate import saved_as_current

FILES = ("results.json", "metrics.jsonl", "config.toml", "provenance.json")
GOLDEN = Path("tests") / "regression" / "golden"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def commit() -> str:
    """The checkout's short commit, with " with uncommitted changes" where the source differs
    (the results page and its records excluded)."""
    sha = _git("rev-parse", "--short", "HEAD")
    if sha is None:
        return "unknown (not a git checkout)"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results.md",
                 ":(exclude)docs/results")
    return sha + (" with uncommitted changes" if dirty else "")


def goldens_hash(root: Path | None = None, only: set[str] | None = None) -> str | None:
    """SHA-256 (first 16 hex digits) over the golden files' paths and bytes (`only`: of those
    config folders); None without them."""
    if root is None:
        top = _git("rev-parse", "--show-toplevel")
        root = Path(top) if top else Path.cwd()
    gold = Path(root) / GOLDEN
    files = sorted(p for p in gold.rglob("*") if p.is_file()
                   and (only is None or p.relative_to(gold).parts[0] in only)) if gold.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(gold).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def stale(run_dir: Path, cfg, goldens: str | None) -> str | None:
    """Why a finished run may not be reused (None: it may)."""
    try:
        saved = tomllib.loads((run_dir / "config.toml").read_text())
        prov = json.loads((run_dir / "provenance.json").read_text())
    except (OSError, ValueError):
        return "no config.toml or provenance.json"
    try:  # a setting added since the run takes its default (the goldens say if defaults kept the numbers)
        saved = saved_as_current(saved)
    except (ConfigError, TypeError, ValueError) as e:
        return f"its config no longer parses ({e})"
    if saved != to_dict(cfg):
        return "its config differs from the suite's"
    if prov.get("goldens") != goldens and not goldens_kept(prov):
        return f"the regression goldens changed since its commit {prov.get('commit')}"
    return None


def goldens_at(commit: str) -> set[str] | None:
    """The config folders of the goldens at `commit` (None: not in this checkout's history)."""
    names = _git("ls-tree", "--name-only", f"{commit}:{GOLDEN.as_posix()}")
    return set(names.split()) if names else None


def goldens_kept(prov: dict, root: Path | None = None) -> bool:
    """Whether every golden that existed at the run's commit is unchanged now: goldens of configs
    added since (a new method) pin other numbers and do not make the run stale."""
    sha = str(prov.get("commit") or "").split(" ")[0]
    then = goldens_at(sha) if sha and sha != "unknown" else None
    return then is not None and prov.get("goldens") is not None and goldens_hash(root, only=then) == prov["goldens"]


def prepare(runs, out: Path, records: Path | None, goldens: str | None) -> dict[str, int]:
    """Before a suite: restore valid records into OUT, move finished runs that may not be reused
    to OUT/stale/<time>/. Returns counts {restored, stale}."""
    counts, stamp = {"restored": 0, "stale": 0}, time.strftime("%Y%m%d-%H%M%S")
    for _, _, cfg, d in runs:
        rel = Path(d).relative_to(out)
        rec = records / rel if records is not None else None
        if not (d / "results.json").exists() and rec is not None and (rec / "results.json").exists() \
                and stale(rec, cfg, goldens) is None:
            for f in FILES:
                if (rec / f).exists():
                    atomic_write_bytes(d / f, (rec / f).read_bytes())
            counts["restored"] += 1
        elif (d / "results.json").exists() and stale(d, cfg, goldens) is not None:
            aside = out / "stale" / stamp / rel
            aside.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(d), str(aside))
            counts["stale"] += 1
    return counts


def _record(d: Path, out: Path, records: Path | None) -> None:
    if records is not None:
        for f in FILES:
            if (d / f).exists():
                atomic_write_bytes(records / Path(d).relative_to(out) / f, (d / f).read_bytes())


def stamper(prov: dict, out: Path, records: Path | None):
    """`compare.run_all`'s on_done: a run finished by this invocation gets its provenance and its
    record at once (a suite stopped later keeps what it finished, also in the records)."""
    def done(run) -> None:
        atomic_write_json(run[3] / "provenance.json", prov)
        _record(run[3], out, records)
    return done


def finish(runs, out: Path, records: Path | None) -> dict[str, int]:
    """After a suite: copy every run's small files to the records folder (atomically, file by
    file). Returns {commit: runs} over all runs."""
    by_commit: dict[str, int] = {}
    for _, _, _, d in runs:
        c = json.loads((d / "provenance.json").read_text()).get("commit", "unknown")
        by_commit[c] = by_commit.get(c, 0) + 1
        _record(d, out, records)
    return by_commit
