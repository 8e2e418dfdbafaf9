"""Images: decoding to RGB uint8, and users' own image files.

Users' data: `images:DIR` (DIR/<label>/…/*.png|jpg|jpeg|bmp|gif|webp) and csv/jsonl records
with an `image` path (see `fedsplice.data.datasets`) decode through `decode_image`: alpha composited over
white, RGB uint8, downscaled to at most USER_MAX_SIDE on a side (aspect kept). The built-in image
sets (`fedsplice.data.imagesets`) use the same pixel helpers (`to_rgb`, `square_resize`).
"""

from __future__ import annotations

import hashlib
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from fedsplice.config import check_user_path
from fedsplice.data.samples import Sample
from fedsplice.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# pixels

# Modes with a fixed mapping to 8-bit RGB: bilevel, grey, palette, with or without alpha
# (LA/PA/RGBA; premultiplied La/RGBa), CMYK and YCbCr. 16/32-bit integer ("I", "I;16…") and
# float ("F") pixels have no agreed 8-bit range, so they are refused rather than guessed.
CONVERTIBLE_MODES = {"1", "L", "P", "LA", "La", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK",
                     "YCbCr"}


def to_rgb(im: Image.Image) -> np.ndarray:
    """A decoded image as uint8 [H, W, 3]: transparent pixels composited over white, i.e.
    round((c·a + 255·(255 − a)) / 255), so icons and stamps do not turn black."""
    if im.mode in ("RGB", "RGBX", "CMYK", "YCbCr"):  # no alpha
        return np.asarray(im.convert("RGB"), dtype=np.uint8)
    rgba = np.asarray(im.convert("RGBA"), dtype=np.uint32)  # P keeps its tRNS transparency
    a = rgba[..., 3:]
    return ((rgba[..., :3] * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def square_resize(rgb: np.ndarray, side: int) -> np.ndarray:
    """Pad to a square with white (centred), then resize to side × side (Lanczos)."""
    h, w = rgb.shape[:2]
    n = max(h, w)
    canvas = np.full((n, n, 3), 255, dtype=np.uint8)
    top, left = (n - h) // 2, (n - w) // 2
    canvas[top:top + h, left:left + w] = rgb
    if n == side:
        return canvas
    return np.asarray(Image.fromarray(canvas).resize((side, side), Image.Resampling.LANCZOS))


# ---------------------------------------------------------------------------------------------
# users' images

USER_MAX_SIDE = 512  # larger images are downscaled (aspect kept): memory stays bounded
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


class BadImage(Exception):
    """A file that is not a usable image (undecodable, or a mode with no RGB mapping)."""


def decode_image(path: Path) -> tuple[np.ndarray, bytes]:
    """(RGB uint8 [H, W, 3], the file's bytes) of a user's image; raises BadImage. GIFs give
    their first frame."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:  # unreadable (permissions, a folder named like an image)
        raise BadImage(f"cannot read ({e.strerror or e}); check the file's permissions") from None
    return decode_bytes(raw), raw


def decode_bytes(raw: bytes) -> np.ndarray:
    """RGB uint8 [H, W, 3] of an encoded image (sides cut to USER_MAX_SIDE); raises BadImage."""
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            opened.load()  # decode now: truncated files fail here, not later in training
            im = ImageOps.exif_transpose(opened)  # phone photos: apply the EXIF rotation
            if im.mode not in CONVERTIBLE_MODES:
                raise BadImage(f"pixel mode {im.mode} has no 8-bit RGB mapping; save it as 8-bit "
                               f"RGB or grey")
            rgb = to_rgb(im)
    except BadImage:
        raise
    except Image.UnidentifiedImageError:  # its message names a BytesIO object, not the file
        raise BadImage("cannot decode (not an image format Pillow reads); replace or delete "
                       "the file") from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise BadImage(f"cannot decode ({e}); replace or delete the file") from None
    h, w = rgb.shape[:2]
    if max(h, w) > USER_MAX_SIDE:
        scale = USER_MAX_SIDE / max(h, w)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        rgb = np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling.LANCZOS))
    return rgb


def content_key(rel: str, raw: bytes, text: str | None = None) -> str:
    """`<relative path>#<sha256 of image bytes (+ text)>[:16]`: equal keys mean equal content,
    so caches keyed by the sample stay exact when a file changes."""
    h = hashlib.sha256(raw)
    if text is not None:
        h.update(b"\0" + text.encode("utf-8"))
    return f"{rel}#{h.hexdigest()[:16]}"


class BadImageLog:
    """Decode users' images; with skip=True a bad file is reported on stderr (one line each,
    then a total from `summary`) and skipped, else it is a one-line ConfigError."""

    def __init__(self, skip: bool):
        self.skip, self.skipped = skip, 0
        self._cache: dict[Path, tuple[np.ndarray, bytes] | None] = {}

    def decode(self, path: Path, where: str = "") -> tuple[np.ndarray, bytes] | None:
        path = Path(path)
        if path not in self._cache:  # one decode (and one shared array) per file
            try:
                self._cache[path] = decode_image(path)
            except BadImage as e:
                if not self.skip:
                    raise ConfigError(f"{where}{path}: {e}, or set data.skip_bad_images = "
                                      f"true to skip bad images") from None
                print(f"warning: skipping bad image {path}: {e}", file=sys.stderr)
                self.skipped += 1
                self._cache[path] = None
        return self._cache[path]

    def summary(self, what: str) -> None:
        if self.skipped:
            print(f"warning: skipped {self.skipped} bad image(s) in {what} "
                  f"(data.skip_bad_images = true)", file=sys.stderr)


def read_image_folder(folder: str | Path, skip_bad_images: bool = False
                      ) -> tuple[list[Sample], list[str]]:
    """(samples, label strings) of DIR/<label>/…/<image>: every image file below a label
    folder (recursively, sorted; hidden files and other suffixes ignored)."""
    root = Path(folder).expanduser()
    check_user_path("data.dataset", "images", str(folder))
    log = BadImageLog(skip_bad_images)
    samples, labels = [], []
    for label_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for path in sorted(label_dir.rglob("*")):
            rel = path.relative_to(root)
            if (path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file()
                    or any(part.startswith(".") for part in rel.parts)):
                continue
            got = log.decode(path)
            if got is not None:
                samples.append(Sample(content_key(rel.as_posix(), got[1]), got[0]))
                labels.append(label_dir.name)
    log.summary(str(root))
    if not samples:
        raise ConfigError(f"{root}: no images found (looked for "
                          f"{', '.join(sorted(IMAGE_SUFFIXES))} in its label subfolders); lay "
                          f"out the folder as DIR/<label>/<image>")
    return samples, labels
