"""Training statistics of a results-suite table, read from its runs' metrics.jsonl.

A table's `diagnostics = ["orthogonality_raw", ...]` lists per-round training statistics (the
round records' keys: loss terms, purification rates, PFAdapter's gradient ratios); each cell
is the mean over a run's training rounds, then mean ± std over seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def run_means(run_dir: Path, keys: list[str]) -> dict[str, float]:
    """Each key's mean over the run's training rounds (NaN where no round has it)."""
    path = Path(run_dir) / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
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
