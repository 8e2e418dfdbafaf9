"""model.task = "generate": the scores of free-text answers, for one client, over clients (PM) and
on the global test set (GM), as the instruction-tuning field reports them (docs/instruct.md).

  response_loss   the mean -log p of the reference responses' tokens given their prompts (the
                  training loss on held-out records), and its perplexity exp(loss)
  exact_match, token_f1, rouge_l   the greedy answer (at most eval.max_new_tokens, stopped at EOS
                  or before the first of eval.stop)
                  against the reference response (`fedsplice.federation.textmetrics`), mean over records
  choice_loglik, choice_parsed     multiple-choice records only: right when the right option has the
                  highest log-likelihood, and when the greedy answer's letter (FlowerTune's parse)
                  names it; None without such records
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from fedsplice.errors import ConfigError
from fedsplice.federation.textmetrics import choice_letter
from fedsplice.federation.textmetrics import scores as text_scores
from fedsplice.model.generate import encode

if TYPE_CHECKING:
    from fedsplice.algorithms import Recipe
    from fedsplice.algorithms.hooks import Around, Scores
    from fedsplice.config import ExperimentConfig
    from fedsplice.data.datasets import TextDataset
    from fedsplice.data.instruct import Instruction
    from fedsplice.federation.metrics import Metrics
    from fedsplice.model.taskmodel import TaskModel

SCORES = ("response_loss", "perplexity", "exact_match", "token_f1", "rouge_l", "choice_loglik", "choice_parsed")


class Scoring(Protocol):
    """What the scores read of an Experiment (federation.experiment imports this module)."""

    cfg: ExperimentConfig
    model: TaskModel


def check_recipe(cfg: ExperimentConfig, recipe: Recipe) -> None:
    """A method that needs class logits (an objective of its own, a local stage of its own, the
    a prior reference) is refused with model.task = "generate", in one line. A
    method's PM (`Personal.predict`: FedDPA, HetLoRA, FLoRA) runs: its test_logits are scores here."""
    stage = recipe.personalize
    needs = [what for what, on in (("an objective of its own", recipe.objective is not None),
                                   ("a local stage on class logits", stage is not None and (
                                       stage.fit is not None or stage.after is not None)),
                                   ("a class prior (a reference row)", bool(recipe.prior))) if on]
    if needs:
        raise ConfigError(f"algorithm {cfg.algorithm!r} needs {'; '.join(needs)}, which model.task = 'generate' "
                          f"does not run yet; use pfadapter, lora (and the server optimizers), fedsa-lora, pfedlora, "
                          f"feddpa, hetlora, flora, local, centralized or zeroshot")


def check_images(cfg: ExperimentConfig, data: TextDataset) -> None:
    """Records with an image need model.vision (their tokens go before the prompt), and a vision
    tower with no image to read does nothing: either is one line, before any weights load."""
    n = sum(getattr(r, "has_image", False) for r in (*data.train_texts, *data.test_texts))
    if n and not cfg.model.vision:
        raise ConfigError(f"{n} records have an `image`, which needs a vision tower: set model.vision (e.g. "
                          f"'zoo:tiny-vit' or a CLIP/SigLIP checkpoint), or drop the images")
    if cfg.model.vision and not n:
        raise ConfigError(f"model.vision = {cfg.model.vision!r} does nothing: no record has an `image`; give the "
                          f"records images or remove model.vision")


def length_warnings_of(cfg: ExperimentConfig, model: TaskModel, data: TextDataset) -> list[str]:
    """A line counting the records longer than model.max_length (their prompts are cut from the
    left to fit: `fedsplice.model.generate.fit`), in training and in the test sets."""
    tok, mc = model.tokenizer, cfg.model
    long = {name: sum(len(encode(tok, cast("Instruction", r), mc.chat_template)) > mc.max_length for r in recs)
            for name, recs in (("training", data.train_texts), ("test", data.test_texts))}
    if not any(long.values()):
        return []
    return [f"{long['training']} training and {long['test']} test records are longer than model.max_length = "
            f"{mc.max_length} tokens: their prompts are cut from the left to fit (an answer longer than that "
            f"keeps its start); raise model.max_length to keep them whole"]


# items: instruction records (data.instruct.Instruction); groups: [(around, positions)]
def answers(exp: Scoring, items: list[str], groups: Sequence[tuple[Around, np.ndarray]] | None = None
            ) -> dict[str, list[Any]]:
    """`TaskModel.answers` of the model as loaded on `items`; with `groups` ([(around, positions)],
    ClientOps.test_logits'), each group's records under its own change to the model, in order."""
    e = exp.cfg.eval
    if groups is None:
        return exp.model.answers(items, e.batch_size, e.max_new_tokens, e.stop)
    out: dict[str, list[Any]] = {k: [None] * len(items) for k in ("nll", "tokens", "text", "options")}
    for around, members in groups:
        with around(exp.model):
            got = exp.model.answers([items[i] for i in members], e.batch_size, e.max_new_tokens, e.stop)
        for k, vals in got.items():
            for i, v in zip(members, vals):
                out[k][i] = v
    return out


def scores(exp: Scoring, items: list[str], groups: Sequence[tuple[Around, np.ndarray]] | None = None) -> Scores:
    """The scores of the model as loaded on instruction records `items` (`groups`: as in `answers`,
    a method's per-record change to the model, FedDPA's adapter mix)."""
    got = answers(exp, items, groups)
    tokens = int(sum(got["tokens"]))
    loss = float(sum(got["nll"]) / tokens) if tokens else float("nan")
    recs = cast("list[Instruction]", items)
    per = [text_scores(a, r.response) for a, r in zip(got["text"], recs)]
    out: dict[str, float | int | None] = {
        "response_loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        **{k: float(np.mean([p[k] for p in per])) if per else float("nan")
           for k in ("exact_match", "token_f1", "rouge_l")},
        "test_size": len(items), "response_tokens": tokens}
    choice = [(r, a, o) for r, a, o in zip(recs, got["text"], got["options"]) if o is not None]
    out["choice_n"] = len(choice)
    out["choice_loglik"] = float(np.mean([int(np.argmax(o)) == r.answer for r, _, o in choice])) if choice else None
    out["choice_parsed"] = (float(np.mean([choice_letter(a, len(r.options)) == r.answer for r, a, _ in choice]))
                            if choice else None)
    return out


def summarize(per_client: list[Metrics]) -> Metrics:
    """PM: each score's mean over ALL clients (a client without multiple-choice records leaves the
    choice scores' means), and per client, in order, for paired comparisons across methods."""
    out: Metrics = {}
    for k in (*SCORES, "test_size", "response_tokens"):
        vals = [m[k] for m in per_client if m.get(k) is not None]
        out[k] = float(np.mean(vals)) if vals else None
    for k in ("response_loss", "rouge_l"):
        out[f"client_{k}"] = [m[k] for m in per_client]
    return out
