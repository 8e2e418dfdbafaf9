"""`fedsplice results SUITE`: the papers' tables reproduced from one suite file (what `make
results` runs), written as docs/results.md with a folder of tables and plots per table.

A suite (configs/results/suite.toml) names experiments — a committed config plus overrides —
groups them into tables, and states each paper claim as a check over the measured runs (the
kinds, the training-signal gate and the tests that decide them: `fedsplice.study.claims`). Each
group's setting text is generated from its runs' configs (`fedsplice.study.settings`).

All runs share OUT/runs/<experiment>/seed-<s> and go through `compare.run_all`, so a
suite that is stopped and started again runs only what is missing; a finished run is reused
only while its config and the goldens that existed at its commit are unchanged (`fedsplice.study.provenance`).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from fedsplice.app import compare as C
from fedsplice.app.rundir import atomic_write_text
from fedsplice.errors import ConfigError
from fedsplice.study import claims as V
from fedsplice.study import curves as H
from fedsplice.study import diagnostics as D
from fedsplice.study import provenance as P
from fedsplice.study import tableplots as TP
from fedsplice.study import tuning as T
from fedsplice.study.claims import PARAMS, fmt, per_seed, value
from fedsplice.study.settings import setting_text

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig

COLUMNS = {c for c, _ in C.METRICS} | set(PARAMS)
KINDS = ("greater", "best", "lowest", "balanced", "ratio", "gap_greater", "benchmark", "untestable")
NO_METRIC = ("untestable", "benchmark")
ROWS_OF = {"greater": ("a", "b"), "ratio": ("a", "b"), "best": ("a",), "lowest": ("a",), "balanced": ("a",),
           "gap_greater": ("a1", "b1", "a2", "b2")}  # the row fields each kind needs


@dataclasses.dataclass
class Suite:
    seeds: int  # the default; a group's `seeds` wins, and `--seeds` (fixed=True) wins over both
    jobs: int
    groups: dict[str, dict]
    experiments: dict[str, dict]
    tables: list[dict]
    tuned: dict = dataclasses.field(default_factory=dict)  # filled by run_suite (fedsplice.study.tuning)
    fixed: bool = False
    # the pre-registered families of claims and the α each is decided at (Holm within each)
    alphas: dict[str, float] = dataclasses.field(default_factory=lambda: {"secondary": V.ALPHA})

    def group_seeds(self, group: str) -> int:
        return self.seeds if self.fixed else int(self.groups[group].get("seeds", self.seeds))

    def experiment_seeds(self, name: str) -> int:
        """A display-only row may run fewer seeds than its group (`seeds` on the experiment)."""
        e = self.experiments[name]
        return self.seeds if self.fixed else int(e.get("seeds", self.group_seeds(e["group"])))


def _check_group(path: Path, k: str, g: dict) -> None:
    """A [groups.K] table: no hand-written setting, its tune_set and seeds well formed."""
    if "setting" in g:
        raise ConfigError(f"{path}: [groups.{k}] setting: the page generates it from the runs' configs; "
                          f"remove it (the paper's setting stays in `paper`)")
    ts = g.get("tune_set", [])
    if not (isinstance(ts, list) and all(isinstance(x, str) and "=" in x for x in ts)):
        raise ConfigError(f"{path}: [groups.{k}] tune_set must list overrides for the group's validation runs, "
                          f"e.g. tune_set = [\"data.local_test_size=100\"]; got {ts!r}")
    if not isinstance(g.get("seeds", 1), int) or g.get("seeds", 1) < 1:
        raise ConfigError(f"{path}: [groups.{k}] seeds must be an integer >= 1, got {g['seeds']!r}")


def load_suite(path: Path) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"results: no suite file {path}; the committed one is configs/results/suite.toml")
    try:
        t = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:  # (not `e`: the loops below name an experiment `e`)
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    groups = t.get("groups", {})
    for k, g in groups.items():
        _check_group(path, k, g)
    exps = {}
    for e in t.get("experiment", []):
        for k in ("name", "config", "group"):
            if k not in e:
                raise ConfigError(f"{path}: an [[experiment]] has no `{k}`; give name, config, group")
        if e["name"] in exps:
            raise ConfigError(f"{path}: experiment {e['name']!r} is defined twice; names must be unique")
        if e["group"] not in groups:
            raise ConfigError(f"{path}: experiment {e['name']!r}: group {e['group']!r} is not in [groups]")
        if "tune" in e:
            T.check_tune(path, e["name"], e["tune"], COLUMNS)
        if not isinstance(e.get("seeds", 1), int) or isinstance(e.get("seeds"), bool) or e.get("seeds", 1) < 1:
            raise ConfigError(f"{path}: experiment {e['name']!r}: seeds must be an integer >= 1, got {e['seeds']!r}")
        exps[e["name"]] = e
    for e in exps.values():
        for src in T.sources(e):
            if "tune" not in exps.get(src, {}):
                raise ConfigError(f"{path}: experiment {e['name']!r}: tune_from = {src!r} names no "
                                  f"experiment with a `tune` table")
    alphas = t.get("families", {"secondary": V.ALPHA})
    if not (isinstance(alphas, dict) and alphas and all(isinstance(a, float) and 0 < a < 1 for a in alphas.values())
            and sum(alphas.values()) <= V.ALPHA + 1e-12):
        raise ConfigError(f"{path}: [families] must give each family of claims its α, with the α summing to at "
                          f"most {V.ALPHA} (e.g. primary = 0.04, secondary = 0.01); got {alphas!r}")
    tables = t.get("table", [])
    for tb in tables:
        for name in tb.get("rows", []):
            if name not in exps:
                raise ConfigError(f"{path}: table {tb.get('id')!r} lists {name!r}, which is no experiment")
        for col in tb.get("columns", []):
            if col not in COLUMNS:
                raise ConfigError(f"{path}: table {tb.get('id')!r}: column {col!r} is unknown; "
                                  f"one of {', '.join(sorted(COLUMNS))}")
        if "sweep" in tb and len(tb.get("xs", [])) != len(tb["rows"]):
            raise ConfigError(f"{path}: table {tb.get('id')!r}: xs needs one value per row ({len(tb['rows'])})")
        _check_claims(path, tb, alphas)
        for name in _claimed(tb):
            if "seeds" in exps[name]:
                raise ConfigError(f"{path}: experiment {name!r} sets its own seeds but a claim of table "
                                  f"{tb.get('id')!r} compares it; claims pair rows seed by seed, so remove its "
                                  f"`seeds` (only display-only rows may run fewer)")
    return Suite(int(t.get("seeds", 3)), int(t.get("jobs", 1)), groups, exps, tables, alphas=alphas)


def _claimed(tb: dict) -> set[str]:
    """The rows a table's claims pair by seed (every row, for a best / lowest claim)."""
    return {n for cl in tb.get("claim", []) for n in V.compared(cl, tb["rows"])[0]}  # a ratio (bytes): none


