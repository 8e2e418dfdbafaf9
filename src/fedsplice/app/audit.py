"""`fedsplice audit RUN [--sites PATH ...]`: the server's ledger of a run against its sites'
ledgers and its split (federation.ledger). Prints one line per site and exits 1 on any mismatch.

The sites' ledgers are every `site-*.jsonl` under RUN (a simulation's `RUN/ledger/`, and a local
`fedsplice flower up`'s SuperNode folders under `RUN/flower/`) and under each --sites path
(a site's own folder or file, copied from a SuperNode on another host).
"""

from __future__ import annotations

import json
from pathlib import Path

from fedsplice.app.console import plural
from fedsplice.errors import ConfigError
from fedsplice.federation import ledger


def site_files(run: Path, extra: list[Path]) -> list[Path]:
    found: list[Path] = []
    for p in [run, *extra]:
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found += sorted(p.rglob("site-*.jsonl"))
        else:
            raise ConfigError(f"--sites {p}: no such file or folder; give a site's ledger folder or site-*.jsonl")
    return sorted(set(found))


def audit(run: Path, extra: list[Path], say=print) -> int:
    """0 when every check passes, 1 on a mismatch (each printed)."""
    folder = run / "ledger"
    if not (folder / ledger.SPLIT).is_file() or not (folder / ledger.SERVER).is_file():
        raise ConfigError(f"{run}: no ledger ({folder}/{ledger.SPLIT} and {ledger.SERVER}); give the --out of a "
                          f"`fedsplice run` or `fedsplice flower up` (runs made before the ledger existed have none)")
    try:
        split = json.loads((folder / ledger.SPLIT).read_text())
        server = ledger.read(folder / ledger.SERVER)
        sites = {str(f): ledger.read(f) for f in site_files(run, extra)}
    except ValueError as e:
        raise ConfigError(f"ledger: {e}") from None
    bad, summary = ledger.check(split, server, sites)
    for cid, s in summary.items():
        eps = f", the run's ε {s['epsilon']:.4g} at its last upload" if s["epsilon"] is not None else ""
        say(f"client {cid}: {plural(s['rounds'], 'round')}, {s['tensors']} tensors, {s['bytes'] / 1e6:.2f} MB sent, "
            f"{s['received']} matched on the server{eps}  ({s['file']})")
    say(f"server: {len(server)} tensors received; {len(split['global'])} GLOBAL and "
        f"{len(split['private'])} PRIVATE names in the split")
    for line in bad:
        say("MISMATCH " + line)
    say(f"audit: {'ok' if not bad else f'{len(bad)} mismatches'}")
    return 1 if bad else 0
