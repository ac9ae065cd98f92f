"""ROUGE and chrF as torchmetrics ``Metric``s over the ``rouge-score`` and ``sacrebleu`` packages.

torchmetrics' own ROUGE fetches NLTK data at run time, which fails offline; ``rouge-score`` (Google's
reimplementation of ROUGE-1.5.5) needs nothing beyond the package. torchmetrics' ``CHRFScore`` scores otherwise
than sacreBLEU's ``CHRF``, the one papers report, so chrF sums sacreBLEU's own statistics. Wrapping both in a
``Metric`` keeps the accumulation across batches and the sum over DDP ranks to torchmetrics.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from typing import Any

import torch
from sacrebleu.metrics import BLEU, CHRF
from torchmetrics import Metric

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
GEOMETRIC_MEAN = "rougeGM"  # SCROLLS's single figure per data set: the geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L
LABELS = {
    "rouge1": "ROUGE-1",
    "rouge2": "ROUGE-2",
    "rougeL": "ROUGE-L",
    "rougeLsum": "ROUGE-Lsum",
    GEOMETRIC_MEAN: "GM",
}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> str:
    """One sentence per line, as ``rougeLsum`` expects (it splits summaries on newlines)."""
    return "\n".join(s for s in _SENTENCE_END.split(text.strip()) if s)


def geometric_mean(scores: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L (each a corpus mean), SCROLLS's score for a data set."""
    return (scores["rouge1"] * scores["rouge2"] * scores["rougeL"]) ** (1 / 3)


def lead(document: str, words: int) -> str:
    """The Lead baseline: the document's first ``words`` words."""
    return " ".join(document.split()[:words])


def naive(document: str, ratio: float) -> str:
    """SCROLLS's naive baseline: the input's first ``ratio * len(input)`` characters, where SCROLLS sets ``ratio`` to
    the training set's mean summary-to-input length ratio in characters."""
    return document[: int(ratio * len(document))]


class Rouge(Metric):
    """Mean over documents of the ROUGE-1/2/L/Lsum F-measure against each document's best-matching reference.

    With several references per document (SQuALITY has four), each ROUGE variant takes the highest F-measure over
    the references, as SQuALITY's ``multi_rouge`` does; with one it is plain ROUGE.

    Args:
        use_stemmer: Porter-stem tokens before matching, as ROUGE-1.5.5's ``-m``.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, use_stemmer: bool = True) -> None:
        super().__init__()
        self.use_stemmer = use_stemmer
        from rouge_score import rouge_scorer  # here, not at the top: it imports NLTK (slow), which translation skips

        self.scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=use_stemmer)
        for key in ROUGE_KEYS:
            self.add_state(key, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, predictions: Sequence[str], references: Sequence[str | Sequence[str]]) -> None:
        """Scores each prediction against its reference, or its best-matching one of a sequence of references."""
        for prediction, options in zip(predictions, references, strict=True):
            options = [options] if isinstance(options, str) else options
            if not options:
                raise ValueError("a prediction has no reference to score against")
            scores = [self.scorer.score(split_sentences(r), split_sentences(prediction)) for r in options]
            for key in ROUGE_KEYS:
                setattr(self, key, getattr(self, key) + max(score[key].fmeasure for score in scores))
        self.count += len(predictions)

    def compute(self) -> dict[str, torch.Tensor]:
        count = self.count.clamp(min=1)
        return {key: (getattr(self, key) / count).float() for key in ROUGE_KEYS}

    @property
    def signature(self) -> str:
        """How the scores were computed, to print beside them as sacreBLEU's signature is printed beside BLEU."""
        stemmer = "Porter stemmer" if self.use_stemmer else "no stemmer"
        return (
            f"rouge-score {version('rouge-score')}, mean F1, {stemmer}, each document's best reference (max, as "
            "SQuALITY), Lsum over sentences split at .!?, GM = (R1*R2*RL)^(1/3) as SCROLLS"
        )


def baseline_labels(lead_words: int, naive_ratio: float | None) -> dict[str, str]:
    """The printed names of the baselines by their metric prefix: Lead, and naive when it has a ratio."""
    labels = {"lead_": f"Lead-{lead_words} baseline"}
    if naive_ratio is not None:
        labels["naive_"] = f"naive baseline (SCROLLS: the input's first {100 * naive_ratio:.2f}% of characters)"
    return labels


def rouge_line(label: str, logged: Mapping[str, Any], prefix: str) -> str | None:
    """``label: ROUGE-1 .. ROUGE-2 .. ROUGE-L .. ROUGE-Lsum .. GM ..`` from the scores ``logged`` as ``{prefix}rouge1``
    and so on (0-100); None when none of them was logged."""
    names = [name for name in LABELS if f"{prefix}{name}" in logged]
    if not names:
        return None
    return f"{label}: " + "  ".join(f"{LABELS[name]} {float(logged[prefix + name]):.2f}" for name in names)


def bleu_signature(tokenize: str, lowercase: bool = False) -> str:
    """sacreBLEU's signature of torchmetrics' ``SacreBLEUScore(tokenize, lowercase)`` with one reference and
    no smoothing (its default), so a reported score says how it was computed."""
    bleu = BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method="none", references=[[""]])
    return str(bleu.get_signature())


class ChrF(Metric):
    """sacreBLEU's corpus chrF (``CHRF()``: character 6-grams, beta 2, one reference), as a fraction of 1.

    The character n-gram statistics of every (prediction, reference) pair are summed, here and over ranks, and
    scored once, as ``sacrebleu.corpus_chrf`` scores a corpus.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self) -> None:
        super().__init__()
        self.chrf = CHRF()
        size = 3 * (self.chrf.char_order + self.chrf.word_order)  # hypothesis, reference and match counts per order
        self.add_state("stats", default=torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, predictions: Sequence[str], references: Sequence[str]) -> None:
        rows = self.chrf._extract_corpus_statistics(list(predictions), [list(references)])
        if rows:
            self.stats += torch.tensor(rows, dtype=torch.float64).sum(0)

    def compute(self) -> torch.Tensor:
        counts = [int(count) for count in self.stats.round().long().tolist()]
        return torch.tensor(self.chrf._compute_score_from_stats(counts).score / 100, dtype=torch.float64)


def chrf_signature() -> str:
    """sacreBLEU's signature of :class:`ChrF`, printed beside its score."""
    return str(CHRF(references=[[""]]).get_signature())
