"""`fedsplice results SUITE`: the papers' tables reproduced from one suite file (what `make
results` runs), written as docs/results.md with a folder of tables and plots per table.

A suite (configs/results/suite.toml) names experiments — a committed config plus overrides —
groups them into tables, and states each paper claim as a check over the measured runs:

- greater: experiment a beats b on a metric. Seeds share clients and sampling, so runs pair up
  by seed (and PM accuracy by client within a seed); a 95% paired bootstrap interval of a − b
  (`fedsplice.app.stats`) decides: held if it lies above 0, did not hold if below, else
  inconclusive.
- best / lowest: a beats (stays below) every other row of its table in that sense (did not
  hold if any row beats a / is below a).
- balanced: one experiment's two metrics (zero-shot's many- and few-shot accuracy) do not
  differ: held if the interval of metric − metric_b over seeds contains 0.
- ratio: mean(a) / mean(b) lies in [low, high] (the bytes claims, which do not vary).
- gap_greater: a1 − b1 exceeds a2 − b2 (an advantage that grows with heterogeneity), by the
  interval of the per-seed difference of gaps.
- untestable: a claim this substitute setting cannot test; the suite says why.

All runs share OUT/runs/<experiment>/seed-<s> and go through `compare.run_all`, so a
suite that is stopped and started again runs only what is missing.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import time
import tomllib
from pathlib import Path

import numpy as np

from fedsplice.app import compare as C
from fedsplice.app import diagnostics as D
from fedsplice.app import stats as S
from fedsplice.app import tuning as T
from fedsplice.errors import ConfigError
from fedsplice.app.rundir import atomic_write_text

PARAMS = ("trainable params", "shared params")  # from results.json's params: GLOBAL + PRIVATE, GLOBAL
COLUMNS = {c for c, _ in C.METRICS} | set(PARAMS)
KINDS = ("greater", "best", "lowest", "balanced", "ratio", "gap_greater", "untestable")


@dataclasses.dataclass
class Suite:
    seeds: int  # the default; a group's `seeds` wins, and `--seeds` (fixed=True) wins over both
    jobs: int
    groups: dict[str, dict]
    experiments: dict[str, dict]
    tables: list[dict]
    tuned: dict = dataclasses.field(default_factory=dict)  # filled by run_suite (fedsplice.app.tuning)
    fixed: bool = False

    def group_seeds(self, group: str) -> int:
        return self.seeds if self.fixed else int(self.groups[group].get("seeds", self.seeds))


def load_suite(path: Path) -> Suite:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"results: no suite file {path}; the committed one is configs/results/suite.toml")
    try:
        t = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    groups = t.get("groups", {})
    for k, g in groups.items():
        if not isinstance(g.get("seeds", 1), int) or g.get("seeds", 1) < 1:
            raise ConfigError(f"{path}: [groups.{k}] seeds must be an integer >= 1, got {g['seeds']!r}")
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
        exps[e["name"]] = e
    for e in exps.values():
        if "tune_from" in e and "tune" not in exps.get(e["tune_from"], {}):
            raise ConfigError(f"{path}: experiment {e['name']!r}: tune_from = {e['tune_from']!r} names no "
                              f"experiment with a `tune` table")
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
        for cl in tb.get("claim", []):
            m = cl.get("metric")
            if cl.get("kind") != "untestable" and m not in COLUMNS and not str(m).startswith("cold-start e"):
                raise ConfigError(f"{path}: table {tb.get('id')!r}: claim metric {m!r} is unknown; "
                                  f"one of {', '.join(sorted(COLUMNS))} or 'cold-start eN'")
            if cl.get("kind") not in KINDS:
                raise ConfigError(f"{path}: table {tb.get('id')!r}: claim kind {cl.get('kind')!r} is unknown; "
                                  f"use {', '.join(KINDS)}")
            if cl.get("kind") == "balanced" and cl.get("metric_b") not in COLUMNS:
                raise ConfigError(f"{path}: table {tb.get('id')!r}: a balanced claim needs metric_b, one of "
                                  f"{', '.join(sorted(COLUMNS))}")
            for k in ("a", "b", "a1", "b1", "a2", "b2"):
                if k in cl and cl[k] not in tb["rows"]:
                    raise ConfigError(f"{path}: table {tb.get('id')!r}: claim {k} = {cl[k]!r} is not one of its rows")
    return Suite(int(t.get("seeds", 3)), int(t.get("jobs", 1)), groups, exps, tables)


def plan_suite(suite: Suite, out: Path, seeds: int | None = None, only: list[str] | None = None):
    """Every measured run, (experiment, seed, cfg, dir): its group's seeds, or `seeds` for all."""
    runs = []
    for n, e in suite.experiments.items():
        if not only or n in only:
            entry = (n, Path(e["config"]), [*suite.groups[e["group"]].get("set", []), *e.get("set", [])])
            runs += C.plan_entries([entry], seeds or suite.group_seeds(e["group"]), out)
    return runs


