"""data.dataset = "hf:NAME[:CONFIG]" (fedsplice.data.hubdata), offline, on data sets written by
`datasets` itself: save_to_disk and parquet folders, named splits used exactly, ClassLabel names,
column mapping, images, a carved test split, the long-tail cut, and bad settings."""

import io
import json

import datasets  # the [hf] extra (`make test` installs it with .[test])
import numpy as np
import pytest

from fedsplice.data.datasets import load_dataset
from fedsplice.data.hubdata import HubColumns
from fedsplice.errors import ConfigError

pytestmark = pytest.mark.unit

NAMES = ["sports", "science", "music"]  # ClassLabel order, deliberately not the labels' sorted order


def toy_dict(toy_jsonl, n_test: int = 8) -> "datasets.DatasetDict":
    """The toy set as a DatasetDict: `sentence` + ClassLabel `topic`, a test split of n_test per class."""
    rows = [json.loads(x) for x in toy_jsonl.read_text().splitlines()]
    feats = datasets.Features({"sentence": datasets.Value("string"), "topic": datasets.ClassLabel(names=NAMES),
                               "extra": datasets.Value("int64")})
    test, train, seen = [], [], {c: 0 for c in NAMES}
    for r in rows:
        (test if seen[r["label"]] < n_test else train).append(r)
        seen[r["label"]] += 1

    def make(rs):
        return datasets.Dataset.from_dict({"sentence": [r["text"] for r in rs],
                                           "topic": [NAMES.index(r["label"]) for r in rs],
                                           "extra": list(range(len(rs)))}, features=feats)
    return datasets.DatasetDict({"train": make(train), "test": make(test)})


@pytest.fixture
def saved(toy_jsonl, tmp_path, tmp_cache):
    d = toy_dict(toy_jsonl)
    d.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved", d


@pytest.fixture
def parquet(toy_jsonl, tmp_path, tmp_cache):
    d = toy_dict(toy_jsonl)
    (tmp_path / "pq").mkdir()
    for split in ("train", "test"):
        d[split].to_parquet(str(tmp_path / "pq" / f"{split}-00000-of-00001.parquet"))
    return tmp_path / "pq", d


COLS = HubColumns(text="sentence", label="topic")


@pytest.mark.parametrize("where", ["saved", "parquet"])
def test_named_splits_are_used_exactly_with_classlabel_names(where, request):
    path, d = request.getfixturevalue(where)
    ds = load_dataset(f"hf:{path}", hub=COLS, seed=3)
    assert ds.class_names == NAMES  # the ClassLabel's order
    want = sorted((r["sentence"], NAMES[r["topic"]]) for r in d["test"])
    assert sorted((t, ds.class_names[y]) for t, y in zip(ds.test_texts, ds.test_labels)) == want
    assert len(ds.train_texts) == len(d["train"]) and len(ds.test_texts) == 24
    assert ds.report["split"] == f"given: the 'train' / 'test' splits of hf:{path}"
    assert ds.report["source"] == f"Hugging Face data set {path}"


def test_an_empty_test_split_name_carves_a_balanced_test_set(parquet):
    path, d = parquet
    ds = load_dataset(f"hf:{path}", hub=HubColumns(text="sentence", label="topic", test=""), test_per_class=5)
    assert np.bincount(ds.test_labels).tolist() == [5, 5, 5]
    assert len(ds.train_texts) == len(d["train"]) - 15  # only the train split was read
    assert ds.report["split"].startswith("carved")


def test_labels_without_classlabel_are_sorted_like_a_users_file(tmp_path, tmp_cache):
    d = datasets.Dataset.from_dict({"text": ["a b c", "d e f", "g h i", "j k l"] * 3, "label": ["y", "x"] * 6})
    d.save_to_disk(str(tmp_path / "plain"))  # one Dataset, no splits: it is "train"
    ds = load_dataset(f"hf:{tmp_path / 'plain'}", hub=HubColumns(test=""), test_per_class=1)
    assert ds.class_names == ["x", "y"] and len(ds.test_texts) == 2