def _check_claims(path: Path, tb: dict, alphas: dict[str, float]) -> None:
    """Each claim of a table: a known kind and metric, the fields its kind needs, rows of its table."""
    for cl in tb.get("claim", []):
        if cl.get("family", "secondary") not in alphas:
            raise ConfigError(f"{path}: table {tb.get('id')!r}: claim family {cl.get('family')!r} is not in "
                              f"[families] ({', '.join(alphas)}); name one of them or add it there")
        eq = cl.get("equivalence")
        if eq is not None and not (cl.get("kind") in ("greater", "gap_greater") and isinstance(eq, float) and eq > 0):
            raise ConfigError(f"{path}: table {tb.get('id')!r}: claim equivalence = {eq!r}: a margin > 0 (half "
                              f"the paper's effect, e.g. 0.0165) on a greater or gap_greater claim")
        m = cl.get("metric")
        if cl.get("kind") not in NO_METRIC and m not in COLUMNS and not str(m).startswith("cold-start e"):
            raise ConfigError(f"{path}: table {tb.get('id')!r}: claim metric {m!r} is unknown; "
                              f"one of {', '.join(sorted(COLUMNS))} or 'cold-start eN'")
        if cl.get("kind") not in KINDS:
            raise ConfigError(f"{path}: table {tb.get('id')!r}: claim kind {cl.get('kind')!r} is unknown; "
                              f"use {', '.join(KINDS)}")
        if cl.get("kind") == "balanced" and cl.get("metric_b") not in COLUMNS:
            raise ConfigError(f"{path}: table {tb.get('id')!r}: a balanced claim needs metric_b, one of "
                              f"{', '.join(sorted(COLUMNS))}")
        if cl.get("kind") == "balanced" and not (isinstance(cl.get("margin"), (int, float)) and cl["margin"] > 0):
            raise ConfigError(f"{path}: table {tb.get('id')!r}: a balanced claim needs margin > 0, the "
                              f"difference its equivalence test allows (e.g. margin = 0.05)")
        if cl.get("kind") == "benchmark" and not (cl.get("measured") and cl.get("source")):
            raise ConfigError(f"{path}: table {tb.get('id')!r}: a benchmark claim needs `measured` (the number) "
                              f"and `source` (the benchmark's result file)")
        if (miss := [k for k in ROWS_OF.get(cl["kind"], ()) if k not in cl]):
            raise ConfigError(f"{path}: table {tb.get('id')!r}: a {cl['kind']} claim needs "
                              f"{', '.join(miss)}: the rows it compares")
        for k in ("a", "b", "a1", "b1", "a2", "b2"):
            if k in cl and cl[k] not in tb["rows"]:
                raise ConfigError(f"{path}: table {tb.get('id')!r}: claim {k} = {cl[k]!r} is not one of its rows")


