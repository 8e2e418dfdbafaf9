"""Checkpoints: everything a run needs to continue after a crash as if nothing happened.

A checkpoint is a folder `checkpoints/round-NNNNNN/` in the run directory:

    state.json          format, round, byte totals, config and sampling digests, file sizes,
                        Python/NumPy global RNG states, the client ids in the store
    metrics.jsonl       the run's metrics.jsonl up to and including this round (verbatim lines)
    global.safetensors  the GLOBAL tensors after this round's server step
    server.safetensors  the server optimizer's state (a flat tensor dict, see server.py)
    rng.safetensors     torch's global CPU RNG state
    clients/client-NNNNN.safetensors   one client's PRIVATE tensors and optimizer state
                                       ("param/<name>", "opt/<name>/<slot>"), as in the store

No pickle: tensors are safetensors, the rest JSON. A checkpoint is written into a hidden
temporary folder, every file fsynced, then renamed into place and the parent fsynced, so a
`round-*` folder is always complete; a crash mid-write leaves only a `.round-*.tmp*` folder,
which is ignored and removed later. The last `keep` checkpoints are kept.

Client files are immutable once written, so a client that did not train since the previous
checkpoint is hard-linked from it (and a disk store's files are linked from the store): a
checkpoint costs the GLOBAL tensors, the server state and the clients of the rounds since the
previous one, not the whole store.

What is *not* saved, because it is re-derived from the config and seed on resume: the data,
the partition, the model and its initial adapters, and the client-sampling stream (round r
trains `exp.sampling[r-1]`, so the position in the stream is the round index; its digest is
saved and checked). Per-(round, client) randomness is seeded from (seed, round, client).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedsplice.algorithms.switches import moves
from fedsplice.config import ExperimentConfig, saved_as_current, to_dict
from fedsplice.core.server import Params
from fedsplice.data.assets import dumps, share_mode
from fedsplice.errors import ConfigError, FedspliceError

if TYPE_CHECKING:
    from fedsplice.federation.store import Store

FORMAT = 1
DIRNAME = "checkpoints"
_NAME = re.compile(r"^round-(\d{6})$")


class CheckpointError(FedspliceError):
    """A checkpoint cannot be written or read back (disk full, corrupt, config changed)."""


@dataclass
class RoundState:
    """The server's state at the end of a round: what `run_rounds` needs to continue."""

    round: int
    global_params: dict[str, torch.Tensor]
    server_state: dict[str, torch.Tensor]
    up_bytes: int
    down_bytes: int


def config_digest(cfg: ExperimentConfig) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def sampling_digest(sampling: list[list[int]], rounds: int) -> str:
    return hashlib.sha256(json.dumps(sampling[:rounds]).encode()).hexdigest()


# --------------------------------------------------------------------------- file helpers


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())


def _client_file(cid: int) -> str:
    return f"client-{cid:05d}.safetensors"


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / "state.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(root: Path) -> Path | None:
    cps = checkpoints(root)
    return cps[-1][1] if cps else None