def test_an_image_column_becomes_samples_keyed_by_content(tmp_path, tmp_cache):
    from PIL import Image

    def png(v):
        buf = io.BytesIO()
        Image.fromarray(np.full((6, 5, 3), v, np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    feats = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["dark", "light"])})
    d = datasets.Dataset.from_dict({"img": [{"bytes": png(v), "path": None} for v in (10, 20, 30, 200, 210, 220)],
                                    "label": [0, 0, 0, 1, 1, 1]}, features=feats)
    datasets.DatasetDict({"train": d, "test": d.select([0, 3])}).save_to_disk(str(tmp_path / "img"))
    ds = load_dataset(f"hf:{tmp_path / 'img'}", hub=HubColumns(text="", image="img"))
    assert ds.class_names == ["dark", "light"] and len(ds.train_texts) == 6
    s = ds.test_texts[int(np.flatnonzero(ds.test_labels == 1)[0])]
    assert s.image.shape == (6, 5, 3) and int(s.image[0, 0, 0]) == 200 and s.text is None


def test_long_tail_cut_on_an_hf_data_set(saved, cfg_factory, tiny_bert_dir):
    from fedsplice.federation.experiment import build_data

    path, _ = saved
    cfg = cfg_factory(tiny_bert_dir, "unused", data__dataset=f'"hf:{path}"', data__hf_text='"sentence"',
                      data__hf_label='"topic"', data__imbalance=4.0, data__n_max=40, data__num_clients=2,
                      data__holdout_clients=0)
    data, _, _ = build_data(cfg)
    # n_r = 40·4^(−r/2): 40, 20, 10, the largest class first ("size": all have 52, so class order)
    assert sorted(np.bincount(data.train_labels).tolist()) == [10, 20, 40]
    assert data.report["dropped"]["long_tail"] == 3 * 52 - 70


@pytest.mark.parametrize("hub,match", [
    (HubColumns(text="sentence", label="label"),
     "data.hf_label = 'label': the 'train' split of hf:.* has no such column "
     "\\(its columns: sentence, topic, extra\\)"),
    (HubColumns(text="body", label="topic"), "data.hf_text = 'body': .* no such column"),
    (HubColumns(text="sentence", label="topic", test="validation"),
     "data.hf_test_split = 'validation': hf:.* has no such split \\(its splits: train, test\\); or set it to ''"),
])
def test_bad_columns_and_splits_name_what_there_is(saved, hub, match):
    with pytest.raises(ConfigError, match=match):
        load_dataset(f"hf:{saved[0]}", hub=hub)


def test_unlabelled_test_rows_are_refused(tmp_path, tmp_cache):
    feats = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a", "b"])})
    tr = datasets.Dataset.from_dict({"text": ["x y", "z w", "u v", "s t"], "label": [0, 1, 0, 1]}, features=feats)
    te = datasets.Dataset.from_dict({"text": ["q r"], "label": [-1]}, features=feats)  # GLUE-style test split
    datasets.DatasetDict({"train": tr, "test": te}).save_to_disk(str(tmp_path / "glue"))
    with pytest.raises(ConfigError, match="split 'test' row 0: no label .* or '' to carve a test set"):
        load_dataset(f"hf:{tmp_path / 'glue'}", hub=HubColumns())


def test_cli_exits_2_on_a_bad_column_and_runs_an_hf_data_set(saved, tiny_cfg, cli_refuses, tmp_path):
    from fedsplice.app.cli import main
    from fedsplice.app.rundir import write_config

    path, _ = saved
    cli_refuses(tiny_cfg(), [f"data.dataset='hf:{path}'", "data.hf_text='sentence'"],
                "has no such column (its columns: sentence, topic, extra)")
    cli_refuses(tiny_cfg(), ["data.dataset='hf:'"], "give hf:NAME or hf:NAME:CONFIG")
    write_config(tmp_path, tiny_cfg(data__dataset=f'"hf:{path}"', data__hf_text='"sentence"', data__hf_label='"topic"'))
    assert main(["run", str(tmp_path / "config.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["data"]["class_names"] == NAMES and res["data"]["train_per_class"] == [52, 52, 52]
    assert res["data"]["global_test_per_class"] == [8, 8, 8]  # the named test split, exactly
