"""`fedsplice results` (suite -> docs page with claim verdicts), `fedsplice report` (one
self-contained HTML page) and `compare --jobs` (runs in worker processes)."""

import base64
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from fedsplice.app import compare as C
from fedsplice.app.cli import main
from fedsplice.app.report import md_to_html, render, write_report
from fedsplice.app.rundir import write_config
from fedsplice.errors import ConfigError
from fedsplice.study import claims as V
from fedsplice.study import curves as H
from fedsplice.study import results as R

SUITE = """
seeds = 2
jobs = 1
[groups.g]
title = "tiny"
paper = "big model"
set = ["server.rounds=2"]
[[experiment]]
name = "pf"
label = "PFAdapter"
group = "g"
config = "{pf}"
[[experiment]]
name = "fl"
group = "g"
config = "{fl}"
set = ["server.optimizer=fedavgm"]
[[table]]
id = "t1"
title = "Table one"
rows = ["pf", "fl"]
columns = ["PM acc", "up B/round"]
diagnostics = ["orthogonality_raw"]
plots = true
[[table.claim]]
kind = "ratio"
a = "pf"
b = "fl"
metric = "up B/round"
low = 0.45
high = 0.55
text = "half the bytes"
[[table.claim]]
kind = "greater"
a = "pf"
b = "fl"
metric = "PM acc"
text = "pf beats fl"
[[table.claim]]
kind = "untestable"
text = "images"
reason = "none offline"
[[table]]
id = "sweep"
title = "A sweep"
rows = ["fl", "pf"]
sweep = "x"
xs = [0.0, 1.0]
"""


