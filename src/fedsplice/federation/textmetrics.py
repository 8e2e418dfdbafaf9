"""Scores of generated text against a reference, as the instruction-tuning field computes them.

  exact_match   1 when the two agree after SQuAD's normalization (lowercase, punctuation and the
                articles a/an/the removed, whitespace collapsed), else 0
  token_f1      SQuAD's token F1 over the normalized words (bags of words: a repeated word counts
                as often as it repeats on both sides)
  rouge_l       ROUGE-L F-measure, from Google's `rouge-score` (the implementation `evaluate`
                wraps); its tokenizer keeps [a-z0-9] runs only, so text in other scripts scores 0
  choice_letter the option letter a generated answer names (multiple choice, FlowerTune's parse)

Pure functions of strings; `rouge-score` is imported on first use (the `generate` extra).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache
from typing import TYPE_CHECKING

from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from rouge_score.rouge_scorer import RougeScorer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lowercase, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize(prediction) == normalize(reference))


def token_f1(prediction: str, reference: str) -> float:
    """Harmonic mean of word precision and recall after `normalize`; two empty texts agree (1.0),
    an empty one against a non-empty one scores 0 (SQuAD v2's rule)."""
    p, r = normalize(prediction).split(), normalize(reference).split()
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


@lru_cache(maxsize=1)
def _rouge() -> RougeScorer:
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ConfigError("model.task = 'generate' scores ROUGE-L with rouge-score: "
                          "pip install 'fedsplice[generate]'") from None
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    return float(_rouge().score(reference, prediction)["rougeL"].fmeasure)


LETTERS = string.ascii_uppercase


def choice_letter(text: str, n_options: int) -> int | None:
    """The option a generated answer picks, as an index (None: it names none), parsed as FlowerTune's
    evaluation parses it (flwrlabs/flower benchmarks/flowertune-llm/evaluation, `format_answer`):
    lowercase, cut at the first "\\n##", every character outside [a-z0-9] a space, then the first
    character, which must be one of the options' letters. We strip leading spaces first (a model
    that answers " B" picked B). So "B. blue" and "b" pick B, and so does "because ..." : the score
    measures format compliance as much as knowledge, which is why the log-likelihood choice is
    reported beside it."""
    out = re.sub(r"[^a-z0-9]", " ", text.lower().split("\n##")[0]).strip()
    first = out[:1].upper()
    return LETTERS.index(first) if first and first in LETTERS[:n_options] else None


def scores(prediction: str, reference: str) -> dict[str, float]:
    """The three free-text scores of one answer."""
    return {"exact_match": exact_match(prediction, reference), "token_f1": token_f1(prediction, reference),
            "rouge_l": rouge_l(prediction, reference)}
