"""Users' own data: the split they give is used exactly, drops are counted, the report states the
sizes, and `fedsplice validate` reads the data (and refuses bad files) without loading a model."""

import csv
import json

import numpy as np
import pytest

from fedsplice.app.cli import main
from fedsplice.data.datasets import GENERIC_PROMPT, class_prompt_of, load_dataset
from fedsplice.data.partition import local_test_indices
from fedsplice.data.report import data_report, summary_lines
from fedsplice.errors import ConfigError


def write_csv(path, rows, fields=("label", "text", "split")):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        w.writerows(rows)
    return path


def reviews(n=60):
    """n rows: label pos/neg alternating, every 4th row is test, one val row, one exact duplicate."""
    rows = [{"label": "pos" if i % 2 else "neg", "text": f"review {i}", "split": "test" if i % 4 == 0 else "train",
             "stars": i % 5} for i in range(n)]
    rows.append({"label": "neg", "text": "a held-out val row", "split": "Val", "stars": 1})
    rows.append(dict(rows[1]))  # an exact duplicate of a training row
    return rows


def test_split_column_is_used_exactly(tmp_path):
    p = write_csv(tmp_path / "r.csv", reviews(), ("label", "text", "split", "stars"))
    ds = load_dataset(f"csv:{p}", seed=5, test_per_class=1)  # test_per_class plays no part
    want_test = {(f"review {i}", "pos" if i % 2 else "neg") for i in range(0, 60, 4)}
    assert {(t, ds.class_names[y]) for t, y in zip(ds.test_texts, ds.test_labels)} == want_test
    assert len(ds.test_texts) == 15
    want_train = {f"review {i}" for i in range(60) if i % 4}
    assert set(ds.train_texts) == want_train and len(ds.train_texts) == 45  # the duplicate dropped
    rep = ds.report
    assert rep["split"].startswith("given: the `split` column")
    assert rep["dropped"]["duplicates"] == 1 and rep["dropped"]["unused_split_rows"] == 1
    assert rep["dropped"]["cap"] == 0
    assert rep["notes"] == ["columns not used: stars"]
    assert rep["warnings"] and "fewer than 10" in rep["warnings"][0]  # 7 and 8 test rows per class


def test_data_test_file_is_used_exactly_and_cap_counted(tmp_path):
    train = write_csv(tmp_path / "train.csv",
                      [{"label": str(c), "text": f"t{c}-{i}"} for c in (2, 10) for i in range(30)],
                      ("label", "text"))
    test = tmp_path / "test.jsonl"
    test.write_text("\n".join(json.dumps({"label": c, "text": f"q{c}-{i}"})
                              for c in (10, 2, 2) for i in range(3)) + "\n")
    ds = load_dataset(f"csv:{train}", test=f"jsonl:{test}", max_per_class=20)
    assert ds.class_names == ["2", "10"]  # numeric labels sort as numbers
    assert np.bincount(ds.test_labels).tolist() == [6, 3]
    assert sorted(ds.test_texts) == sorted(f"q{c}-{i}" for c in (10, 2, 2) for i in range(3))
    assert np.bincount(ds.train_labels).tolist() == [20, 20]
    assert ds.report["dropped"]["cap"] == 20
    assert ds.report["split"] == f"given: data.test = 'jsonl:{test}'"


def test_test_only_label_is_refused(tmp_path):
    rows = [{"label": "a", "text": f"x{i}", "split": "train"} for i in range(4)]
    rows += [{"label": "b", "text": "y", "split": "test"}, {"label": "a", "text": "z", "split": "test"}]
    with pytest.raises(ConfigError, match=r"test split has label\(s\) \['b'\] \(1 rows\) that no training row has"):
        load_dataset(f"csv:{write_csv(tmp_path / 'r.csv', rows)}")


def test_split_errors(tmp_path):
    bad = write_csv(tmp_path / "b.csv", [{"label": "a", "text": "x", "split": "holdout"}])
    with pytest.raises(ConfigError, match=r"b\.csv line 2: `split` is 'holdout'; write train or test"):
        load_dataset(f"csv:{bad}")
    only = write_csv(tmp_path / "o.csv", [{"label": "a", "text": "x", "split": "train"}])
    with pytest.raises(ConfigError, match="has no `test` rows"):
        load_dataset(f"csv:{only}")
    both = write_csv(tmp_path / "t.csv", [{"label": "a", "text": "x", "split": "test"}])
    with pytest.raises(ConfigError, match="already has a `split` column"):
        load_dataset(f"csv:{only}", test=f"csv:{both}")
    with pytest.raises(ConfigError, match="data.test: 'fortunes' is a built-in data set"):
        load_dataset("fortunes", test=f"csv:{both}")


