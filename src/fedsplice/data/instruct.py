"""Instruction data: prompt -> response records, in the three forms the field ships them.

    prompt / response                  one user turn and its answer
    instruction / input / output       Alpaca's form; a non-empty `input` follows the instruction
                                       after a blank line, in the same user turn
    messages                           chat turns [{role, content}]: system / user / assistant,
                                       ending in the assistant turn that is the response (earlier
                                       turns are context; the loss is on the last one only)

Optional in every form: `options` (a list of 2-26 answer texts: a multiple-choice record) with
`answer` (the right option's letter "A".. or its text; the response defaults to "B. <its text>",
the form the prompt lists the options in: `option_text`), `system` (a first turn), `client` (a
natural per-user split), `split` (train / test), `image` (a path relative to the file, or an
`hf:` row's image: the VLM path, its tokens before the prompt), and any other scalar field, kept
for partitioning by a named field.

An `Instruction` is a `str` — a key naming its content exactly (`instruct:<sha1 of the content>`),
as `fedsplice.data.samples.Sample` is — so partitions, fingerprints and the training loop handle it
as any sample; the content travels beside the key.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedsplice.data import images as imagedata
from fedsplice.data.userdata import group, json_object, read_text, refuse_duplicates, sorted_labels
from fedsplice.errors import ConfigError

ROLES = ("system", "user", "assistant")
FORMS = ("prompt/response", "instruction/input/output", "messages")
_USED = ("prompt", "response", "instruction", "input", "output", "messages", "options", "answer", "client",
         "split", "image")


class Instruction(str):
    messages: tuple[tuple[str, str], ...]  # the context turns: (role, content), the last a user turn
    response: str
    options: tuple[str, ...]  # () unless multiple choice
    answer: int | None  # the right option's index
    image_ref: str | None  # the image as given (a path), then its content key once loaded
    image: np.ndarray | None  # its RGB pixels once loaded (`with_image`), as a `Sample`'s
    fields: dict[str, str]  # the record's other scalar fields (client, split, and the rest)

    def __new__(cls, messages, response: str, options=(), answer: int | None = None, image_ref: str | None = None,
                fields: dict[str, str] | None = None, image: np.ndarray | None = None):
        content = json.dumps([list(map(list, messages)), response, list(options), answer, image_ref],
                             ensure_ascii=False)
        s = super().__new__(cls, "instruct:" + hashlib.sha1(content.encode()).hexdigest()[:20])
        s.messages, s.response, s.options, s.answer = tuple(map(tuple, messages)), response, tuple(options), answer
        s.image_ref, s.fields, s.image = image_ref, dict(fields or {}), image
        return s

    def __reduce__(self):  # pickle (spawned workers, the Flower launcher)
        return (Instruction, (self.messages, self.response, self.options, self.answer, self.image_ref, self.fields,
                              self.image))

    @property
    def has_image(self) -> bool:
        return self.image is not None

    @property
    def prompt(self) -> str:
        """The last user turn (what a plain template shows)."""
        return self.messages[-1][1]

    @property
    def choice(self) -> bool:
        return bool(self.options)


def option_text(options, i: int) -> str:
    """Option i as the prompt lists it and an answer gives it: "B. <text>"."""
    return f"{chr(ord('A') + i)}. {options[i]}"


def _text(row: dict, key: str, where: str, required: bool = True) -> str | None:
    v = row.get(key)
    if v is None or (isinstance(v, str) and v == "" and not required):
        if required:
            raise ConfigError(f"{where}: missing field `{key}`")
        return None
    if not isinstance(v, (str, int, float)):
        raise ConfigError(f"{where}: `{key}` is a {type(v).__name__}; write it as text")
    t = str(v).strip()  # inner whitespace stays: code and lists are answers too
    if not t and required:
        raise ConfigError(f"{where}: `{key}` is empty or whitespace only; every record needs a non-empty `{key}`")
    return t


def _messages(row: dict, where: str) -> tuple[list[tuple[str, str]], str]:
    raw = row["messages"]
    if isinstance(raw, str):  # a CSV cell holds the list as JSON
        try:
            raw = json.loads(raw)
        except ValueError:
            raise ConfigError(f"{where}: `messages` is not a JSON list of {{role, content}} objects") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise ConfigError(f"{where}: `messages` needs a list of at least a user turn and the assistant's answer")
    turns = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: messages[{i}] is {m!r}; each turn is {{\"role\": one of "
                              f"{'/'.join(ROLES)}, \"content\": text}}")
        turns.append((m["role"], m["content"].strip()))
    if turns[-1][0] != "assistant" or not turns[-1][1]:
        raise ConfigError(f"{where}: the last of `messages` must be a non-empty assistant turn: the response "
                          f"the loss is on")
    if turns[-2][0] != "user":
        raise ConfigError(f"{where}: the turn before the last (the assistant's answer) must be a user turn, "
                          f"got {turns[-2][0]!r}")
    return turns[:-1], turns[-1][1]


def _options(row: dict, where: str) -> tuple[list[str], int | None]:
    opts = row.get("options")
    if opts is None:
        if row.get("answer") is not None:
            raise ConfigError(f"{where}: `answer` without `options`; list the options, or write the "
                              f"answer as `response`")
        return [], None
    if isinstance(opts, str):
        try:
            opts = json.loads(opts)
        except ValueError:
            raise ConfigError(f"{where}: `options` is not a JSON list of texts") from None
    if not isinstance(opts, list) or not 2 <= len(opts) <= 26 or not all(isinstance(o, str) and o.strip()
                                                                          for o in opts):
        raise ConfigError(f"{where}: `options` must be a list of 2 to 26 non-empty texts, got {opts!r}")
    opts = [o.strip() for o in opts]
    ans = row.get("answer")
    if ans is None:
        raise ConfigError(f"{where}: `options` without `answer`; give the right option's letter (A, B, ...) or text")
    a = str(ans).strip()
    letters = [chr(ord("A") + i) for i in range(len(opts))]
    if a in letters:
        return opts, letters.index(a)
    if a in opts:
        return opts, opts.index(a)
    raise ConfigError(f"{where}: `answer` {ans!r} is neither a letter {letters[0]}-{letters[-1]} "
                      f"nor one of the options")


def record(row, where: str) -> Instruction:
    """One record in any of the three forms -> an Instruction; a bad one is a one-line error
    naming `where` (file and line) and the field."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a record must be an object with fields, got {type(row).__name__}")
    forms = [f for f, key in zip(FORMS, ("prompt", "instruction", "messages")) if row.get(key) is not None]
    if len(forms) != 1:
        what = "none of" if not forms else "more than one of"
        raise ConfigError(f"{where}: {what} the forms {', '.join(FORMS)}; give exactly one (fields found: "
                          f"{', '.join(sorted(row)) or 'none'})")
    options, answer = _options(row, where)
    system = _text(row, "system", where, required=False)
    if forms[0] == "messages":
        context, response = _messages(row, where)
    else:
        if forms[0] == "prompt/response":
            user = _text(row, "prompt", where)
            resp_key = "response"
        else:
            user, extra = _text(row, "instruction", where), _text(row, "input", where, required=False)
            user = f"{user}\n\n{extra}" if extra else user
            resp_key = "output"
        given = _text(row, resp_key, where, required=not options)
        response = given if given else option_text(options, answer) if answer is not None else ""
        context = ([("system", system)] if system else []) + [("user", user or "")]
    return with_row_image(Instruction(context, response, options, answer, None, other_fields(row, _USED + ("system",))),
                          row.get("image"), where)


