"""`fedsplice leaderboard RUN [--benchmark NAME]`: a run as a row of the FlowerTune LLM leaderboard.

flower.ai/benchmarks/llm-leaderboard has one table per challenge, its columns Rank, Team, Code,
Base Model, Comm. Costs, Average (↑), the challenge's benchmarks, Date. A run fills the columns a
run can: Base Model (model.name's last part), Comm. Costs (the run's traffic as FlowerTune's
tracker counts it: every tensor as `np.save` writes it, to each client asked and back from each
one accepted, fedsplice.federation.flowertune; GiB, which the leaderboard prints as "GB"), Date
(when results.json was written). Rank, Team and Code belong to a submission.

The benchmarks are separate data sets scored by FlowerTune's own evaluation
(benchmarks/flowertune-llm/evaluation/<challenge>): a cell stays "—" with a footnote unless the
run's global test set IS that benchmark, which `--benchmark NAME` declares; the cell is then GM's
`choice_parsed` (the option letter parsed from the greedy answer, as their evaluation parses it),
in percent. Code's pass@1 needs the generated programs run against tests: never filled.
Average (↑) is the mean of the benchmark cells when all are filled.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from fedsplice.errors import ConfigError
from fedsplice.federation import ledger
from fedsplice.federation.flowertune import GIB, MIB, run_bytes
from fedsplice.federation.validate import load_run_config

BOARDS = {"general": ("General NLP", "general-nlp", ("STEM", "Social Sciences", "Humanities")),
          "finance": ("Finance", "finance", ("FPB", "FIQA", "TFNS")),
          "medical": ("Medical", "medical", ("PubMedQA", "MedMCQA", "MedQA", "CareQA")),
          "code": ("Code", "code", ("MBPP", "HumanEval", "MultiPL-E (JS)", "MultiPL-E (C++)"))}
DASH = "—"


def _run_files(run: Path):
    """(config, results.json, metrics.jsonl records, the server's ledger rows) of a finished run."""
    if not (run / "results.json").is_file():
        raise ConfigError(f"{run}: no results.json; give the --out of a finished `fedsplice run`")
    cfg = load_run_config(run / "config.toml")
    results = json.loads((run / "results.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    server = run / "ledger" / ledger.SERVER
    rows = ledger.read(server) if server.is_file() else []
    return cfg, results, records, rows


def _benchmark_cell(task: str, benchmark: str, gm: dict) -> str:
    title, _, names = BOARDS[task]
    if benchmark not in names:
        raise ConfigError(f"--benchmark {benchmark!r}: the {title} leaderboard's benchmarks are {', '.join(names)}")
    if task == "code":
        raise ConfigError(f"--benchmark {benchmark!r}: pass@1 runs the generated programs against the benchmark's "
                          f"tests, which fedsplice does not do; the cell stays {DASH}")
    acc = gm.get("choice_parsed")
    if not isinstance(acc, (int, float)) or not math.isfinite(acc):
        raise ConfigError(f"--benchmark {benchmark!r}: the run's global test set has no multiple-choice records "
                          f"(no choice_parsed score), so it is not that benchmark")
    return f"{100 * acc:.2f}"


def leaderboard_row(run: Path, benchmark: str | None = None) -> dict:
    """{"board", "columns": {column: cell}, "notes": [footnote], "up_mib", "down_mib", "gib"} of
    the run in `run` (module docstring)."""
    run = Path(run)
    cfg, results, records, rows = _run_files(run)
    task = cfg.data.record_format.removeprefix("flowertune-")
    if task not in BOARDS:
        raise ConfigError(f"{run}: data.record_format = {cfg.data.record_format!r} names no FlowerTune challenge; "
                          f"a leaderboard row is for runs of configs/flowertune-*.toml (flowertune-<task>)")
    if cfg.privacy.secure_aggregation:
        raise ConfigError(f"{run}: under secure aggregation the server holds masked vectors, not the tensors "
                          f"FlowerTune's tracker counts")
    if not rows:
        raise ConfigError(f"{run}: its ledger has no accepted upload, so the tensors sent are unknown")
    up, down = run_bytes(rows, records, cfg.server.clients_per_round)
    title, folder, names = BOARDS[task]
    cells = dict.fromkeys(names, DASH)
    if benchmark is not None:
        cells[benchmark] = _benchmark_cell(task, benchmark, results["gm"])
    filled = [float(c) for c in cells.values() if c != DASH]
    when = time.strftime("%d.%m.%y", time.localtime((run / "results.json").stat().st_mtime))
    columns = {"Base Model": cfg.model.name.rstrip("/").split("/")[-1], "Comm. Costs": f"{(up + down) / GIB:.1f} GB",
               "Average (↑)": f"{sum(filled) / len(filled):.2f}" if len(filled) == len(names) else DASH,
               **cells, "Date": when}
    gm, n = results["gm"], results["gm"].get("test_size", "?")
    notes = [f"Comm. Costs: {(up + down) / MIB:,.2f} MiB = {up / MIB:,.2f} up + {down / MIB:,.2f} down over "
             f"{results['rounds']} rounds of {cfg.server.clients_per_round} clients, every tensor counted as "
             f"np.save writes it (FlowerTune's tracker); the leaderboard's GB are GiB",
             f"{DASH}: not measured. The leaderboard scores {', '.join(n_ for n_ in names if cells[n_] == DASH)} "
             f"on their own data sets with FlowerTune's evaluation (benchmarks/flowertune-llm/evaluation/{folder}); "
             f"this run's global test set is {n} records of {cfg.data.dataset}: GM response loss "
             f"{gm.get('response_loss', float('nan')):.3f}, ROUGE-L {gm.get('rouge_l', float('nan')):.3f}"]
    if benchmark:
        notes.append(f"{benchmark}: GM on the run's global test set ({n} records, declared to be {benchmark} by "
                     f"--benchmark), the option letter parsed from its greedy answer (choice_parsed), in percent")
    return {"board": title, "columns": columns, "notes": notes, "up_mib": up / MIB, "down_mib": down / MIB,
            "gib": (up + down) / GIB}


def markdown(row: dict) -> str:
    """The row under its header, as the leaderboard's table, then its footnotes."""
    cols = list(row["columns"])
    lines = [f"FlowerTune LLM leaderboard, {row['board']}:", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols), "| " + " | ".join(row["columns"][c] for c in cols) + " |", ""]
    return "\n".join(lines + [f"{i}. {note}" for i, note in enumerate(row["notes"], 1)])