def test_encoding_error_names_line_and_file_offset(tmp_path):
    p = tmp_path / "e.csv"
    head = "label,text\n" + "".join(f"a,row number {i:05d}\n" for i in range(800))  # > 8 KiB before it
    p.write_bytes(head.encode() + b"b,bad \xff byte\n")
    offset = len(head.encode()) + len("b,bad ")
    with pytest.raises(ConfigError, match=rf"e\.csv line 802: not UTF-8.*at offset {offset} of the file, column 7"):
        load_dataset(f"csv:{p}")


def test_bom_header_and_blank_lines(tmp_path):
    p = tmp_path / "bom.csv"
    p.write_bytes("\ufefflabel,text\na,one\nb,two\na,three\nb,four\n".encode("utf-8"))
    assert load_dataset(f"csv:{p}", test_per_class=1).class_names == ["a", "b"]
    j = tmp_path / "blank.jsonl"
    j.write_text('{"label": "a", "text": "1"}\n\n{"label": "b", "text": "2"}\n\n'
                 '{"label": "a", "text": "3"}\n{"label": "b", "text": "4"}\n')
    assert load_dataset(f"jsonl:{j}", test_per_class=1).report["dropped"]["blank_lines"] == 2


def test_local_test_skips_classes_the_given_test_lacks():
    rng = np.random.default_rng(0)
    idx = local_test_indices(np.array([0, 0, 1, 1, 1, 2]), np.array([0, 0, 2, 2]), 6, 3, rng)
    # class 1 has no test rows: the quota goes to classes 0 and 2 by their training shares (2:1)
    assert np.bincount(np.array([0, 0, 2, 2])[idx], minlength=3).tolist() == [4, 0, 2]


def test_prompt_template_belongs_to_the_data():
    assert class_prompt_of("fortunes") == "a quote about {label}."
    assert class_prompt_of("fashion_mnist") == "a photo of a {label}."
    assert class_prompt_of("csv:/x.csv") == GENERIC_PROMPT == "{label}."


def test_report_sizes(tmp_path, tiny_cfg):
    from fedsplice.federation.experiment import build_data

    cfg = tiny_cfg()
    data, clients, _ = build_data(cfg)
    rep = data_report(data, clients, [len(clients) - 1])
    assert rep["train_size"] == len(data.train_texts) == sum(k["train"] for k in rep["clients"])
    assert rep["global_test_per_class"] == np.bincount(data.test_labels).tolist()
    for k, c in zip(rep["clients"], clients):
        assert sum(k["train_per_class"]) == len(c.train_idx) and sum(k["local_test_per_class"]) == len(c.test_idx)
    assert rep["clients"][-1]["role"] == "holdout"
    text = "\n".join(summary_lines(rep))
    assert f"train {len(data.train_texts)}" in text and f"{len(clients)} clients" in text
    assert summary_lines(rep)[0].endswith(f"; {len(data.class_names)} classes")
    assert summary_lines({**rep, "class_names": ["a"]})[0].endswith("; 1 class")  # a site's one-class file
    held = clients[-1]
    share = len(held.train_idx) / sum(len(c.train_idx) for c in clients)
    assert (f"  held out of the rounds (cold start only): client {held.cid}, {share:.0%} of the clients' "
            f"training data") in summary_lines(rep)


@pytest.fixture
def no_model(tiny_zoo, no_weights):
    """validate plans the model (a skeleton on the meta device) but reads no weights."""


def test_validate_reads_the_data_without_a_model(tmp_path, capsys, no_model):
    nolabel = write_csv(tmp_path / "n.csv", [{"sentence": "x", "text": "y"}], ("sentence", "text"))
    assert main(["validate", "--set", f'data.dataset="csv:{nolabel}"']) == 2
    assert "missing column `label`" in capsys.readouterr().err
    rows = [{"label": "ab"[i % 2], "text": f"t{i}"} for i in range(200)]
    small = write_csv(tmp_path / "s.csv", rows, ("label", "text"))
    assert main(["validate", "--set", f'data.dataset="csv:{small}"', "--set", "data.num_clients=500",
                 "--set", "data.holdout_clients=0"]) == 2
    assert "data.num_clients = 500" in capsys.readouterr().err
    assert main(["validate", "--set", f'data.dataset="csv:{small}"', "--set", "data.max_per_class=0"]) == 0
    out = capsys.readouterr().out
    assert "split: carved (no split given): 20 per class" in out and "train 160 (80-80 per class)" in out


