"""data.record_format = "flowertune-<task>": a record's fields as FlowerTune makes prompt and response.

FlowerTune's apps (flwrlabs/flower, examples/flowertune-llm-*/*/dataset.py, `reformat`) rename the
data set's `output` to the response and build the instruction per task:

    general   `instruction` (its `input` column is not used)          flwrlabs/alpaca-gpt4
    finance   `instruction` + " " + `input`                           flwrlabs/fingpt-sentiment-train
    code      `instruction` + " " + `input`                           flwrlabs/code-alpaca-20k
    medical   `input` (the `instruction` column is dropped)            flwrlabs/medical-meadow-medical-flashcards

The text is kept exactly as the data set has it (no whitespace trimmed: an empty `input` leaves the
instruction's trailing space, as theirs does), so the rendered prompt is theirs to the character.
Each record is one user turn and its answer; `split`, `client` and other scalar fields are kept as
for any instruction record (fedsplice.data.instruct).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from fedsplice.data import instruct
from fedsplice.errors import ConfigError

TASKS = ("general", "finance", "medical", "code")
PREFIX = "flowertune-"
# the fields each task reads: (the instruction's, the one appended after a space, or None)
_PARTS = {"general": ("instruction", None), "finance": ("instruction", "input"),
          "code": ("instruction", "input"), "medical": ("input", None)}
_USED = ("instruction", "input", "output", "response", "image")


def _field(row: dict, key: str, where: str, task: str, empty_ok: bool = False) -> str:
    v = row.get(key)
    if v is None and empty_ok:  # a CSV's empty cell
        return ""
    if not isinstance(v, str):
        what = "missing" if v is None else f"a {type(v).__name__}, not text"
        raise ConfigError(f"{where}: `{key}` is {what}; data.record_format = '{PREFIX}{task}' reads "
                          f"{', '.join(k for k in _PARTS[task] if k)} and output")
    return v


def record(row, where: str, task: str) -> instruct.Instruction:
    """One row of a FlowerTune data set -> an Instruction (one user turn, the response)."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a record must be an object with fields, got {type(row).__name__}")
    main, extra = _PARTS[task]
    prompt = _field(row, main, where, task)
    if extra is not None:
        prompt = prompt + " " + _field(row, extra, where, task, empty_ok=True)
    response = _field(row, "output", where, task)
    if not response.strip():
        raise ConfigError(f"{where}: `output` is empty; the response is what the loss is on (FlowerTune's "
                          f"trainer would find no response token in it): drop the record")
    return instruct.Instruction([("user", prompt)], response, fields=instruct.other_fields(row, _USED))


def reader(record_format: str) -> Callable[[dict, str], instruct.Instruction]:
    """The function that makes a record of a row under data.record_format."""
    if record_format == "auto":
        return instruct.record
    return partial(record, task=record_format.removeprefix(PREFIX))


def check_single_turn(records) -> None:
    """model.prompt_template = "flowertune" renders one instruction and its answer: a record with a
    system turn or earlier turns has no place in it (one line naming how many there are)."""
    multi = sum(len(r.messages) > 1 for r in records)
    if multi:
        raise ConfigError(f"model.prompt_template = 'flowertune' renders one instruction and its answer, but "
                          f"{multi} of {len(records)} records have a system turn or earlier turns: give them "
                          f"as single turns, or set model.prompt_template = ''")