@pytest.fixture
def suite(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    paths = {}
    for algo in ("pfadapter", "lora"):
        d = tmp_path / "cfg" / algo
        d.mkdir(parents=True)
        write_config(d, cfg_factory(tiny_bert_dir, toy_jsonl, algorithm=algo, data__holdout_clients=0))
        paths[algo] = d / "config.toml"
    path = tmp_path / "suite.toml"
    path.write_text(SUITE.format(pf=paths["pfadapter"], fl=paths["lora"]))
    return path


@pytest.mark.integration
def test_suite_page_claims_and_resume(suite, tmp_path, monkeypatch):
    doc = tmp_path / "docs" / "results.md"
    R.run_suite(suite, tmp_path / "out", doc, quiet=True, command="make results")
    text = doc.read_text()
    runs = {(m, s): json.loads((tmp_path / "out" / "runs" / m / f"seed-{s}" / "results.json").read_text())
            for m in ("pf", "fl") for s in (0, 1)}
    for m in ("pf", "fl"):  # the fl runs used their own override on top of the group's
        assert all(runs[(m, s)]["rounds"] == 2 for s in (0, 1))
    assert all(runs[("fl", s)]["server_optimizer"] == "fedavgm" for s in (0, 1))
    pm = {m: np.array([runs[(m, s)]["pm"]["accuracy"] for s in (0, 1)]) for m in ("pf", "fl")}
    up = {m: np.mean([runs[(m, s)]["communication"]["up_bytes_per_round"] for s in (0, 1)]) for m in ("pf", "fl")}
    row = f"| PFAdapter | {pm['pf'].mean():.3f} ± {pm['pf'].std():.3f} | {up['pf']:,.0f} ± 0 |"
    assert row in text
    ratio = up["pf"] / up["fl"]
    assert f"ratio {ratio:.3f}" in text
    assert (f"**{'held' if 0.45 <= ratio <= 0.55 else 'did not hold'}** — half the bytes") in text
    by = {m: [runs[(m, s)] for s in (0, 1)] for m in ("pf", "fl")}
    d = V.paired(by, "pf", "fl", "PM acc")
    assert d.shape == (2, len(runs[("pf", 0)]["pm"]["client_accuracy"]))  # seeds × clients: PM pairs by client
    hs = {m: [H.history(tmp_path / "out" / "runs" / m / f"seed-{s}") for s in (0, 1)] for m in ("pf", "fl")}
    v = V.assess({"kind": "greater", "a": "pf", "b": "fl", "metric": "PM acc"}, by, [], hs)
    assert v.verdict is None  # every claim with a metric is tested: no gate
    assert f"**{V.label(V.decide_all([v])[0])}** — pf beats fl" in text
    assert "Tested together: 1 tests in the secondary family at α = 0.05." in text
    assert "| Table one | pf beats fl | secondary |" in text
    assert "**could not be tested** — images *Measured:* none offline" in text
    # the group's setting is generated from the runs' configs: the group's rounds, fl's own server
    assert "budget: 2 rounds × 1 local epoch(s)" in text and "(fl: fedavgm η default)" in text
    # diagnostics: PFAdapter's Lo, mean over its training rounds, then over seeds; none for FedAvgM
    lo = [np.mean([r["orthogonality_raw"] for r in map(json.loads, (tmp_path / "out" / "runs" / "pf" / f"seed-{s}" /
                                                                      "metrics.jsonl").read_text().splitlines())
                   if "orthogonality_raw" in r]) for s in (0, 1)]
    assert f"| PFAdapter | {np.mean(lo):.3g} ± {np.std(lo):.2g} |" in text and "| fl | — |" in text
    assert "at commit" in text and "`make results`" in text and "2 run(s) at once" not in text
    compute = sum(r["time_s"] for r in runs.values()) / 60
    assert (f"The runs' recorded wall times add up to {compute:.0f} min (every run ran in this invocation, "
            "so ") in text and " min is the from-scratch time)" in text
    curves = [[json.loads(x)["pm"]["accuracy"] for x in (tmp_path / "out" / "runs" / "pf" / f"seed-{s}" /
               "metrics.jsonl").read_text().splitlines() if '"pm"' in x][-2:] for s in (0, 1)]
    dpm = [b - a for a, b in curves]
    assert f"{np.mean([c[1] for c in curves]):.3f} ± {np.std([c[1] for c in curves]):.3f} | " \
           f"{np.mean(dpm):+.3f} ± {np.std(dpm):.3f} |" in text.split("## Convergence")[1].split("(`pf`)")[1]
    assert "4 runs (4 run by this invocation" in text
    for png in ("t1/accuracy_vs_round.png", "t1/accuracy_vs_bytes.png", "sweep/sweep.png"):
        assert (doc.parent / "results" / png).read_bytes()[:4] == b"\x89PNG"
        assert f"(results/{png})" in text
    # a second invocation runs nothing and gives the same page apart from its own timing line
    calls = []
    monkeypatch.setattr(C, "_one", lambda *a: calls.append(a))
    R.run_suite(suite, tmp_path / "out", doc, quiet=True, command="make results")
    assert calls == [] and "4 runs (0 run by this invocation, 4 found finished" in doc.read_text()
    strip = lambda t: re.sub(r"Generated by .*\n", "", t)  # noqa: E731
    assert strip(doc.read_text()) == strip(text)

    # the page as one self-contained HTML file: every image inline, nothing fetched
    page = write_report(doc, tmp_path / "page.html").read_text()
    srcs = re.findall(r'src="([^"]+)"', page)
    assert len(srcs) == text.count("![") and all(s.startswith("data:image/png;base64,") for s in srcs)
    first = base64.b64decode(srcs[0].split(",", 1)[1])
    assert first == (doc.parent / "results" / "t1" / "accuracy_vs_round.png").read_bytes()
    assert "<b>could not be tested</b>" in page
    _well_formed(page)


class _Tags(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"unbalanced </{tag}>"


def _well_formed(page: str) -> None:
    p = _Tags()
    p.feed(page)
    assert p.stack == []


def test_group_seeds_and_convergence_rows(suite, tmp_path):
    """A group's `seeds` sets its runs; `--seeds` forces every group; the convergence table's
    cells are the last evaluation and its change since the one before, over seeds."""
    from fedsplice.study import diagnostics as D

    text = suite.read_text().replace('set = ["server.rounds=2"]', 'set = ["server.rounds=2"]\nseeds = 3')
    suite.write_text(text)
    s = R.load_suite(suite)
    assert [r[1] for r in R.plan_suite(s, tmp_path) if r[0] == "pf"] == [0, 1, 2]
    s.seeds, s.fixed = 1, True
    assert [r[1] for r in R.plan_suite(s, tmp_path) if r[0] == "pf"] == [0]
    suite.write_text(text.replace("seeds = 3", "seeds = 0"))
    with pytest.raises(ConfigError, match=r"\[groups.g\] seeds must be an integer >= 1, got 0"):
        R.load_suite(suite)
    # a display-only row may run fewer seeds; a row a claim pairs by seed may not
    shown = text.replace('name = "fl"\n', 'name = "fl"\nseeds = 1\n')
    suite.write_text(shown.replace('kind = "greater"', 'kind = "untestable"\nreason = "x"\nz = "greater"'))
    s = R.load_suite(suite)
    assert [(r[0], r[1]) for r in R.plan_suite(s, tmp_path)] == [("pf", 0), ("pf", 1), ("pf", 2), ("fl", 0)]
    suite.write_text(shown)
    with pytest.raises(ConfigError, match="experiment 'fl' sets its own seeds but a claim of table 't1' compares it"):
        R.load_suite(suite)
    suite.write_text(text.replace('b = "fl"\nmetric = "PM acc"', 'metric = "PM acc"'))
    with pytest.raises(ConfigError, match="a greater claim needs b: the rows it compares"):
        R.load_suite(suite)
    suite.write_text(text)
    runs = []
    for seed, accs in ((0, [0.5, 0.6, 0.7]), (1, [0.5, 0.7, 0.8])):
        d = tmp_path / f"r{seed}"
        d.mkdir()
        d.joinpath("metrics.jsonl").write_text("\n".join(json.dumps(
            {"round": 5 * i, "gm": {"accuracy": a}, **({"pm": {"accuracy": a / 2}} if i else {})})
            for i, a in enumerate(accs)) + "\n" + json.dumps({"round": 11, "train_loss": 1.0}))
        runs.append(("x", seed, None, d))
    row = D.convergence_md(["x", "y"], runs, str)
    # GM: last 0.7, 0.8 (mean 0.75 ± 0.05), change +0.1 both; PM: 0.35, 0.4, change +0.05 both
    assert "| x | 5 → 10 | 0.750 ± 0.050 | +0.100 ± 0.000 | 0.375 ± 0.025 | +0.050 ± 0.000 |" in row
    assert "| y | — | — | — | — | — |" in row


def test_report_of_run_and_compare_dirs(suite, tmp_path, capsys):
    runs = R.plan_suite(R.load_suite(suite), tmp_path / "cmp", seeds=1)
    results = C.run_all(runs, quiet=True)
    C.write_tables(C.summarize(runs, results), tmp_path / "cmp")
    C.write_plots(runs, tmp_path / "cmp")
    assert main(["report", str(tmp_path / "cmp")]) == 0
    page = (tmp_path / "cmp" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "<th>method</th>" in page and "| pf |" not in page
    assert "http://" not in page and "https://" not in page
    _well_formed(page)
    run = tmp_path / "cmp" / "runs" / "pf" / "seed-0"
    page = render(run)
    r = json.loads((run / "results.json").read_text())
    assert f'<td>GM</td><td class="n">{r["gm"]["accuracy"]:.4f}</td>' in page
    maj = r["references"]["majority"]["gm"]["accuracy"]
    assert f'<td>majority class (reference)</td><td class="n">{maj:.4f}</td>' in page
    assert all(html.escape(w) in page for w in r["warnings"])
    assert page.count("data:image/png;base64,") == 1  # the run's accuracy.png
    _well_formed(page)
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "neither a folder nor a .md page" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no results.json or table.md" in capsys.readouterr().err
    (tmp_path / "p.md").write_text("# t\n\n![x](missing.png)\n")
    with pytest.raises(ConfigError, match="missing.png"):
        render(tmp_path / "p.md")


def test_md_to_html_tables_and_escaping():
    h = md_to_html("## Title <x>\n\n| a | b |\n|---|---|\n| **1** | `2` |\n\ntext & more\n- item")
    assert h == ("<h2>Title &lt;x&gt;</h2>\n<table><tr><th>a</th><th>b</th></tr><tr><td><b>1</b></td>"
                 "<td><code>2</code></td></tr></table>\n<p>text &amp; more</p>\n<ul><li>item</li></ul>")
    assert md_to_html("| m | acc |\n|---|---|\n| x | 0.5 ± 0.1 |") == (
        '<table><tr><th>m</th><th>acc</th></tr><tr><td>x</td><td class="n">0.5 ± 0.1</td></tr></table>')


@pytest.mark.parametrize("edit, field", [
    (("rows = [\"pf\", \"fl\"]\ncolumns", "rows = [\"pf\", \"nope\"]\ncolumns"), "'nope', which is no experiment"),
    (("columns = [\"PM acc\"", "columns = [\"PM accuracy\""), "column 'PM accuracy' is unknown"),
    (("kind = \"ratio\"", "kind = \"better\""), "claim kind 'better' is unknown"),
    (("xs = [0.0, 1.0]", "xs = [0.0]"), "xs needs one value per row"),
    (("group = \"g\"\nconfig", "group = \"h\"\nconfig"), "group 'h' is not in [groups]"),
    (("title = \"tiny\"", "title = \"tiny\"\nsetting = \"by hand\""), "[groups.g] setting: the page generates it"),
    (("kind = \"untestable\"\ntext = \"images\"", "kind = \"balanced\"\na = \"pf\"\nmetric = \"GM acc\"\n"
      "metric_b = \"PM acc\"\ntext = \"images\""), "a balanced claim needs margin > 0"),
    (("kind = \"untestable\"\ntext = \"images\"", "kind = \"benchmark\"\nmeasured = \"1 s\"\ntext = \"images\""),
     "a benchmark claim needs `measured` (the number) and `source`"),
])
def test_suite_bad_input(suite, tmp_path, edit, field, capsys):
    suite.write_text(suite.read_text().replace(*edit, 1))
    assert main(["results", str(suite), "--out", str(tmp_path / "o"), "--doc", str(tmp_path / "d.md")]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "d.md").exists()


@pytest.mark.integration
def test_compare_jobs_matches_serial(suite, tmp_path):
    runs = R.plan_suite(R.load_suite(suite), tmp_path / "serial", seeds=1)
    serial = C.run_all(runs, quiet=True)
    par = C.run_all(R.plan_suite(R.load_suite(suite), tmp_path / "par", seeds=1), quiet=True, jobs=2)
    for a, b in zip(serial, par):  # one torch thread in either case: the same numbers
        assert (a["gm"], a["pm"], a["communication"]) == (b["gm"], b["pm"], b["communication"])
    with pytest.raises(ConfigError, match="--jobs"):
        C.run_all(runs, jobs=0)


@pytest.mark.integration
def test_suite_tunes_on_a_validation_split(suite, tmp_path):
    """`tune`: each value runs on the validation split; the best validation GM of a stable
    setting is used in the measured runs and shown with every score."""
    from fedsplice.study import tuning as T

    text = suite.read_text().replace('set = ["server.optimizer=fedavgm"]',
                                     'set = ["server.optimizer=fedavgm"]\n'
                                     'tune = {key = "server.lr", values = [0.5, 2.0]}')
    suite.write_text(text)
    doc = tmp_path / "docs" / "results.md"
    R.run_suite(suite, tmp_path / "out", doc, quiet=True, command="make results")
    val = {v: json.loads((tmp_path / "out" / "tune" / "runs" / f"fl--{v:g}" / "seed-0" / "results.json").read_text())
           for v in (0.5, 2.0)}
    cfgs = {v: (tmp_path / "out" / "tune" / "runs" / f"fl--{v:g}" / "seed-0" / "config.toml").read_text() for v in val}
    assert all('on = "validation"' in c for c in cfgs.values())
    gm = {v: r["gm"]["accuracy"] for v, r in val.items()}
    # a setting whose validation curve fell at the end or whose loss rose is not chosen (tests/test_tuning.py)
    why = {v: T.unstable([tmp_path / "out" / "tune" / "runs" / f"fl--{v:g}" / "seed-0"], "GM acc") for v in val}
    best = max([v for v in val if not why[v]] or list(val), key=lambda v: (gm[v], -v))
    measured = (tmp_path / "out" / "runs" / "fl" / "seed-0" / "config.toml").read_text()
    assert f"lr = {best}" in measured and 'on = "test"' in measured
    page = doc.read_text()
    assert "## Hyperparameters chosen on a validation split" in page
    cell = ", ".join(f"{v:g}: {gm[v]:.3f}" + (f" (unstable: {why[v]})" if why[v] else "") for v in val)
    assert (f"| fl | `server.lr` | GM acc | {cell} | **{best:g}** (edge of the grid: server.lr)"
            f"{' ' + T.NONE_STABLE if all(why.values()) else ''} |") in page
    with pytest.raises(ConfigError, match="tune.values must list at least 2 values"):
        suite.write_text(text.replace("values = [0.5, 2.0]", "values = [0.5]"))
        R.load_suite(suite)


def test_parameter_columns():
    r = {"params": {"global": 3, "private": 5}}
    assert R.value(r, "trainable params") == 8.0 and R.value(r, "shared params") == 3.0
    assert R.fmt(np.array([1000.0, 3000.0]), "trainable params") == "2,000 ± 1,000"


def test_tuning_grid_runs_every_combination_and_chooses_the_best(suite, tmp_path):
    """A `grid` tunes keys together (FedYogi's η with its τ): one validation run per combination,
    the best mean metric chosen (the first on a tie), its values added to the experiment and to
    the experiments that take them with `tune_from` (a name or a list of names)."""
    from fedsplice.study import tuning as T

    text = suite.read_text().replace(
        'set = ["server.optimizer=fedavgm"]',
        'set = ["server.optimizer=fedyogi"]\ntune = {grid = {"server.lr" = [0.01, 0.1], "server.tau" = [0.001, 0.01]}, '
        'metric = "PM acc"}').replace('label = "PFAdapter"', 'label = "PFAdapter"\ntune_from = ["fl"]')
    suite.write_text(text)
    s = R.load_suite(suite)
    runs = T.plan_tuning(s, tmp_path / "out")
    assert [r[0] for r in runs] == ["fl--0.01,0.001", "fl--0.01,0.01", "fl--0.1,0.001", "fl--0.1,0.01"]
    assert runs[1][2].server.lr == 0.01 and runs[1][2].server.tau == 0.01 and runs[1][2].eval.on == "validation"
    scores = {"fl--0.01,0.001": 0.5, "fl--0.01,0.01": 0.7, "fl--0.1,0.001": 0.7, "fl--0.1,0.01": 0.6}
    chosen = T.apply_tuning(s, runs, [{"pm": {"accuracy": scores[r[0]]}} for r in runs], R.value)
    assert chosen["fl"]["chosen"] == (0.01, 0.01)  # a tie goes to the first
    assert s.experiments["fl"]["set"][-2:] == ["server.lr=0.01", "server.tau=0.01"]
    assert s.experiments["pf"]["set"][-2:] == ["server.lr=0.01", "server.tau=0.01"]
    # an experiment's own tuned key is never taken from its source
    s.experiments["pf"]["set"] = []
    s.experiments["pf"]["tune"] = {"key": "server.tau", "values": [0.1, 0.2], "metric": "PM acc"}
    runs_pf = [r for r in T.plan_tuning(s, tmp_path / "out") if r[0].startswith("pf--")]
    both = [*runs, *runs_pf]
    T.apply_tuning(s, both, [{"pm": {"accuracy": scores.get(r[0], 0.9 if r[0] == "pf--0.2" else 0.1)}} for r in both],
                   R.value)
    assert s.experiments["pf"]["set"] == ["server.tau=0.2", "server.lr=0.01"]
    md = T.tuning_section(chosen, {})
    assert "| fl | `server.lr`, `server.tau` | PM acc | 0.01,0.001: 0.500, 0.01,0.01: 0.700" in md
    assert md.rstrip().endswith("| **0.01, 0.01** (edge of the grid: server.lr, server.tau) |")
    assert T.edge({"keys": ["x"], "scores": {(1,): 0.1, (2,): 0.3, (3,): 0.2}, "chosen": (2,)}) == ""
    with pytest.raises(ConfigError, match="no validation run reports 'GM acc'"):
        s.experiments["pf"]["tune"]["metric"] = "GM acc"
        T.apply_tuning(s, both, [{"pm": {"accuracy": 0.5}} for _ in both], R.value)
    with pytest.raises(ConfigError, match="tune.grid must map keys to lists of values"):
        suite.write_text(text.replace('"server.tau" = [0.001, 0.01]', '"server.tau" = []'))
        R.load_suite(suite)


def test_setting_text_is_read_from_the_configs():
    """A value all experiments share is stated once; others are listed with their experiments;
    FedPuReL's phase 2 says which schedule (and T_p) the runs used."""
    import copy

    from fedsplice.config import ExperimentConfig
    from fedsplice.study.settings import setting_text

    a = ExperimentConfig()
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    b.client.lr = 0.01
    c.algorithm, c.method = "fedpurel", {"phase2": "after", "personal_rounds": 2}
    text = setting_text({"a": a, "b": b, "c": c}, str.upper)
    assert "client optimizer: AdamW lr 0.0005, constant lr, optimizer state fresh (B: AdamW lr 0.01, constant lr, " \
           "optimizer state fresh)" in text
    assert "FedPuReL phase 2: after the rounds, T_p = 2 rounds of the local budget;" in text
    c.method = {}
    assert ("FedPuReL phase 2: persistent (the branch trained in every round a client is sampled)"
            in setting_text({"c": c}))
    assert (f"budget: {a.server.rounds} rounds × {a.client.local_epochs} local epoch(s), "
            f"batch {a.client.batch_size}") in text
    assert (f"GM on {a.data.test_per_class} test samples a class, PM on {a.data.local_test_size} local test samples "
            "a client redrawn from the global test set") in text
    a.data.local_test, a.data.global_test_per_class, a.data.local_test_size = "disjoint", 70, 300
    disjoint = setting_text({"a": a})
    assert ("GM on 70 test samples a class (at most: a class's unused items may run out), PM on up to 300 local "
            "test samples a client, disjoint from each other, the global test set and training") in disjoint


@pytest.mark.integration
def test_records_restore_a_suite_and_stale_runs_run_again(suite, tmp_path, monkeypatch):
    """--records: a fresh OUT is rebuilt from the records without running anything; a run whose
    config or goldens hash differs is stale, moved aside (not deleted) to run again."""
    from fedsplice.study import provenance as P

    records, doc = tmp_path / "records", tmp_path / "docs" / "results.md"
    R.run_suite(suite, tmp_path / "out", doc, quiet=True, records=records)
    first = doc.read_text()
    prov = json.loads((records / "runs" / "pf" / "seed-0" / "provenance.json").read_text())
    assert prov == {"commit": P.commit(), "goldens": P.goldens_hash()} and prov["goldens"]
    assert sorted(p.name for p in (records / "runs" / "pf" / "seed-0").iterdir()) == sorted(P.FILES)
    assert f"Runs by commit: 4 at {P.commit()}." in first and "0 were restored" in first
    # each run is recorded as it finishes (a stopped suite keeps it), not only at the end
    stamp = P.stamper({"commit": "x", "goldens": None}, tmp_path / "out", tmp_path / "early")
    stamp(("pf", 0, None, tmp_path / "out" / "runs" / "pf" / "seed-0"))
    assert json.loads((tmp_path / "early" / "runs" / "pf" / "seed-0" / "provenance.json").read_text())["commit"] == "x"
    calls = []
    monkeypatch.setattr(C, "_one", lambda *a: calls.append(a))
    R.run_suite(suite, tmp_path / "fresh", doc, quiet=True, records=records)
    assert calls == [] and "4 were restored from the committed records" in doc.read_text()
    strip = lambda t: re.sub(r"Generated by .*\n", "", t)  # noqa: E731
    assert strip(doc.read_text()) == strip(first)
    # stale: other goldens, or another config; moved to OUT/stale/<time>/runs/...
    runs = R.plan_suite(R.load_suite(suite), tmp_path / "fresh")
    assert P.stale(runs[0][3], runs[0][2], P.goldens_hash()) is None
    # goldens changed: the hash recorded at the run's commit no longer matches those files now
    def recorded_goldens(value):
        for *_, d in runs:
            f = d / "provenance.json"
            f.write_text(json.dumps({**json.loads(f.read_text()), "goldens": value}))
    now = P.goldens_hash()
    recorded_goldens("0" * 16)
    assert "goldens changed" in P.stale(runs[0][3], runs[0][2], now)
    recorded_goldens(now)
    # a setting added after the run (absent from its config.toml) takes its default: still valid
    saved = runs[0][3] / "config.toml"
    text = saved.read_text()
    saved.write_text(re.sub(r"(?m)^unpad = .*\n", "", text))
    assert saved.read_text() != text and P.stale(runs[0][3], runs[0][2], P.goldens_hash()) is None
    saved.write_text(text.replace("[runtime]\n", "[runtime]\nno_such_setting = 1\n"))
    assert P.stale(runs[0][3], runs[0][2], P.goldens_hash()).startswith("its config no longer parses (")
    saved.write_text(text)
    other = R.plan_suite(R.load_suite(suite), tmp_path / "fresh", seeds=1)
    other[0][2].client.lr *= 2
    assert P.stale(other[0][3], other[0][2], P.goldens_hash()) == "its config differs from the suite's"
    recorded_goldens("0" * 16)
    assert P.prepare(runs, tmp_path / "fresh", None, now) == {"restored": 0, "stale": 4}
    moved = list((tmp_path / "fresh" / "stale").glob("*/runs/pf/seed-0/results.json"))
    assert len(moved) == 1 and not (tmp_path / "fresh" / "runs" / "pf" / "seed-0").exists()


def test_the_committed_suite_loads_and_every_run_plans(tmp_path):
    """configs/results/suite.toml: every experiment's config and overrides validate, every claim
    names its table's rows, and no group writes its setting by hand."""
    from pathlib import Path

    from fedsplice.study import tuning as T

    s = R.load_suite(Path(__file__).parents[1] / "configs" / "results" / "suite.toml")
    assert len(R.plan_suite(s, tmp_path)) > 100 and T.plan_tuning(s, tmp_path)
    kinds = {cl["kind"] for tb in s.tables for cl in tb.get("claim", [])}
    assert {"greater", "best", "balanced", "ratio", "benchmark", "untestable"} <= kinds
    assert not any(cl.get("metric") == "cold-start e5" for tb in s.tables for cl in tb.get("claim", []))


def test_goldens_of_configs_added_since_do_not_make_a_run_stale(monkeypatch):
    """A run stays valid while every golden that existed at its commit is unchanged: the golden of
    a config added later (a new method) pins other numbers."""
    from fedsplice.study import provenance as P

    root = Path(__file__).parents[1]
    now = {p.name for p in (root / P.GOLDEN).iterdir() if p.is_dir()}
    older = now - {"feddpa-minilm"}
    prov = {"commit": "abc1234 with uncommitted changes", "goldens": P.goldens_hash(root, only=older)}
    assert prov["goldens"] != P.goldens_hash(root)
    monkeypatch.setattr(P, "goldens_at", lambda c: older if c == "abc1234" else None)
    assert P.goldens_kept(prov, root)
    monkeypatch.setattr(P, "goldens_at", lambda c: now)  # then as now: the hash differs, so one changed
    assert not P.goldens_kept(prov, root)
    assert not P.goldens_kept({"commit": "unknown", "goldens": prov["goldens"]}, root)


def test_time_line_claims_a_from_scratch_time_only_when_every_run_ran_now():
    fresh = R.time_line({"compute_min": 12.0, "executed": 4, "runs": 4, "wall_min": 6.5})
    assert fresh == ("The runs' recorded wall times add up to 12 min (every run ran in this invocation, "
                     "so 6.5 min is the from-scratch time). ")
    reused = R.time_line({"compute_min": 1748.3, "executed": 3, "runs": 233, "wall_min": 4.9})
    assert reused.startswith("The runs' recorded wall times add up to 1748 min; runs finished in earlier")
    assert "from-scratch time" not in reused and "neither measures nor bounds a from-scratch run" in reused
    cpu = R.time_line({"compute_min": 20.0, "executed": 1, "runs": 4, "wall_min": 1.0, "jobs": 2,
                       "cpu_min": 150.0, "cpu_runs": 3})
    assert cpu.endswith("The CPU time of 3 of the runs (process time, which no pause or other job adds to; 1 thread "
                        "a run) adds up to 150 min, 2.5 h, or 1.2 h with 2 runs at once. Restored runs count the CPU "
                        "time of the machine and the commit that made them; `python benchmarks/results_budget.py` "
                        "estimates a from-scratch run on this machine. ")
    scratch = R.time_line({"compute_min": 20.0, "executed": 4, "runs": 4, "wall_min": 10.5, "jobs": 2,
                           "cpu_min": 40.0, "cpu_runs": 4})
    assert scratch.endswith("adds up to 40 min, 0.7 h, or 0.3 h with 2 runs at once. ")