def plan_suite(suite: Suite, out: Path, seeds: int | None = None, only: list[str] | None = None):
    """Every measured run, (experiment, seed, cfg, dir): its group's seeds, or `seeds` for all."""
    runs = []
    for n, e in suite.experiments.items():
        if not only or n in only:
            entry = (n, Path(e["config"]), [*suite.groups[e["group"]].get("set", []), *e.get("set", [])])
            runs += C.plan_entries([entry], seeds or suite.experiment_seeds(n), out)
    return runs


# ----------------------------------------------------------------------------- the document


def table_results(tb: dict, runs, by_run: dict) -> dict[str, list[dict]]:
    """The results.json of each of a table's rows, one per seed."""
    return {n: [by_run[r[:2]] for r in runs if r[0] == n] for n in tb["rows"]}


def table_section(tb: dict, suite: Suite, runs, by_run: dict, fig_dir: Path, rel: str, verdicts: list) -> str:
    """Markdown for one table (and its folder: full table.md/csv and plots), with its claims'
    verdicts (`claims.Verdict`, decided with the whole page's)."""
    rows, cols = tb["rows"], tb.get("columns", ["GM acc", "PM acc", "PM F1", "up B/round"])
    d = fig_dir / tb["id"]
    if rows:
        d.mkdir(parents=True, exist_ok=True)
    sub = [r for n in rows for r in runs if r[0] == n]  # in the table's row order
    sub_res = [by_run[r[:2]] for r in sub]
    results = table_results(tb, runs, by_run)
    if rows:
        C.write_tables(C.summarize(sub, sub_res), d)
    lab = lambda n: suite.experiments[n].get("label", n)  # noqa: E731
    xcol = [tb["sweep"]] if "sweep" in tb else []
    md = [f"## {tb['title']}", "", tb.get("about", "").strip(), ""]
    if rows:
        md += ["| method | " + " | ".join(xcol + cols) + " |", "|---|" + "---|" * (len(cols) + len(xcol))]
        for i, n in enumerate(rows):
            x = [f"{tb['xs'][i]:g}"] if xcol else []
            md.append(f"| {lab(n)} | " + " | ".join(x + [fmt(per_seed(results, n, c), c) for c in cols]) + " |")
        n_seeds = sorted({len(v) for v in results.values()})
        md += ["", f"mean ± std over {'/'.join(map(str, n_seeds))} seeds; every metric, by experiment name: "
                   f"[{rel}/{tb['id']}/table.md]({rel}/{tb['id']}/table.md).", ""]
    if tb.get("diagnostics"):
        md += D.diagnostics_md(tb["diagnostics"], rows, sub, lab)
    if tb.get("diagnostic_curves"):
        png = D.curves_plot(tb["diagnostic_curves"], rows, sub, lab, d / "diagnostics.png")
        md += [f"Per round (mean over seeds): {', '.join(f'`{k}`' for k in tb['diagnostic_curves'])}.", "",
               f"![diagnostics]({rel}/{tb['id']}/{png})", ""]
    if tb.get("cold_start"):
        epochs = results[rows[0]][0]["cold_start"]["epochs"]
        md += ["Cold start (held-out clients: the final global adapters, then local epochs):", "",
               "| method | " + " | ".join(f"epoch {e}" for e in epochs) + " |", "|---|" + "---|" * len(epochs)]
        md += [f"| {lab(n)} | " + " | ".join(fmt(per_seed(results, n, f"cold-start e{e}"), "acc") for e in epochs)
               + " |" for n in rows]
        plot = TP.cold_plot(tb, suite.experiments, results, d / 'cold_start.png', epochs)
        md += ["", f"![cold start]({rel}/{tb['id']}/{plot})", ""]
    if tb.get("plots"):
        shown = [(lab(r[0]), *r[1:]) for r in sub]  # plot legends show the labels
        pngs = C.write_plots(shown, d)
        if (cls := C.write_class_plot(shown, sub_res, d)):
            pngs.append(cls)
        md += [" ".join(f"![{p}]({rel}/{tb['id']}/{p})" for p in pngs), ""]
    if "sweep" in tb:
        md += [f"![sweep]({rel}/{tb['id']}/{TP.sweep_plot(tb, results, d / 'sweep.png')})", ""]
    for cl, v in zip(tb.get("claim", []), verdicts):
        md.append(f"- **{V.label(v)}** — {cl['text']} *Measured:* {v.evidence}")
    md.append("")
    return "\n".join(md)


