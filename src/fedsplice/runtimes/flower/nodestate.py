"""A SuperNode's PRIVATE state between messages: where it lives, the per-round snapshots a
resumed run rolls back to, and their pruning (see `fedsplice.runtimes.flower.client`)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from fedsplice.federation import DiskStore
from fedsplice.runtimes.flower.transport import RUN_KEY_FIELD

HISTORY = "rounds"  # run-<key>/rounds/round-NNNNNN/client-CCCCC.safetensors: the state after that round's fit
_RUN_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # it names a folder: nothing like "../"


def state_root(nc) -> Path:
    return Path(str(nc.get("state-dir", Path.home() / ".cache" / "fedsplice" / "flower-state"))).expanduser()


def run_folder(root: Path, task, run_id: int) -> Path:
    key = task.get(RUN_KEY_FIELD) if task is not None else None
    if key is None:
        return root / f"run-{run_id}"
    if not _RUN_KEY.match(str(key)):
        raise ValueError(f"bad run key {key!r}")
    return root / f"run-{key}"


def _link(src: Path, dst: Path) -> None:
    """dst = src, replaced atomically; a hard link is safe because DiskStore replaces files, never edits them."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def rounds_kept(folder: Path) -> list[tuple[int, Path]]:
    hist = folder / HISTORY
    found = [(int(p.name[len("round-"):]), p) for p in hist.glob("round-*")] if hist.is_dir() else []
    return sorted(found)


def snapshot(store: DiskStore, cid: int, rnd: int) -> None:
    dst = store.root / HISTORY / f"round-{rnd:06d}" / store.path(cid).name
    dst.parent.mkdir(parents=True, exist_ok=True)
    _link(store.path(cid), dst)


def prune(folder: Path, rnd: int, rt, rounds: int) -> None:
    """Before round `rnd` the server has checkpointed every scheduled round < rnd and keeps the
    newest `keep_checkpoints`; a resume restores one of them or a later one, so of the snapshots
    of rounds <= the oldest kept, only each client's newest one can be needed."""
    every = rt.checkpoint_every
    kept = [r for r in range(1, rnd) if r % every == 0 or r == rounds][-rt.keep_checkpoints:]
    if not kept:
        return
    seen: set[str] = set()
    for r, d in reversed(rounds_kept(folder)):
        if r > kept[0]:
            continue
        for f in sorted(d.glob("client-*.safetensors")):
            if f.name in seen:
                f.unlink()
            seen.add(f.name)
        if not any(d.iterdir()):
            d.rmdir()


def rollback(folder: Path, rnd: int) -> None:
    """Every client's PRIVATE state as at the end of round `rnd`: its last snapshot of a round <= rnd,
    none (fresh) if it had not trained by then; later snapshots are dropped. 0: a fresh start.
    Idempotent, so a rollback cut short is simply done again."""
    if rnd <= 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        return
    if not folder.is_dir():
        raise ValueError(f"no PRIVATE state of this run in {folder}: resume on the SuperNodes that ran it, "
                         "with the same node config (state-dir, partition-id)")
    hist = rounds_kept(folder)
    for f in folder.glob("client-*.safetensors"):
        f.unlink()
    for r, d in hist:  # oldest first: a later round's snapshot replaces an earlier one
        if r <= rnd:
            for f in d.glob("client-*.safetensors"):
                _link(f, folder / f.name)
    for r, d in hist:
        if r > rnd:
            shutil.rmtree(d)
