"""Users' own data: CSV / JSONL files and image folders, with the train / test split they give.

    csv:PATH / jsonl:PATH   records with `label` and `text` and/or `image` (a path relative to the
                            file's folder); an optional `split` column: `train` or `test` (`val`,
                            `valid`, `validation` and `dev` rows are not used, and are counted);
                            other columns are ignored, and named in the data report
    images:DIR              DIR/<label>/<image>
    data.test               a second file or folder, in the same forms, holding the test split

`load_user` returns the parsed form that `fedsplice.data.datasets.load_dataset` splits:
{class_names, texts (the training pool, one list per class), test_texts (the given test split
per class, or None: carve one), source, split, dropped, notes}. Classes are the training labels
sorted (numerically when all are integers, so 2 < 10; else alphabetically), and
`data.class_names` names them in that order. A test label that no training row has is refused.
Exact duplicates (same label, same content) are dropped from the training pool and counted; a
given test split is used as it is.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from fedsplice.config import check_user_path
from fedsplice.data import images as imagedata
from fedsplice.data.samples import Sample
from fedsplice.data.text import normalize_ws
from fedsplice.errors import ConfigError

TRAIN, TEST = "train", "test"
UNUSED_SPLITS = ("val", "valid", "validation", "dev")
KNOWN_COLUMNS = ("label", "text", "image", "split")


@dataclass
class Records:
    rows: list[tuple[int, str, str | None, str | None, str | None]]  # line, label, text, image, split
    ignored_columns: list[str] = field(default_factory=list)
    blank_lines: int = 0


def read_text(path: Path) -> str:
    """The file as UTF-8 (a byte-order mark is allowed); a bad byte is named by its line and its
    offset in the whole file."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{path} line {line}: not UTF-8 text ({e.reason}: byte {raw[e.start:e.start + 1]!r} at "
                          f"offset {e.start} of the file, column {col}); save the file as UTF-8") from None


def _split_of(row: dict, where: str) -> str | None:
    if "split" not in row or row["split"] is None:
        return None
    value = str(row["split"]).strip().lower()
    if value not in (TRAIN, TEST, *UNUSED_SPLITS):
        raise ConfigError(f"{where}: `split` is {row['split']!r}; write train or test (val/dev rows are "
                          f"not used), or drop the column to have a test set carved")
    return value


def _record(row, line: int, path: Path, kind: str) -> tuple:
    where = f"{path} line {line}"
    if not isinstance(row, dict) or row.get("label") is None:
        raise ConfigError(f"{where}: missing field `label`; every record needs `label` and "
                          f"`text` and/or `image` (rename your columns/keys)")
    text, image = row.get("text"), row.get("image")
    text = None if text is None or (kind == "csv" and text == "") else normalize_ws(str(text))
    image = str(image).strip() if image is not None and str(image).strip() else None
    if text == "":
        raise ConfigError(f"{where}: `text` is empty or whitespace only; write the text, or "
                          f"leave the field out when the record has an `image`")
    if text is None and image is None:
        raise ConfigError(f"{where}: no `text` and no `image` (missing or empty); every "
                          f"record needs a non-empty `text` and/or an `image`")
    label = str(row["label"]).strip()
    if not label:
        raise ConfigError(f"{where}: `label` is empty; every record needs a label (an empty one would "
                          f"become a class of its own)")
    return line, label, text, image, _split_of(row, where)


def refuse_duplicates(names: list[str], where: str, used: tuple[str, ...] | None = KNOWN_COLUMNS) -> None:
    """A field the reader uses (`used`; None: every field), named twice, is ambiguous
    (csv.DictReader and json keep the last)."""
    twice = [c for c in (dict.fromkeys(names) if used is None else used) if names.count(c) > 1]
    if twice:
        at = [i + 1 for i, c in enumerate(names) if c == twice[0]]
        raise ConfigError(f"{where} names `{twice[0]}` {len(at)} times (fields {', '.join(map(str, at))}); "
                          f"which one is meant is ambiguous: rename or remove the others")


def json_object(pairs: list[tuple], where: str, used: tuple[str, ...] | None = KNOWN_COLUMNS) -> dict:
    """json.loads' object_pairs_hook: the object, its used fields each named once."""
    refuse_duplicates([k for k, _ in pairs], where, used)
    return dict(pairs)