# ----------------------------------------------------------------------------- metrics


def value(r: dict, metric: str) -> float | None:
    if metric.startswith("cold-start e"):
        cs = r.get("cold_start") or {}
        e = int(metric.removeprefix("cold-start e"))
        v = cs["accuracy"][cs["epochs"].index(e)] if e in cs.get("epochs", []) else None
        return None if v is None else float(v)  # null: undefined in results.json
    if metric in PARAMS:
        p = r.get("params") or {}
        return float(p.get("global", 0) + (p.get("private", 0) if metric == PARAMS[0] else 0))
    return C._get(r, dict(C.METRICS)[metric])


def per_seed(results: dict[str, list[dict]], name: str, metric: str) -> np.ndarray:
    return np.array([np.nan if (v := value(r, metric)) is None else v for r in results[name]], dtype=float)


def fmt(v: np.ndarray, metric: str) -> str:
    if np.isnan(v).all():
        return "—"
    m, s = np.nanmean(v), np.nanstd(v)
    return f"{m:,.0f} ± {s:,.0f}" if metric.startswith("up") or metric in PARAMS else f"{m:.3f} ± {s:.3f}"


def paired(results: dict[str, list[dict]], a: str, b: str, metric: str) -> np.ndarray:
    """a − b, paired: per seed and client (seeds × clients) for PM accuracy, whose clients are
    the same in both runs of a seed; per seed otherwise."""
    if metric == "PM acc":
        ca = [(r.get("pm") or {}).get("client_accuracy") for r in results[a]]
        cb = [(r.get("pm") or {}).get("client_accuracy") for r in results[b]]
        if all(x is not None and y is not None and len(x) == len(y) for x, y in zip(ca, cb)) and len({len(x) for x in ca}) == 1:
            return np.array(ca, dtype=float) - np.array(cb, dtype=float)
    return per_seed(results, a, metric) - per_seed(results, b, metric)


def interval_verdict(d: np.ndarray, direction: int = 1) -> tuple[str, object]:
    """(verdict, interval) of paired differences: held if the 95% bootstrap interval excludes 0 in
    the claimed direction, did not hold if it excludes 0 the other way, else inconclusive. One
    seed of a per-seed metric is no interval at all: inconclusive."""
    d = np.asarray(d, dtype=float)
    if np.isnan(d).all():
        return "could not be tested", None
    iv = S.paired_bootstrap(d)
    if d.ndim == 1 and iv.n < 2:
        return "inconclusive", iv
    return S.decide(iv, direction), iv