def test_run_prints_and_records_the_sizes(tmp_path, tiny_cfg, capsys):
    from fedsplice.app.runner import run_experiment

    res = run_experiment(tiny_cfg(), tmp_path / "run", quiet=True, echo=print)
    out = capsys.readouterr().out
    rep = res["data"]
    assert rep == json.loads((tmp_path / "run" / "data.json").read_text())
    assert rep == json.loads((tmp_path / "run" / "results.json").read_text())["data"]
    assert rep["train_size"] == sum(k["train"] for k in rep["clients"]) == sum(rep["train_per_class"])
    assert [k["role"] for k in rep["clients"]].count("holdout") == 1
    assert f"train {rep['train_size']} (" in out and rep["split"] in out
    assert "warning: the global test set has fewer than 10 samples" in out  # 6 per class in the tiny budget


def test_generic_prompt_and_coop_without_words_before_the_label(tiny_cfg):
    from fedsplice.federation.experiment import build

    exp = build(tiny_cfg(data__class_prompt='""'))  # the toy set is a user's file: its own template
    assert exp.model.class_prompt == GENERIC_PROMPT
    with pytest.raises(ConfigError, match=r"peft.prompt_init = 'template' starts the context.*'\{label\}.' has none"):
        build(tiny_cfg(algorithm="promptfl", peft__type="prompt", peft__prompt_init="template",
                       data__class_prompt='"{label}."'))
    build(tiny_cfg(algorithm="promptfl", peft__type="prompt", data__class_prompt='"{label}."'))  # random: fine


# ----------------------------------------------------------------------------- ambiguous or useless files


def refused(path, content: str, pattern: str) -> None:
    """Write `content` to `path` and expect loading it (csv:/jsonl: by suffix) to fail with `pattern`."""
    path.write_text(content)
    with pytest.raises(ConfigError, match=pattern):
        load_dataset(f"{path.suffix[1:]}:{path}")


@pytest.mark.parametrize("header,dup,at", [("label,text,label,split", "label", "1, 3"),
                                           ("label,text,split,text", "text", "2, 4")])
def test_duplicated_column_is_refused(tmp_path, header, dup, at):
    rows = "\n".join(f"a,t{i},b,train" if i % 2 else f"b,u{i},a,test" for i in range(8))
    refused(tmp_path / "d.csv", f"{header}\n{rows}\n", rf"d\.csv: the header row names `{dup}` 2 times \(fields {at}\)")


def test_duplicated_jsonl_key_is_refused(tmp_path):
    refused(tmp_path / "d.jsonl", '{"label": "a", "text": "x"}\n{"label": "a", "text": "y", "label": "b"}\n',
            r"d\.jsonl line 2 names `label` 2 times")


def test_one_class_is_refused(tmp_path):
    refused(tmp_path / "one.csv", "label,text\n" + "".join(f"great,t{i}\n" for i in range(20)),
            r"one\.csv: every training record has the label 'great'; a classifier needs at least 2 classes")
    refused(tmp_path / "split.csv", "label,text,split\n" + "".join(
        f"great,t{i},{'test' if i % 4 == 0 else 'train'}\n" for i in range(20)),
            "every training record has the label 'great'")


def test_folder_and_file_are_named_for_what_they_are(tmp_path):
    (tmp_path / "reviews.csv").mkdir()
    with pytest.raises(ConfigError, match=r"reviews\.csv is a folder, not a CSV file; give the file's path"):
        load_dataset(f"csv:{tmp_path / 'reviews.csv'}")
    f = write_csv(tmp_path / "r.csv", reviews(), ("label", "text", "split", "stars"))
    with pytest.raises(ConfigError, match=r"r\.csv is a file, not a folder.*\(a CSV file is 'csv:"):
        load_dataset(f"images:{f}")


def test_row_numbers_count_lines_after_a_multiline_text(tmp_path):
    # the first record spans lines 2-4; the bad one is on line 6 (csv's record count would say 4)
    refused(tmp_path / "m.csv", 'label,text,split\na,"one\nquote over\nthree lines",train\nb,fine,train\na,x,holdout\n',
            r"m\.csv line 6: `split` is 'holdout'")
    # a blank line is skipped, not a record
    refused(tmp_path / "m.csv", "label,text\n\na,x\nb,\n", r"m\.csv line 4: no `text` and no `image`")


def test_jsonl_split_is_a_field(tmp_path):
    refused(tmp_path / "s.jsonl", "".join(json.dumps({"label": c, "text": f"{c}{i}", "split": "train"}) + "\n"
                                          for c in "ab" for i in range(3)), "the `split` field has no `test` rows")


# ----------------------------------------------------------------------------- settings scoped to a data set


def food_reviews(path, n=5000):
    """A file like the one users tried: 2 classes (great ~66%), a `split` column (every 5th row test)."""
    rows = [{"label": "great" if i % 3 else "other", "text": f"review number {i} of the food",
             "split": "test" if i % 5 == 0 else "train"} for i in range(n)]
    return write_csv(path, rows)