def read_records(path: str | Path, kind: str) -> Records:
    """The records of a user's CSV (header row) or JSONL file. Every record needs `label` and a
    `text` and/or an `image`. A field that is absent, null, or an empty CSV cell is missing; a
    text of only whitespace (or a JSON "") is an error. Blank JSONL lines are skipped and counted;
    texts are whitespace-normalised."""
    path = Path(path).expanduser()
    check_user_path("data.dataset", kind, str(path))
    out = Records([])
    text = read_text(path)
    extra: set[str] = set()
    if kind == "csv":
        reader = csv.reader(io.StringIO(text, newline=""))
        fields = next(reader, [])
        refuse_duplicates(fields, f"{path}: the header row")
        if "label" not in fields or not {"text", "image"} & set(fields):
            missing = "label" if "label" not in fields else "text"
            raise ConfigError(f"{path}: missing column `{missing}` in the header row (found {fields}); "
                              f"the CSV needs columns `label` and `text` and/or `image`")
        extra = set(fields) - set(KNOWN_COLUMNS)
        end = reader.line_num
        for cells in reader:  # a record starts on the line after the last one's end (quoted newlines)
            start, end = end + 1, reader.line_num
            if cells:  # csv.DictReader's rule: a blank line is no record
                out.rows.append(_record(dict(zip(fields, cells)), start, path, kind))
    else:
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                out.blank_lines += 1
                continue
            try:
                # mypy cannot infer a lambda with a default argument (i=i: binds the loop variable, B023)
                row = json.loads(line, object_pairs_hook=lambda pairs, i=i: json_object(  # type: ignore[misc]
                    pairs, f"{path} line {i}"))
            except ValueError as e:
                raise ConfigError(f"{path} line {i}: not valid JSON ({e}); each line must be one "
                                  f"object with `label` and `text` and/or `image`") from None
            extra |= set(row) - set(KNOWN_COLUMNS) if isinstance(row, dict) else set()
            out.rows.append(_record(row, i, path, kind))
    if not out.rows:
        raise ConfigError(f"{path}: no records; add rows with fields `label` and `text` and/or `image`")
    out.ignored_columns = sorted(extra)
    return out


def _items(kind: str, path: str, skip_bad_images: bool) -> tuple[list, list[str], list, dict]:
    """(samples, labels, splits, facts) of one file or folder; a record with an `image` becomes a
    Sample keyed by content, a text-only record stays a plain str."""
    file = Path(path).expanduser()
    log = imagedata.BadImageLog(skip_bad_images)
    if kind == "images":
        samples, labels = imagedata.read_image_folder(path, skip_bad_images)
        return samples, labels, [None] * len(samples), {"bad_images": log.skipped}
    recs = read_records(file, kind)
    items, labels, splits = [], [], []
    first: dict[str, int] = {}
    for line, label, text, image, split in recs.rows:
        first.setdefault(label, line)
        if image is not None:
            img = file.parent / image
            if not img.is_file():
                raise ConfigError(f"{file} line {line}: image file {image!r} not found (looked for {img}); "
                                  f"fix the path, relative to the {kind.upper()} file's folder")
            got = log.decode(img, f"{file} line {line}: image ")
            if got is None:
                continue
            text = Sample(imagedata.content_key(image, got[1], text), got[0], text)
        items.append(text)
        labels.append(label)
        splits.append(split)
    log.summary(str(file))
    if not items:
        raise ConfigError(f"{file}: every image was skipped as bad; fix or replace them")
    return items, labels, splits, {"bad_images": log.skipped, "blank_lines": recs.blank_lines,
                                   "ignored_columns": recs.ignored_columns, "first_line": first}


def sorted_labels(labels) -> list[str]:
    """Distinct labels, numerically when all are integers (so 2 < 10), else alphabetically."""
    uniq = set(labels)
    try:
        return sorted(uniq, key=int)
    except ValueError:
        return sorted(uniq)


def _per_class(items, labels, index) -> list[list]:
    out: list[list] = [[] for _ in index]
    for x, lab in zip(items, labels):
        out[index[lab]].append(x)
    return out


def _dedupe_count(per_class: list[list]) -> tuple[list[list], int]:
    kept, dropped = [], 0
    for items in per_class:
        seen: set = set()
        keep = [x for x in items if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]  # add: None
        dropped += len(items) - len(keep)
        kept.append(keep)
    return kept, dropped


def _spec(kind: str, path: str) -> str:
    return f"{kind}:{path}"


def _check_labels(found, labels: list[str], where: str) -> None:
    unknown = sorted_labels(set(found) - set(labels))
    if unknown:
        raise ConfigError(f"{where} has label(s) {unknown[:5]} not in data.labels {labels[:8]}; add them to "
                          f"data.labels (every site and the server must list the same classes)")


def _two_classes(names: list[str], path: str) -> list[str]:
    """A classifier needs two classes; one means a wrong `label` column or a filtered file. (A
    site's file under fixed data.labels may hold one: the classes come from the config there.)"""
    if len(names) < 2:
        raise ConfigError(f"{Path(path).expanduser()}: every training record has the label {names[0]!r}; a "
                          f"classifier needs at least 2 classes: check the `label` column, or add the other classes")
    return names