def verdict(claim: dict, results: dict[str, list[dict]], rows: list[str]) -> tuple[str, str]:
    """(held | did not hold | inconclusive | could not be tested, the measured evidence)."""
    kind, metric = claim["kind"], claim.get("metric", "")
    if kind == "untestable":
        return "could not be tested", claim.get("reason", "")
    if kind == "greater":
        a, b = per_seed(results, claim["a"], metric), per_seed(results, claim["b"], metric)
        v, iv = interval_verdict(paired(results, claim["a"], claim["b"], metric))
        if iv is None:
            return v, f"{metric}: too few test samples to report (eval.min_group_samples)"
        return v, f"{metric}: {np.nanmean(a):.4f} vs {np.nanmean(b):.4f}; {S.describe(iv)}"
    if kind in ("best", "lowest"):
        return best_verdict(claim, results, rows, metric, 1 if kind == "best" else -1)
    if kind == "balanced":
        d = per_seed(results, claim["a"], metric) - per_seed(results, claim["a"], claim["metric_b"])
        v, iv = interval_verdict(d)
        if iv is None:
            return v, f"{metric} − {claim['metric_b']}: too few test samples to report (eval.min_group_samples)"
        ev = f"{metric} − {claim['metric_b']} of {claim['a']}: {S.describe(iv)}"
        if iv.n < 2:
            return "inconclusive", ev
        return ("held" if iv.lo <= 0 <= iv.hi else "did not hold"), ev
    if kind == "ratio":
        q = float(np.mean(per_seed(results, claim["a"], metric)) / np.mean(per_seed(results, claim["b"], metric)))
        ok = claim["low"] <= q <= claim["high"]
        return ("held" if ok else "did not hold"), f"{metric}: ratio {q:.3f} (claimed {claim['low']}–{claim['high']})"
    g1 = per_seed(results, claim["a1"], metric) - per_seed(results, claim["b1"], metric)
    g2 = per_seed(results, claim["a2"], metric) - per_seed(results, claim["b2"], metric)
    v, iv = interval_verdict(g1 - g2)
    if iv is None:
        return v, f"{metric}: too few test samples to report (eval.min_group_samples)"
    return v, f"{metric}: gap {np.nanmean(g1):+.4f} vs {np.nanmean(g2):+.4f}; difference of gaps {S.describe(iv)}"


def best_verdict(claim: dict, results, rows: list[str], metric: str, sign: int = 1) -> tuple[str, str]:
    """a is best (sign 1; lowest: −1): held if a beats every other row (each paired interval on
    a's side of 0), did not hold if some row beats a (an interval on the other side), else
    inconclusive."""
    a = claim["a"]
    means = {n: float(np.nanmean(per_seed(results, n, metric))) for n in rows}
    verdicts = {n: interval_verdict(paired(results, a, n, metric), sign) for n in rows if n != a}
    if any(v == "could not be tested" for v, _ in verdicts.values()):
        return "could not be tested", f"{metric}: too few test samples to report (eval.min_group_samples)"
    beaten = [n for n, (v, _) in verdicts.items() if v == "did not hold"]
    runner = max((n for n in rows if n != a), key=lambda n: sign * means[n])
    ev = (f"{metric}: {a} {means[a]:.4f}, {'best' if sign > 0 else 'lowest'} other {means[runner]:.4f} ({runner}); "
          f"vs it {S.describe(verdicts[runner][1])}")
    if beaten:
        return "did not hold", ev + f"; significantly {'behind' if sign > 0 else 'above'} {', '.join(beaten)}"
    return ("held" if all(v == "held" for v, _ in verdicts.values()) else "inconclusive"), ev


# ----------------------------------------------------------------------------- the document