def remove_partial(root: Path) -> None:
    """Delete temporary folders left by a write that was killed."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".round-") and ".tmp" in p.name:
                shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- writing


class Checkpointer:
    """Writes the checkpoints of one run (and knows the previous one, to link unchanged clients)."""

    def __init__(self, out: Path, cfg: ExperimentConfig, sampling: list[list[int]], keep: int):
        self.root = Path(out) / DIRNAME
        self.cfg, self.sampling, self.keep = cfg, sampling, keep
        self.cfg_digest = config_digest(cfg)
        self._prev: tuple[int, Path] | None = None  # (round, folder) of the newest checkpoint

    def follow(self, rnd: int, path: Path) -> None:
        """Continue after checkpoint `path` of round `rnd` (on resume): link unchanged clients from it."""
        self._prev = (rnd, Path(path))

    def save(self, state: RoundState, store: Store, metrics_lines: list[str]) -> Path:
        try:
            return self._save(state, store, metrics_lines)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint of round {state.round} not written ({e.strerror or e}); the previous "
                f"checkpoint is intact: free space in {self.root.parent} and run "
                f"`fedsplice resume {self.root.parent}`") from None

    def _save(self, state: RoundState, store: Store, metrics_lines: list[str]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        remove_partial(self.root)
        name = f"round-{state.round:06d}"
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{name}.tmp"))
        try:
            share_mode(tmp, directory=True)  # mkdtemp's 0700 would hide the checkpoint from the group
            files: dict[str, int] = {}

            def put(rel: str, data: bytes) -> None:
                _write(tmp / rel, data)
                files[rel] = len(data)

            put("global.safetensors", st_save(_contig(state.global_params)))
            put("server.safetensors", st_save(_contig(state.server_state)))
            put("rng.safetensors", st_save({"torch": torch.get_rng_state()}))
            put("metrics.jsonl", ("\n".join(metrics_lines) + "\n").encode())
            cids = self._save_clients(tmp / "clients", state.round, store, files)
            np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())  # legacy=True
            meta = {
                "format": FORMAT,
                "round": state.round,
                "up_bytes": state.up_bytes,
                "down_bytes": state.down_bytes,
                "config_sha256": self.cfg_digest,
                "sampling_sha256": sampling_digest(self.sampling, state.round),
                "clients": cids,
                "files": files,
                "python_random": _jsonable(random.getstate()),
                "numpy_random": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            }
            _write(tmp / "state.json", (dumps(meta) + "\n").encode())  # last: marks it whole
            _fsync_dir(tmp / "clients")
            _fsync_dir(tmp)
            final = self.root / name
            if final.exists():  # an earlier attempt at this round (before a crash): replace it
                old = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{name}.tmp-old"))
                os.replace(final, old / name)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prev = (state.round, final)
        self._prune()
        return final

    def _save_clients(self, cdir: Path, rnd: int, store: Store, files: dict[str, int]) -> list[int]:
        from fedsplice.federation.store import DiskStore

        cdir.mkdir()
        cids = list(store.clients())
        touched: set[int] | None = None
        if self._prev is not None:  # clients sampled since the previous checkpoint
            touched = {c for r in range(self._prev[0] + 1, rnd + 1) for c in self.sampling[r - 1]}
        for cid in cids:
            rel = f"clients/{_client_file(cid)}"
            prev = self._prev[1] / rel if self._prev is not None else None
            if touched is not None and cid not in touched and prev is not None and prev.exists():
                _link_or_copy(prev, cdir / _client_file(cid))
            elif isinstance(store, DiskStore):  # its files are replaced atomically, never edited
                _link_or_copy(store.path(cid), cdir / _client_file(cid))
            else:
                _write(cdir / _client_file(cid), st_save(_contig(cast(Params, store.get(cid)))))  # listed, so held
            files[rel] = (cdir / _client_file(cid)).stat().st_size
        return cids

    def _prune(self) -> None:
        cps = checkpoints(self.root)
        for _, p in cps[:max(len(cps) - self.keep, 0)]:
            shutil.rmtree(p, ignore_errors=True)


def _contig(t: Params) -> Params:
    return {k: v.detach().contiguous().cpu() for k, v in t.items()}


def _jsonable(x: object) -> object:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x: Any) -> Any:  # parsed JSON: lists become tuples
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


# --------------------------------------------------------------------------- reading


@dataclass
class Loaded:
    state: RoundState
    clients: dict[int, dict[str, torch.Tensor]]
    metrics_lines: list[str]
    meta: dict[str, Any]  # state.json (parsed JSON), and torch's RNG state
    path: Path


def check(path: Path, cfg: ExperimentConfig) -> dict[str, Any]:
    """Cheap (before the build): the checkpoint is whole and was written for this very config.
    Returns its state.json."""
    path = Path(path)
    try:
        meta: dict[str, Any] = json.loads((path / "state.json").read_text())
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this "
                                  f"fedsplice reads format {FORMAT}")
        for rel, size in meta["files"].items():
            got = (path / rel).stat().st_size
            if got != size:
                raise CheckpointError(f"{path / rel}: {got} bytes, the checkpoint recorded {size}; "
                                      f"it is damaged: delete {path} to fall back to the one before")
        digest = meta["config_sha256"]
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e}); delete it "
                              f"to fall back to the one before") from None
    if digest != config_digest(cfg) and not _written_before_new_settings(path, digest, cfg):
        raise CheckpointError(f"{path}: written for a different config than {path.parent.parent}"
                              f"/config.toml; resume needs the config the run started with")
    return meta


def _written_before_new_settings(path: Path, digest: str, cfg: ExperimentConfig) -> bool:
    """The checkpoint was written for its run's config.toml, and that file read by this version
    (a setting added since takes its default) is `cfg`: a run resumes across such an upgrade."""
    try:
        saved = tomllib.loads((path.parent.parent / "config.toml").read_text())
        return (hashlib.sha256(json.dumps(saved, sort_keys=True).encode()).hexdigest() == digest
                and saved_as_current(saved, moves()) == to_dict(cfg))
    except (OSError, ValueError, TypeError, ConfigError):
        return False


def load(path: Path, cfg: ExperimentConfig, sampling: list[list[int]]) -> Loaded:
    """Read a checkpoint back and check it belongs to this config and sampling stream."""
    path = Path(path)
    meta = check(path, cfg)
    try:
        def tensors(rel: str) -> Params:
            return st_load((path / rel).read_bytes())

        state = RoundState(int(meta["round"]), tensors("global.safetensors"),
                           tensors("server.safetensors"), int(meta["up_bytes"]), int(meta["down_bytes"]))
        clients = {int(c): tensors(f"clients/{_client_file(int(c))}") for c in meta["clients"]}
        lines = (path / "metrics.jsonl").read_text().splitlines()
        rng_torch = tensors("rng.safetensors")["torch"]
    except Exception as e:  # OSError, bad JSON, a safetensors header that does not parse, ...
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e}); delete it "
                              f"to fall back to the one before") from None
    if meta["sampling_sha256"] != sampling_digest(sampling, state.round):
        raise CheckpointError(f"{path}: the client-sampling stream re-derived from the seed differs "
                              f"from the one the run used; was fedsplice upgraded mid-run?")
    meta["rng_torch"] = rng_torch
    return Loaded(state, clients, lines, meta, path)


def restore_rng(loaded: Loaded) -> None:
    """Put the process-global RNGs back where they were when the checkpoint was written."""
    m = loaded.meta
    torch.set_rng_state(m["rng_torch"])
    random.setstate(_tuples(m["python_random"]))
    kind, keys, *rest = m["numpy_random"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


def restore_store(store: Store, clients: dict[int, Params]) -> None:
    for cid in sorted(clients):
        store.put(cid, clients[cid])


# --------------------------------------------------------------------------- preflight


def _existing_ancestor(path: Path) -> Path:
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return p


def check_writable(out: Path) -> None:
    """The run directory (or the folder it will be created in) accepts files; nothing is left behind."""
    anc = _existing_ancestor(out)
    if not anc.is_dir():
        raise ConfigError(f"--out {out}: {anc} is not a directory; choose another --out")
    try:
        with tempfile.TemporaryFile(dir=anc):
            pass
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write in {anc} ({e.strerror or e}); "
                          f"choose another --out") from None


MIN_FREE = 16 << 20  # metrics, results, the plot and slack


def estimate_bytes(global_params: Params, private_numel_bytes: int, num_clients: int,
                   opt_slots: int = 3) -> int:
    """An upper bound on one checkpoint: GLOBAL tensors, a float64 server state of up to three
    tensors per GLOBAL tensor, and every client's PRIVATE tensors with up to `opt_slots`
    same-sized optimizer tensors each."""
    g = sum(t.numel() * t.element_size() for t in global_params.values())
    return g + 3 * 2 * g + num_clients * private_numel_bytes * opt_slots + (1 << 20)


def check_space(out: Path, need: int) -> None:
    """Refuse to start when the disk holding `out` has less than `need` bytes free."""
    anc = _existing_ancestor(out)
    free = shutil.disk_usage(anc).free
    if free < need:
        raise ConfigError(f"--out {out}: only {free / 1e6:.1f} MB free on that disk, the run needs "
                          f"about {need / 1e6:.1f} MB (checkpoints, client state, results); free "
                          f"space, choose another --out, or lower runtime.keep_checkpoints")
