"""Training statistics of a results-suite table, read from its runs' metrics.jsonl.

A table's `diagnostics = ["orthogonality_raw", ...]` lists per-round training statistics (the
round records' keys: loss terms, purification rates, PFAdapter's gradient ratios); each cell
is the mean over a run's training rounds, then mean ± std over seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedsplice.app.compare import save_png


def records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records ([] when it has none)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_means(run_dir: Path, keys: list[str]) -> dict[str, float]:
    """Each key's mean over the run's training rounds (NaN where no round has it)."""
    recs = records(run_dir)
    return {k: float(np.mean(v)) if (v := [r[k] for r in recs if isinstance(r.get(k), (int, float))]) else np.nan
            for k in keys}


def diagnostics_md(keys: list[str], rows: list[str], runs: list[tuple], label) -> list[str]:
    """Markdown lines of a table of `keys` by row (runs: (name, seed, cfg, dir) as planned)."""
    md = ["Training diagnostics (mean over training rounds, then mean ± std over seeds; "
          "from metrics.jsonl):", "", "| method | " + " | ".join(f"`{k}`" for k in keys) + " |",
          "|---|" + "---|" * len(keys)]
    for n in rows:
        vals = [run_means(r[3], keys) for r in runs if r[0] == n]
        cells = []
        for k in keys:
            v = np.array([x[k] for x in vals], dtype=float)
            cells.append("—" if np.isnan(v).all() else f"{np.nanmean(v):.3g} ± {np.nanstd(v):.2g}")
        md.append(f"| {label(n)} | " + " | ".join(cells) + " |")
    return md + [""]


def eval_curve(recs: list[dict], model: str) -> dict[int, float]:
    """{round: accuracy} of a run's evaluations of `model` ("gm" or "pm") during the rounds."""
    return {r["round"]: r[model]["accuracy"] for r in recs
            if isinstance(r.get(model), dict) and isinstance(r[model].get("accuracy"), (int, float))}


def convergence_md(names: list[str], runs: list[tuple], label) -> list[str]:
    """Markdown lines: each experiment's GM and PM accuracy at its last evaluation during the
    rounds, and the change since the evaluation before (per seed, then mean ± std over seeds):
    a curve has flattened where that change is small against the spread over seeds."""
    md = ["## Convergence: the last evaluations of every run", "",
          "Accuracy at the last evaluation of the rounds and its change since the evaluation before "
          "(per seed, then mean ± std over seeds; from metrics.jsonl, so FedPuReL's PM here is before "
          "its phase 2). A change near 0 against the std says the curve has flattened.", "",
          "| experiment | rounds | GM acc | Δ GM | PM acc | Δ PM |", "|---|---|---|---|---|---|"]
    for n in names:
        cells, span = [], ""
        recs = [records(r[3]) for r in runs if r[0] == n]  # each run's file read once
        for model in ("gm", "pm"):
            last, delta = [], []
            for rec in recs:
                c = eval_curve(rec, model)
                if len(c) >= 2:
                    a, b = sorted(c)[-2:]
                    last.append(c[b])
                    delta.append(c[b] - c[a])
                    span = f"{a} → {b}"
            cells += ([f"{np.mean(last):.3f} ± {np.std(last):.3f}", f"{np.mean(delta):+.3f} ± {np.std(delta):.3f}"]
                      if last else ["—", "—"])
        md.append(f"| {label(n)} | {span or '—'} | " + " | ".join(cells) + " |")
    return md + [""]


def curves_plot(keys: list[str], rows: list[str], runs: list[tuple], label, path: Path) -> str:
    """One panel per key: its per-round value (mean over seeds) for every row that logs it, e.g.
    FedPuReL's cos(g_task, g_align), purified fraction and ‖g̃‖/‖g‖. Returns the file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), dpi=110, squeeze=False)
    for ax, k in zip(axes[0], keys):
        for n in rows:
            per = [{r["round"]: r[k] for r in records(x[3]) if isinstance(r.get(k), (int, float))}
                   for x in runs if x[0] == n]
            rounds = sorted(set().union(*per)) if per else []
            if rounds:
                ax.plot(rounds, [np.mean([p[t] for p in per if t in p]) for t in rounds], marker=".", label=label(n))
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_png(fig, Path(path))