def _git() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs/results.md", ":(exclude)docs/results"],
                               capture_output=True, text=True).stdout.strip()
        return sha + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def _sweep_plot(tb: dict, suite: Suite, results, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    series: dict[str, list[tuple[float, str]]] = {}
    for i, n in enumerate(tb["rows"]):
        series.setdefault(tb.get("series", [""] * len(tb["rows"]))[i], []).append((float(tb["xs"][i]), n))
    for metric in tb.get("sweep_metrics", ["PM acc"]):
        for label, pts in series.items():
            xs = [x for x, _ in pts]
            v = [per_seed(results, n, metric) for _, n in pts]
            ax.errorbar(xs, [np.nanmean(a) for a in v], yerr=[np.nanstd(a) for a in v], marker="o", capsize=3,
                        label=f"{label} {metric}".strip())
    ax.set_xlabel(tb["sweep"])
    if tb.get("log_x"):  # symlog: a sweep may include 0
        ax.set_xscale("symlog", linthresh=min(x for x in map(float, tb["xs"]) if x > 0))
    ax.set_ylabel("accuracy (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return C._save(fig, path)


def _cold_plot(tb: dict, suite: Suite, results, path: Path, epochs: list[int]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for n in tb["rows"]:
        v = [per_seed(results, n, f"cold-start e{e}") for e in epochs]
        ax.errorbar(epochs, [np.nanmean(a) for a in v], yerr=[np.nanstd(a) for a in v], marker="o", capsize=3,
                    label=suite.experiments[n].get("label", n))
    ax.set_xlabel("local epochs on the new client (0 = the global adapters as received)")
    ax.set_ylabel("accuracy of held-out clients")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return C._save(fig, path)


def table_section(tb: dict, suite: Suite, runs, by_run: dict, fig_dir: Path, rel: str):
    """Markdown for one table (and its folder: full table.md/csv and plots); returns (md, claims)."""
    rows, cols = tb["rows"], tb.get("columns", ["GM acc", "PM acc", "PM F1", "up B/round"])
    d = fig_dir / tb["id"]
    if rows:
        d.mkdir(parents=True, exist_ok=True)
    sub = [r for n in rows for r in runs if r[0] == n]  # in the table's row order
    sub_res = [by_run[r[:2]] for r in sub]
    results = {n: [by_run[r[:2]] for r in sub if r[0] == n] for n in rows}
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
    if tb.get("cold_start"):
        epochs = results[rows[0]][0]["cold_start"]["epochs"]
        md += ["Cold start (held-out clients: the final global adapters, then local epochs):", "",
               "| method | " + " | ".join(f"epoch {e}" for e in epochs) + " |", "|---|" + "---|" * len(epochs)]
        md += [f"| {lab(n)} | " + " | ".join(fmt(per_seed(results, n, f"cold-start e{e}"), "acc") for e in epochs)
               + " |" for n in rows]
        md += ["", f"![cold start]({rel}/{tb['id']}/{_cold_plot(tb, suite, results, d / 'cold_start.png', epochs)})", ""]
    if tb.get("plots"):
        shown = [(lab(r[0]), *r[1:]) for r in sub]  # plot legends show the labels
        pngs = C.write_plots(shown, d)
        if (cls := C.write_class_plot(shown, sub_res, d)):
            pngs.append(cls)
        md += [" ".join(f"![{p}]({rel}/{tb['id']}/{p})" for p in pngs), ""]
    if "sweep" in tb:
        md += [f"![sweep]({rel}/{tb['id']}/{_sweep_plot(tb, suite, results, d / 'sweep.png')})", ""]
    claims = []
    for cl in tb.get("claim", []):
        v, ev = verdict(cl, results, rows)
        claims.append((tb["title"], cl["text"], v, ev))
        md.append(f"- **{v}** — {cl['text']} *Measured:* {ev}")
    md.append("")
    return "\n".join(md), claims


def write_doc(suite: Suite, runs, res_list, doc: Path, meta: dict) -> Path:
    by_run = {r[:2]: res for r, res in zip(runs, res_list)}
    fig_dir = doc.with_suffix("")  # docs/results.md -> docs/results/
    rel = fig_dir.name
    sections, claims = [], []
    for tb in suite.tables:
        md, cl = table_section(tb, suite, runs, by_run, fig_dir, rel)
        sections.append(md)
        claims += cl
    counts = {k: sum(c[2] == k for c in claims) for k in ("held", "inconclusive", "did not hold", "could not be tested")}
    head = [
        "# Results: the two papers' experiments on the offline zoo", "",
        f"Generated by `{meta['command']}` at commit {meta['commit']} on {meta['date']}. "
        f"{meta['runs']} runs ({meta['executed']} run by this invocation, {meta['runs'] - meta['executed']} "
        f"found finished in {meta['out']}); this invocation took {meta['wall_min']:.1f} min with {meta['jobs']} "
        f"run(s) at once on {meta['machine']}. The runs' own times add up to {meta['compute_min']:.0f} min "
        f"(about {meta['compute_min'] / meta['jobs']:.0f} min from scratch at {meta['jobs']} at once). Every number below is read from the runs' results.json, "
        f"and the same command regenerates this page.", "",
        "**Substitute setting, not the papers' setting.** No image model weights or the papers' data sets "
        "can be obtained offline here, so both papers are reproduced on text classification with the "
        "offline zoo's real models; numbers are not comparable to the papers', only the direction of "
        "each claim is. Runs pair up by seed (same clients, same sampling stream) and personalized accuracy "
        "also by client; a claim *held* when the 95% paired bootstrap interval of the difference (seeds × "
        "clients for PM accuracy, seeds otherwise) lies on the claimed side of 0, *did not hold* when it "
        "lies on the other side, and is *inconclusive* when it contains 0.", "",
        "| | this page | the paper |", "|---|---|---|"]
    head += [f"| {g.get('title', k)} | {g.get('setting', '')} | {g.get('paper', '')} |" for k, g in suite.groups.items()]
    head += ["", f"**Claims:** {counts['held']} held, {counts['inconclusive']} inconclusive, "
                 f"{counts['did not hold']} did not hold, {counts['could not be tested']} could not be tested.", "",
             "| table | claim | verdict |", "|---|---|---|"]
    head += [f"| {t} | {c} | **{v}** |" for t, c, v, _ in claims]
    tuned = T.tuning_section(suite.tuned, {n: e.get("label", n) for n, e in suite.experiments.items()})
    conv = D.convergence_md(list(suite.experiments), runs, lambda n: f"{suite.experiments[n].get('label', n)} (`{n}`)")
    atomic_write_text(doc, "\n".join(head) + "\n\n" + (tuned + "\n" if tuned else "") + "\n".join(sections)
                      + "\n" + "\n".join(conv))
    return doc


def run_suite(path: Path, out: Path, doc: Path, seeds: int | None = None, jobs: int | None = None,
              quiet: bool = False, command: str = "") -> Path:
    suite = load_suite(path)
    if seeds:
        suite.seeds, suite.fixed = seeds, True
    tune_runs = T.plan_tuning(suite, out)
    plan_suite(suite, out)  # every config is validated before anything runs
    t0 = time.perf_counter()
    pending = sum(not (r[3] / "results.json").exists() for r in tune_runs)
    tune_res = C.run_all(tune_runs, quiet=quiet, jobs=jobs or suite.jobs)
    suite.tuned = T.apply_tuning(suite, tune_runs, tune_res, value)
    runs = plan_suite(suite, out)  # with the chosen values
    pending += sum(not (r[3] / "results.json").exists() for r in runs)
    res = C.run_all(runs, quiet=quiet, jobs=jobs or suite.jobs)
    meta = {"command": command or f"fedsplice results {path} --out {out} --doc {doc}", "commit": _git(),
            "date": time.strftime("%Y-%m-%d"), "runs": len(runs) + len(tune_runs), "executed": pending, "out": out,
            "wall_min": (time.perf_counter() - t0) / 60, "jobs": jobs or suite.jobs,
            "compute_min": sum(r.get("time_s", 0) for r in [*res, *tune_res]) / 60,
            "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), no GPU"}
    return write_doc(suite, runs, res, Path(doc), meta)