def group_setting(suite: Suite, runs, group: str) -> str:
    """The group's setting, generated from the configs of its runs (`fedsplice.study.settings`)."""
    cfgs: dict[str, ExperimentConfig] = {}
    for name, _, cfg, _ in runs:
        if suite.experiments[name]["group"] == group:
            cfgs.setdefault(name, cfg)
    return setting_text(cfgs, lambda n: suite.experiments[n].get("label", n))


def time_line(meta: dict) -> str:
    """What the runs' recorded times measure: a from-scratch time only when this invocation ran
    every run; runs finished in earlier sittings may have been paused or shared the CPU. Their
    CPU seconds (`cpu_s`, runs from 2026-12-06 on) count neither."""
    total = f"The runs' recorded wall times add up to {meta['compute_min']:.0f} min"
    if meta["executed"] == meta["runs"]:
        head = f"{total} (every run ran in this invocation, so {meta['wall_min']:.1f} min is the from-scratch time). "
    else:
        head = (f"{total}; runs finished in earlier sittings count any time they were paused or shared the CPU, and "
                "a run resumed in a later sitting counts only that sitting, so this sum neither measures nor bounds a "
                "from-scratch run. ")
    n, cpu = meta.get("cpu_runs", 0), meta.get("cpu_min", 0.0)
    if not n:
        return head
    line = (f"The CPU time of {'every run' if n == meta['runs'] else f'{n} of the runs'} (process time, which "
            f"no pause or other job adds to; 1 thread a run) adds up to {cpu:.0f} min, {cpu / 60:.1f} h, or "
            f"{cpu / 60 / meta['jobs']:.1f} h with {meta['jobs']} runs at once. ")
    if meta["executed"] == meta["runs"]:
        return head + line
    # a record's CPU time is that of the machine and the code that made it (a CPU twice as slow, an
    # older commit's slower evaluation), so the sum says little about a run from scratch here
    return head + line + ("Restored runs count the CPU time of the machine and the commit that made them; "
                          "`python benchmarks/results_budget.py` estimates a from-scratch run on this machine. ")


def provenance_line(meta: dict) -> str:
    """Which commits the runs come from, and the rule that let older ones be reused."""
    if not meta.get("by_commit"):
        return ""
    commits = ", ".join(f"{n} at {c}" for c, n in sorted(meta["by_commit"].items(), key=lambda x: -x[1]))
    reuse = meta.get("reuse", {})
    return (f"Runs by commit: {commits}. A run from an earlier commit is reused only while its config is the one "
            f"planned now and the regression goldens that existed at its commit are unchanged (goldens added "
            f"since, for new configs, do not count; hash now {meta.get('goldens') or 'none: no goldens'}); "
            f"{reuse.get('restored', 0)} were restored from the committed records, {reuse.get('stale', 0)} were stale "
            f"and ran again.")