def other_fields(row: dict, used: tuple[str, ...]) -> dict[str, str]:
    """A record's scalar fields beyond the `used` ones (kept to partition by), with `client` and
    `split` (the natural partition, the given split) stripped."""
    fields = {k: str(v) for k, v in row.items() if k not in used and isinstance(v, (str, int, float, bool))}
    for k in ("client", "split"):
        if row.get(k) is not None:
            fields[k] = str(row[k]).strip()
    return fields


def with_row_image(rec: Instruction, image, where: str) -> Instruction:
    """`rec` with a row's `image`: a path (relative to the file, loaded by `read`) or an `hf:` row's
    undecoded Image feature ({bytes, path}: decoded here)."""
    ref = image if isinstance(image, str) and image else None
    if image is not None and ref is None and not _is_image_bytes(image):
        raise ConfigError(f"{where}: `image` must be a path (relative to the file) or an image, got {image!r:.40}")
    rec = Instruction(rec.messages, rec.response, rec.options, rec.answer, ref, rec.fields) if ref else rec
    if isinstance(image, dict) and _is_image_bytes(image):
        return with_image(rec, image.get("bytes") or Path(image["path"]).read_bytes(), image.get("path") or "image",
                          where)
    return rec


def _is_image_bytes(v) -> bool:  # an `hf:` row's Image feature, read undecoded: {bytes, path}
    return isinstance(v, dict) and ("bytes" in v or "path" in v)