def test_fortunes_settings_do_not_follow_a_config_onto_a_users_file(tmp_path, capsys, no_model):
    from fedsplice.federation.validate import load_config

    f = food_reviews(tmp_path / "food.csv")
    for cfg_file in ("configs/pfadapter-minilm.toml", "configs/fedpurel-lora-fortunes.toml"):
        fortunes = load_config(cfg_file).data
        assert fortunes.max_per_class == 60 or (fortunes.imbalance, fortunes.n_max) == (100.0, 300)
        assert fortunes.class_prompt == "a quote about {label}."
        mine = load_config(cfg_file, [f"data.dataset=csv:{f}"]).data
        assert (mine.max_per_class, mine.imbalance, mine.n_max, mine.class_prompt) == (0, 1.0, 0, "")
        assert main(["validate", cfg_file, "--set", f"data.dataset=csv:{f}"]) == 0
        out = capsys.readouterr().out
        assert "train 4000 (" in out and "dropped" not in out  # every training row kept, nothing cut


def test_scope_rules(tmp_path):
    from fedsplice.federation.validate import load_config

    base = ('[data]\ndataset = "fortunes"\n{data}\n[datasets.fortunes]\nmax_per_class = 60\n'
            '[datasets."csv:other.csv"]\nmax_per_class = 5\n')
    cfg = tmp_path / "c.toml"
    cfg.write_text(base.format(data=""))
    assert load_config(cfg).data.max_per_class == 60  # only the active scope applies
    assert load_config(cfg, ["data.max_per_class=30"]).data.max_per_class == 30  # --set wins
    assert load_config(cfg, ["datasets.fortunes.max_per_class=30"]).data.max_per_class == 30
    cfg.write_text(base.format(data="max_per_class = 60"))  # the same value twice: not ambiguous
    assert load_config(cfg).data.max_per_class == 60
    cfg.write_text(base.format(data="max_per_class = 10"))
    with pytest.raises(ConfigError, match=r"data.max_per_class is set both in \[data\] \(10\) and in "
                                          r"\[datasets.fortunes\] \(60\); keep one"):
        load_config(cfg)
    cfg.write_text(base.format(data="") + "[datasets.brown]\nmax_per_clas = 3\n")  # an inactive scope: checked too
    with pytest.raises(ConfigError, match=r"datasets.brown.max_per_clas: unknown config field"):
        load_config(cfg)
    cfg.write_text(base.format(data="") + '[datasets.brown]\ndataset = "fortunes"\n')
    with pytest.raises(ConfigError, match=r"datasets.brown.dataset: a scope cannot choose the data set"):
        load_config(cfg)
    cfg.write_text('datasets = 3\n')
    with pytest.raises(ConfigError, match=r"datasets: expected tables \[datasets.NAME\]"):
        load_config(cfg)


def test_an_empty_label_is_refused_and_a_rare_one_named(tmp_path, capsys, no_model):
    rows = [{"label": ["billing", "shipping"][i % 2], "text": f"ticket {i}", "split": "test" if i % 5 == 0 else "train"}
            for i in range(200)]
    empty = [dict(r) for r in rows]
    empty[7]["label"] = " "
    write_csv(tmp_path / "e.csv", empty)
    with pytest.raises(ConfigError, match=r"e\.csv line 9: `label` is empty; every record needs a label"):
        load_dataset(f"csv:{tmp_path / 'e.csv'}")
    typo = [dict(r) for r in rows]
    typo[13]["label"] = "biling"
    ds = load_dataset(f"csv:{write_csv(tmp_path / 't.csv', typo)}")
    assert ds.class_names == ["biling", "billing", "shipping"]
    assert ds.report["warnings"][0] == (f"class 'biling' has 1 training row (first: {tmp_path / 't.csv'} line 15): "
                                        f"a typo in the `label` column? fix the label, or remove the row")
    # the small test set: named per class, and the fix is the user's split (test_per_class plays no part)
    assert ("('biling' 0)" in ds.report["warnings"][1]
            and ds.report["warnings"][1].endswith("add test rows to your split"))


def test_a_folder_given_as_a_file_is_named_in_the_config_check(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    assert main(["validate", "--set", f"data.dataset=csv:{tmp_path / 'bad'}"]) == 2
    assert "is a folder, not a CSV file; give the file's path" in capsys.readouterr().err
    f = food_reviews(tmp_path / "f.csv", 40)
    assert main(["validate", "--set", f"data.dataset=images:{f}"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["validate", "--set", f"data.dataset=csv:{f}", "--set", f"data.test=jsonl:{tmp_path / 'bad'}"]) == 2
    assert "data.test: " in capsys.readouterr().err