def load_user(kind: str, path: str, *, test: tuple[str, str] | None = None,
              skip_bad_images: bool = False, labels: list[str] | None = None) -> dict:
    """The parsed form of a user's data (see the module docstring); `test` = (kind, path) of a
    separate test file (data.test); `labels`: the classes, in order, when they are fixed by the
    config rather than read from the data (a site's file, the server's evaluation file)."""
    items, labels_found, splits, facts = _items(kind, path, skip_bad_images)
    if labels:
        _check_labels(labels_found, labels, str(Path(path).expanduser()))
    return group(items, labels_found, splits, facts, kind, path, test, skip_bad_images, list(labels or []))


def group(items, labels, splits, facts, kind, path, test: tuple[str, str] | None, skip_bad_images,
          fixed, source: str = "", given_as: str = "") -> dict:
    """The parsed form of users' records: grouped by the given split ("train" / "test" per
    record; `given_as` says where it came from), the data.test file, or none (carved later).
    `fixed`: the classes in order when the data does not decide them; `source`: what the data is."""
    given = [s for s in splits if s is not None]
    source = source or f"user {'image folder' if kind == 'images' else 'file'} {Path(path).expanduser()}"
    dropped = {"duplicates": 0, "blank_lines": facts.get("blank_lines", 0), "bad_images": facts["bad_images"],
               "unused_split_rows": sum(s in UNUSED_SPLITS for s in given)}
    notes = [f"columns not used: {', '.join(facts['ignored_columns'])}"] if facts.get("ignored_columns") else []
    column = "column" if kind == "csv" else "field"  # a JSONL record has fields
    if given and test is not None:
        raise ConfigError(f"data.test: {path} already has a `split` {column}; give the test split one way: "
                          f"drop data.test, or drop the {column}")
    if given:
        tr = [(x, y) for x, y, s in zip(items, labels, splits) if s == TRAIN]
        te = [(x, y) for x, y, s in zip(items, labels, splits) if s == TEST]
        if not tr or not te:
            raise ConfigError(f"{path}: the `split` {column} has no `{TRAIN if not tr else TEST}` rows; give both "
                              f"train and test rows, or drop the {column} to have a test set carved")
        split = given_as or f"given: the `split` {column} of {Path(path).expanduser()}"
    elif test is not None:
        tx, ty, _, tfacts = _items(*test, skip_bad_images)
        if fixed:
            _check_labels(ty, fixed, test[1])
        dropped["bad_images"] += tfacts["bad_images"]
        tr, te = list(zip(items, labels)), list(zip(tx, ty))
        split = f"given: data.test = {_spec(*test)!r}"
    else:
        names = fixed or _two_classes(sorted_labels(labels), path)
        texts, dropped["duplicates"] = _dedupe_count(_per_class(items, labels, {c: i for i, c in enumerate(names)}))
        return {"class_names": names, "texts": texts, "test_texts": None, "source": source, "split": None,
                "dropped": dropped, "notes": notes, "warnings": _rare(names, texts, facts, path)}
    names = fixed or sorted_labels(y for _, y in tr)
    unseen = [] if fixed else sorted_labels({y for _, y in te} - set(names))
    if unseen:
        n = sum(y in unseen for _, y in te)
        raise ConfigError(f"the test split has label(s) {unseen} ({n} rows) that no training row has; a model "
                          f"cannot learn them: add training rows with those labels, or remove the test rows")
    names = fixed or _two_classes(names, path)
    index = {c: i for i, c in enumerate(names)}
    texts, dropped["duplicates"] = _dedupe_count(_per_class([x for x, _ in tr], [y for _, y in tr], index))
    test_texts = _per_class([x for x, _ in te], [y for _, y in te], index)
    train_set = {x for t in texts for x in t}
    leaked = sum(x in train_set for t in test_texts for x in t)
    if leaked:
        notes.append(f"{leaked} test rows also appear in the training split (exact copies): GM overstates")
    return {"class_names": names, "texts": texts, "test_texts": test_texts, "source": source, "split": split,
            "dropped": dropped, "notes": notes, "warnings": _rare(names, texts, facts, path)}


RARE = 2  # a class with this many training rows or fewer is more likely a typo than a class


def _rare(names: list[str], texts: list[list], facts: dict, path) -> list[str]:
    """A warning naming each class with at most RARE training rows, and where it first appears."""
    at = facts.get("first_line", {})
    rare = [(c, len(t)) for c, t in zip(names, texts) if len(t) <= RARE]
    return [f"class {c!r} has {n} training row{'s' if n != 1 else ''} (first: {Path(path).expanduser()} line "
            f"{at[c]}): a typo in the `label` column? fix the label, or remove the row"
            if c in at else f"class {c!r} has {n} training row{'s' if n != 1 else ''}: it can hardly be learned"
            for c, n in rare]
