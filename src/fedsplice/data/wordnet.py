"""WordNet's definitions as instruction records: `data.dataset = "wordnet"` with model.task = "generate".

Each record asks for the definition of a word that has one sense in its part of speech, so every
prompt has one right answer:

    {"prompt": 'Define the noun "disaster".', "response": "an act that has disastrous consequences",
     "pos": "noun"}

The definition is the gloss up to its first quoted example. Source: WordNet 3.0, the Debian
package wordnet-base (its data.noun / .verb / .adj / .adv, checked against the sha256 values
below), fetched once into the asset cache and parsed once into cache_dir()/datasets/wordnet.json.
`pos` (noun, verb, adjective, adverb) is a field to partition by (data.group_field = "pos").
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from fedsplice.data.assets import atomic_write_json, cache_dir, fetch_deb, sha256_file
from fedsplice.data.instruct import Instruction, record
from fedsplice.errors import AssetError

NAME, PACKAGE = "wordnet", "wordnet-base"
FOLDER = Path("usr/share/wordnet")
FILES = {  # part of speech: (file, sha256 of Debian's wordnet-base 1:3.0-37)
    "noun": ("data.noun", "fea17d2f9656611334eac790e5d69e47645fa180c4aa481fb4cd9b3520754ca2"),
    "verb": ("data.verb", "adcf43e35b581e8036d8b5a52d63d9cd3d3b4870b2720d3c03c799df44777bc2"),
    "adjective": ("data.adj", "c89120dfc1f046ddff4a631bf9b7e9fa1a36b5e86565a23bf82dbe14f30b88a7"),
    "adverb": ("data.adv", "444a63bf3955080ab7524f5079cfc07ff9bc682cb98bdb1db73b0fb9829f1139"),
}
VERSION = 1  # bump when the records' form changes: the parsed cache is rebuilt
_MARKER = re.compile(r"\([a-z]+\)$")  # an adjective's syntactic marker: "(a)", "(p)", "(ip)"


def parse_line(line: str) -> tuple[list[str], str] | None:
    """(the synset's words, its definition) of one line of a WordNet data file (wndb(5WN));
    None for the licence header (lines that start with two spaces) or an empty definition."""
    if line.startswith("  ") or "|" not in line:
        return None
    head, gloss = line.split("|", 1)
    fields = head.split()
    n = int(fields[3], 16)  # w_cnt: two hexadecimal digits
    words = [_MARKER.sub("", w).replace("_", " ") for w in fields[4:4 + 2 * n:2]]
    definition = gloss.strip().split('; "')[0].split(' "')[0].strip().rstrip(";").strip()
    return (words, definition) if definition else None


def rows_of(pos: str, lines) -> list[dict]:
    """The records of one part of speech: each synset whose first word names no other synset."""
    synsets = [p for p in map(parse_line, lines) if p is not None]
    senses = Counter(w.lower() for words, _ in synsets for w in set(words))
    return [{"prompt": f'Define the {pos} "{words[0]}".', "response": definition, "pos": pos}
            for words, definition in synsets if senses[words[0].lower()] == 1]


def _build() -> dict:
    root = fetch_deb(PACKAGE) / FOLDER
    rows: list[dict] = []
    for pos, (fname, expected) in FILES.items():
        path = root / fname
        got = sha256_file(path) if path.is_file() else "missing"
        if got != expected:
            raise AssetError(f"{path}: sha256 {got[:16]} does not match {expected[:16]} (another wordnet-base "
                             f"version?); delete {root.parent.parent.parent} and fetch again")
        with open(path, encoding="latin-1") as f:
            rows += rows_of(pos, f)
    return {"version": VERSION, "source": f"WordNet 3.0 (Debian package {PACKAGE}), words with one sense",
            "rows": rows}


def load() -> tuple[list[Instruction], str]:
    """(the records, where they came from), built once."""
    path = cache_dir() / "datasets" / f"{NAME}.json"
    obj = None
    if path.exists():
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            obj = None
    if obj is None or obj.get("version") != VERSION:
        obj = _build()
        atomic_write_json(path, obj)
    return [record(r, f"{NAME} record {i}") for i, r in enumerate(obj["rows"])], obj["source"]
