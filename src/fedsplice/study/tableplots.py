"""The results page's per-table plots: a sweep's metrics against its x values, and the cold start
(`fedsplice.study.results` writes the page around them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedsplice.app import compare as C
from fedsplice.study.claims import per_seed


def sweep_plot(tb: dict, results, path: Path) -> str:
    """A sweep table's metrics against its x values, one line per series (mean ± std over seeds)."""
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
    return C.save_png(fig, path)


def cold_plot(tb: dict, experiments: dict[str, dict], results, path: Path, epochs: list[int]) -> str:
    """Held-out clients' accuracy against local epochs from the final global adapters, per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for n in tb["rows"]:
        v = [per_seed(results, n, f"cold-start e{e}") for e in epochs]
        ax.errorbar(epochs, [np.nanmean(a) for a in v], yerr=[np.nanstd(a) for a in v], marker="o", capsize=3,
                    label=experiments[n].get("label", n))
    ax.set_xlabel("local epochs on the new client (0 = the global adapters as received)")
    ax.set_ylabel("accuracy of held-out clients")
    ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]  # stubs: Locator
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return C.save_png(fig, path)