def histories(runs) -> dict[str, list[H.History]]:
    """Each experiment's per-seed curves, read from its runs' metrics.jsonl (to name divergence)."""
    out: dict[str, list[H.History]] = {}
    for r in runs:
        if (h := H.history(r[3])) is not None:
            out.setdefault(r[0], []).append(h)
    return out


def _counts(verdicts: list[V.Verdict]) -> str:
    """Statistical and deterministic verdicts counted apart; decisive ones on clean rows apart."""
    stat = [v for v in verdicts if v.verdict in V.STATISTICAL and not v.deterministic]
    det = [v for v in verdicts if v.deterministic]
    by = lambda vs: ", ".join(f"{n} {k}" for k in dict.fromkeys(V.label(v) for v in vs)  # noqa: E731
                              if (n := sum(V.label(v) == k for v in vs)))
    other = [v for v in verdicts if v not in stat and v not in det]
    return (f"**Claims:** {len(stat)} decided by a statistical test ({by(stat) or 'none'}), of which "
            f"**{sum(map(V.decisive, stat))} decisive** (held, did not hold or smaller than the paper's effect, on "
            f"rows that all learned and none diverged); {len(det)} deterministic (bytes, parameters: "
            f"{by(det) or 'none'}); {by(other) or 'no others'}.")


def write_doc(suite: Suite, runs, res_list, doc: Path, meta: dict) -> Path:
    by_run = {r[:2]: res for r, res in zip(runs, res_list)}
    fig_dir = doc.with_suffix("")  # docs/results.md -> docs/results/
    rel = fig_dir.name
    curves = histories(runs)
    verdicts = [[V.assess(cl, table_results(tb, runs, by_run), tb["rows"], curves) for cl in tb.get("claim", [])]
                for tb in suite.tables]
    flat = [v for vs in verdicts for v in vs]
    V.decide_all(flat, suite.alphas)
    sections = [table_section(tb, suite, runs, by_run, fig_dir, rel, vs) for tb, vs in zip(suite.tables, verdicts)]
    claims = [(tb["title"], cl["text"], cl.get("family", "secondary"), V.label(v))
              for tb, vs in zip(suite.tables, verdicts) for cl, v in zip(tb.get("claim", []), vs)]
    head = [
        "# Results: the two papers' experiments on the offline zoo", "",
        f"Generated by `{meta['command']}` at commit {meta['commit']} on {meta['date']}. "
        f"{meta['runs']} runs ({meta['executed']} run by this invocation, {meta['runs'] - meta['executed']} "
        f"found finished in {meta['out']}); this invocation took {meta['wall_min']:.1f} min with {meta['jobs']} "
        f"run(s) at once on {meta['machine']}. " + time_line(meta) +
        "Every number below is read from the runs' results.json, "
        "and the same command regenerates this page. " + provenance_line(meta), "",
        "**Substitute setting, not the papers' setting.** No image model weights or the papers' data sets "
        "can be obtained offline here, so both papers are reproduced on text classification with the "
        "offline zoo's real models; numbers are not comparable to the papers', only the direction of "
        "each claim is. Runs pair up by seed (same clients, same sampling stream) and personalized accuracy "
        "also by client within a seed; the seed is the unit of replication (a seed's clients share one run). "
        "Every claim with a metric is tested; the claims were pre-registered in two families (the papers' "
        "headline claims: primary; the rest: secondary) before the runs they are decided on. A claim *held* "
        "when a two-sided paired t-test over seeds (an equivalence test, TOST, for a claim of no difference) "
        "is significant on the claimed side after Holm's correction within its family, *did not hold* when it "
        "is significant on the other side, is *smaller than the paper's effect* when an equivalence test at "
        "half the paper's effect is significant, and is *inconclusive* otherwise. Where every seed gives the "
        "same accuracy difference the t-test is undefined and the exact sign-flip test decides (p = 2/2^seeds). "
        "Each claim also prints what its rows did, as information that never blocks the test: each trained "
        "row's paired change from round 0 (mean, t), and a row that diverged (training loss ending above its "
        "start, or a fall on every seed after a rise) or did not learn (neither GM nor PM accuracy moved off "
        "round 0 at p < 0.05); a verdict over such a row says so and is not counted as decisive. Byte ratios "
        "do not vary with the seed and are compared as they are. "
        + V.family_note(flat, suite.alphas, seeds=min(map(suite.group_seeds, suite.groups), default=None)), "",
        "| | this page | the paper |", "|---|---|---|"]
    head += [f"| {g.get('title', k)} | {group_setting(suite, runs, k)} | {g.get('paper', '')} |"
             for k, g in suite.groups.items()]
    head += ["", _counts(flat), "", "| table | claim | family | verdict |", "|---|---|---|---|"]
    head += [f"| {t} | {c} | {f} | **{v}** |" for t, c, f, v in claims]
    tuned = T.tuning_section(suite.tuned, {n: e.get("label", n) for n, e in suite.experiments.items()})
    conv = D.convergence_md(list(suite.experiments), runs, lambda n: f"{suite.experiments[n].get('label', n)} (`{n}`)")
    atomic_write_text(doc, "\n".join(head) + "\n\n" + (tuned + "\n" if tuned else "") + "\n".join(sections)
                      + "\n" + "\n".join(conv))
    return doc