def with_image(rec: Instruction, raw: bytes, name: str, where: str) -> Instruction:
    """`rec` with its image decoded (`fedsplice.data.images`, one-line errors) and its key naming
    the image's content, not its path."""
    try:
        pixels = imagedata.decode_bytes(raw)
    except imagedata.BadImage as e:
        raise ConfigError(f"{where}: image {name!r}: {e}") from None
    return Instruction(rec.messages, rec.response, rec.options, rec.answer, imagedata.content_key(name, raw),
                       rec.fields, pixels)


def _load_image(rec: Instruction, file: Path, where: str) -> Instruction:
    if rec.image_ref is None:
        return rec
    img = file.parent / rec.image_ref
    if not img.is_file():
        raise ConfigError(f"{where}: image file {rec.image_ref!r} not found (looked for {img}); fix the path, "
                          f"relative to the file's folder")
    return with_image(rec, img.read_bytes(), rec.image_ref, where)


def read(path: str | Path, reader: Callable[[dict, str], Instruction] = record) -> list[Instruction]:
    """The records of a JSONL (one object a line; blank lines skipped) or CSV (a header row;
    `messages` and `options` cells as JSON lists) file; `reader(row, where)` makes each one
    (data.record_format: fedsplice.data.flowertune.reader)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.dataset: {path} is not a file; give a .jsonl or .csv of instruction records")
    text = read_text(path)  # UTF-8 (a BOM allowed); a bad byte is named by its line
    out: list[Instruction] = []
    if path.suffix.lower() == ".csv":
        rows = csv.DictReader(io.StringIO(text, newline=""))
        refuse_duplicates(list(rows.fieldnames or []), f"{path}: the header row", None)
        for row in rows:
            where = f"{path} line {rows.line_num}"
            out.append(_load_image(reader({k: (v if v != "" else None) for k, v in row.items()}, where), path, where))
    else:
        for i, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    # mypy cannot infer a lambda with a default argument (i=i binds the loop variable)
                    row = json.loads(line, object_pairs_hook=lambda pairs, i=i: json_object(  # type: ignore[misc]
                        pairs, f"{path} line {i}", None))
                except ValueError as e:
                    raise ConfigError(f"{path} line {i}: not valid JSON ({e}); each line is one "
                                      f"record object") from None
                out.append(_load_image(reader(row, f"{path} line {i}"), path, f"{path} line {i}"))
    if not out:
        raise ConfigError(f"{path}: no records; each needs one of the forms {', '.join(FORMS)}")
    return out


def parsed(kind: str, path: str, test: str, group_field: str = "",
           reader: Callable[[dict, str], Instruction] = record) -> dict:
    """The parsed form `fedsplice.data.datasets.load_dataset` splits (as `userdata.load_user`'s):
    the records grouped by `group_field`'s values (the "classes" a Dirichlet partition skews
    over and the local test sets follow; one group, "all", without it), and the split a `split`
    field or data.test (`test`, "jsonl:PATH" / "csv:PATH") gives, else none (a test set is carved)."""
    return grouped(read(path, reader), path, test, group_field, f"user instruction file {Path(path).expanduser()}",
                   reader=reader)


def grouped(recs: list[Instruction], path: str, test: str, group_field: str, source: str,
            splits: list[str | None] | None = None, given_as: str = "",
            reader: Callable[[dict, str], Instruction] = record) -> dict:
    """`parsed` of records already read (`path` names them in messages; a built-in set's name);
    `splits` (train / test / None per record) and `given_as` when the source gives the split;
    `reader` reads data.test's records."""
    splits = list(splits) if splits is not None else [r.fields.get("split") for r in recs]
    bad = sorted({s for s in splits if s not in (None, "train", "test")})
    if bad:
        raise ConfigError(f"{path}: `split` has {bad[:3]}; write train or test, or drop the field to have a test "
                          f"set carved")
    if test:
        tkind, _, tpath = test.partition(":")
        if tkind not in ("csv", "jsonl") or not tpath:
            raise ConfigError(f"data.test = {test!r}: give jsonl:PATH or csv:PATH of instruction records")
        if any(s is not None for s in splits):
            raise ConfigError(f"data.test: {path} already has a `split` field; give the test split one way")
        more = read(tpath, reader)
        splits = [*(["train"] * len(recs)), *(["test"] * len(more))]
        recs, given_as = recs + more, f"given: data.test = {test!r}"
    if group_field:
        missing = sum(group_field not in r.fields for r in recs)
        if missing:
            raise ConfigError(f"data.group_field = {group_field!r}: {missing} of {len(recs)} records have no such "
                              f"field; give it on every record, or use data.partition = 'iid'")
    groups = [r.fields[group_field] if group_field else "all" for r in recs]
    facts = {"bad_images": 0, "blank_lines": 0, "ignored_columns": [], "first_line": {}}
    fixed = sorted_labels(groups)
    return {**group(recs, groups, splits, facts, "jsonl", path, None, False, fixed, source=source, given_as=given_as),
            "unit": "group"}


def natural_clients(train: list, test: list, num_clients: int):  # of Instructions
    """data.partition = "natural": one client per distinct `client` field value (sorted, as labels
    are), holding its own training records; its local test set is its own records among the global
    test ones. Returns (client names, training indices per client, test indices per client)."""
    missing = sum("client" not in r.fields for r in train)
    if missing:
        raise ConfigError(f"data.partition = 'natural': {missing} of {len(train)} training records have no `client` "
                          f"field; give every record its client, or use data.partition = 'iid'")
    names = sorted_labels(r.fields["client"] for r in train)
    if len(names) != num_clients:
        shown = ", ".join(map(repr, names[:6])) + (", ..." if len(names) > 6 else "")
        raise ConfigError(f"data.partition = 'natural': the records name {len(names)} clients ({shown}) but "
                          f"data.num_clients = {num_clients}; set data.num_clients = {len(names)}")
    at = {n: k for k, n in enumerate(names)}
    parts: list[list[int]] = [[] for _ in names]
    tests: list[list[int]] = [[] for _ in names]
    for i, r in enumerate(train):
        parts[at[r.fields["client"]]].append(i)
    for i, r in enumerate(test):
        if r.fields.get("client") in at:
            tests[at[r.fields["client"]]].append(i)
    empty = [n for n, t in zip(names, tests) if not t]
    if empty:
        raise ConfigError(f"data.partition = 'natural': client(s) {empty[:5]} have no test records, so their "
                          f"personalized models cannot be scored; give each client test records (`split`)")
    return names, parts, tests
