"""A run's curves from its metrics.jsonl, and the signs that its training went wrong.

`history(run_dir)` reads the evaluation rounds (round 0 and every `eval.every`, with their
"gm"/"pm" dicts) and the per-round training losses. A round logged twice (a resumed run
that re-ran it; FedPuReL's personalization line, which repeats the last round with its PM after
phase 2) is merged field by field, the last line winning: the phase line's gm/pm replace the
round's, its train_loss stays. Rounds without a train_loss (round 0, phase lines) have none.

The checks return a one-line reason with the numbers, or None:
- `loss_rose`: the training loss ends above its start. A round trains a few clients, so the
  per-round loss is noisy: start and end are the means of the first and the last k rounds that
  logged a loss, k = 3, or len // 2 when there are fewer than 6 (the two windows never overlap;
  under 2 rounds there is nothing to compare). A NaN at the end counts as a rise.
- `fell_at_end`: a metric's curve is lower at its last evaluation than at the one before.
- `diverged`: over the seeds of a row, the loss rule on the mean loss over seeds, or a rise and
  then a fall on *every* seed (above its first evaluation at some evaluation, then a fall at the
  last one, which leaves it below its own peak).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedsplice.app import compare as C

WINDOW = 3  # rounds averaged at each end of the loss curve
MODELS = ("gm", "pm")  # the evaluation dicts of a metrics.jsonl line


@dataclasses.dataclass(frozen=True)
class History:
    """One run's metrics.jsonl: `rounds[i]` was evaluated with `evals[i]` ({"gm": {...},
    "pm": {...}}, whichever it logged), in round order; `losses` is (round, train_loss) of every
    round that logged one, in round order."""

    rounds: tuple[int, ...]
    evals: tuple[dict[str, dict[str, Any]], ...]
    losses: tuple[tuple[int, float], ...]


def history(run_dir: Path) -> History | None:
    """The run's History; None when it has no metrics.jsonl. Blank lines and a line that is not
    JSON (a run killed while writing) are skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    by_round: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("round"), int):
            by_round.setdefault(rec["round"], {}).update(rec)  # the last line wins, field by field
    order = sorted(by_round)
    evals = [(t, {m: by_round[t][m] for m in MODELS if isinstance(by_round[t].get(m), dict)}) for t in order]
    evals = [(t, e) for t, e in evals if e]
    losses = tuple((t, float(by_round[t]["train_loss"])) for t in order if _number(by_round[t].get("train_loss")))
    return History(tuple(t for t, _ in evals), tuple(e for _, e in evals), losses)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def curve(h: History, metric: str) -> list[tuple[int, float]]:
    """(round, value) of a column such as "PM acc" (`compare.METRICS`) at each evaluation that
    reports it; [] for a column the evaluations do not hold (bytes, parameters)."""
    path = dict(C.METRICS).get(metric)
    if path is None:
        return []
    return [(t, v) for t, e in zip(h.rounds, h.evals) if (v := C.metric_at(e, path)) is not None]


def mean_curve(histories: Sequence[History], metric: str) -> list[tuple[int, float]]:
    """The curve's mean over runs at each evaluated round (over the runs that report it there)."""
    return _mean([curve(h, metric) for h in histories])


def mean_losses(histories: Sequence[History]) -> list[tuple[int, float]]:
    """The training loss's mean over runs at each round (over the runs that logged it there)."""
    return _mean([list(h.losses) for h in histories])


def _mean(series: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    at: dict[int, list[float]] = {}
    for s in series:
        for t, v in s:
            at.setdefault(t, []).append(v)
    return [(t, math.fsum(at[t]) / len(at[t])) for t in sorted(at)]


def loss_ends(losses: Sequence[float]) -> tuple[float, float, int] | None:
    """(start, end, k): the means of the first and the last k losses (k = 3, or len // 2 when
    there are fewer than 6); None under 2 losses."""
    k = min(WINDOW, len(losses) // 2)
    if k == 0:
        return None
    return math.fsum(losses[:k]) / k, math.fsum(losses[-k:]) / k, k


def rose(ends: tuple[float, float, int] | None) -> bool:
    """Whether the loss ends above its start (a NaN end counts as above)."""
    return ends is not None and (math.isnan(ends[1]) or ends[1] > ends[0])


def pair(a: float, b: float, digits: int = 3) -> str:
    """"a → b" with the digits (from `digits`, up to 6) that tell them apart."""
    while digits < 6 and f"{a:.{digits}f}" == f"{b:.{digits}f}" and a != b:
        digits += 1
    return f"{a:.{digits}f} → {b:.{digits}f}"


def loss_rose(h: History) -> str | None:
    """A reason when the training loss ends above its start: the mean of the last k rounds'
    losses above the mean of the first k (k = 3, or half the rounds, rounded down, under 6)."""
    ends = loss_ends([v for _, v in h.losses])
    if not rose(ends):
        return None
    assert ends is not None
    return f"training loss {pair(ends[0], ends[1], 2)} ({_window(ends[2])})"


def last_fall(points: Sequence[tuple[int, float]], tol: float = 0.0) -> tuple[float, float] | None:
    """(the one before, the last) where a curve's last point is more than `tol` below the one
    before it; None otherwise or with fewer than 2 points."""
    if len(points) < 2 or not points[-1][1] < points[-2][1] - tol:
        return None
    return points[-2][1], points[-1][1]


def fell(points: Sequence[tuple[int, float]], metric: str) -> str | None:
    """A reason when a curve is lower at its last point than at the one before."""
    if (drop := last_fall(points)) is None:
        return None
    return f"{metric} fell {pair(*drop)} (round {points[-2][0]} → {points[-1][0]})"


def fell_at_end(h: History, metric: str) -> str | None:
    """A reason when the metric's curve falls between its last two evaluations."""
    return fell(curve(h, metric), metric)


def _seeds(n: int) -> str:
    return f"{n} seed{'' if n == 1 else 's'}"


def _window(k: int) -> str:
    return "mean of first/last round" if k == 1 else f"mean of first/last {k} rounds"


def diverged(histories: list[History], metric: str) -> str | None:
    """A reason when a row (one History per seed) diverged: its training loss, averaged over
    seeds at each round, ends above its start (the `loss_rose` rule); or on every seed the
    metric rose above its first (round 0) evaluation and fell at the last evaluation, ending
    below its peak. Both reasons, "; "-joined, when both hold; None when neither does."""
    if not histories:
        return None
    reasons = []
    ends = loss_ends([v for _, v in mean_losses(histories)])
    if rose(ends):
        assert ends is not None
        reasons.append(f"training loss {pair(ends[0], ends[1], 2)} ({_window(ends[2])}, mean over "
                       f"{_seeds(len(histories))})")
    curves = [[v for _, v in curve(h, metric)] for h in histories]
    if all(len(c) >= 3 and max(c) > c[0] and c[-1] < c[-2] for c in curves):
        first, peak, last = (math.fsum(x) / len(curves) for x in zip(*((c[0], max(c), c[-1]) for c in curves)))
        at = sorted({t for h in histories for t, _ in curve(h, metric)[-1:]})
        reasons.append(f"{metric} rose then fell at the last evaluation on every seed: {first:.3f} at the first, "
                       f"peak {peak:.3f}, last {last:.3f} (round {', '.join(map(str, at))}; means over "
                       f"{_seeds(len(histories))})")
    return "; ".join(reasons) or None