def run_suite(path: Path, out: Path, doc: Path, seeds: int | None = None, jobs: int | None = None,
              quiet: bool = False, command: str = "", records: Path | None = None) -> Path:
    """Run (or reuse, `fedsplice.study.provenance`) every run of the suite, then write the page."""
    suite = load_suite(path)
    if seeds:
        suite.seeds, suite.fixed = seeds, True
    out = Path(out)
    T.plan_tuning(suite, out)
    plan_suite(suite, out)  # every config is validated before anything runs
    t0 = time.perf_counter()
    prov = {"commit": P.commit(), "goldens": P.goldens_hash()}
    reuse, pending = {"restored": 0, "stale": 0}, 0
    tune_runs: list[tuple] = []
    tune_res: list[dict] = []
    for names in T.stages(suite):  # each stage at the values its sources chose (tune_from)
        T.inherit(suite, suite.tuned, names)
        stage = T.plan_tuning(suite, out, names)
        reuse = {k: v + P.prepare(stage, out, records, prov["goldens"])[k] for k, v in reuse.items()}
        pending += sum(not (r[3] / "results.json").exists() for r in stage)
        res = C.run_all(stage, quiet=quiet, jobs=jobs or suite.jobs, on_done=P.stamper(prov, out, records))
        suite.tuned.update(T.choose(suite, names, stage, res, value))
        tune_runs, tune_res = tune_runs + stage, tune_res + res
    T.inherit(suite, suite.tuned, [n for n, e in suite.experiments.items() if "tune" not in e])
    runs = plan_suite(suite, out)  # with the chosen values
    reuse = {k: v + P.prepare(runs, out, records, prov["goldens"])[k] for k, v in reuse.items()}
    pending += sum(not (r[3] / "results.json").exists() for r in runs)
    res = C.run_all(runs, quiet=quiet, jobs=jobs or suite.jobs, on_done=P.stamper(prov, out, records))
    meta = {"command": command or f"fedsplice results {path} --out {out} --doc {doc}", "commit": prov["commit"],
            "goldens": prov["goldens"], "reuse": reuse, "by_commit": P.finish([*tune_runs, *runs], out, records),
            "date": time.strftime("%Y-%m-%d"), "runs": len(runs) + len(tune_runs), "executed": pending, "out": out,
            "wall_min": (time.perf_counter() - t0) / 60, "jobs": jobs or suite.jobs,
            "compute_min": sum(r.get("time_s", 0) for r in [*res, *tune_res]) / 60,
            "cpu_min": sum(r.get("cpu_s", 0) for r in [*res, *tune_res]) / 60,
            "cpu_runs": sum("cpu_s" in r for r in [*res, *tune_res]),
            "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU"}
    return write_doc(suite, runs, res, Path(doc), meta)
