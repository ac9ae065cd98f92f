"""ROUGE as a torchmetrics ``Metric`` over the ``rouge-score`` package.

torchmetrics' own ROUGE fetches NLTK data at run time, which fails offline; ``rouge-score`` (Google's
reimplementation of ROUGE-1.5.5) needs nothing beyond the package. Wrapping it in a ``Metric`` keeps
the accumulation across batches and the sum over DDP ranks to torchmetrics.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib.metadata import version

import torch
from sacrebleu.metrics import BLEU
from torchmetrics import Metric

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> str:
    """One sentence per line, as ``rougeLsum`` expects (it splits summaries on newlines)."""
    return "\n".join(s for s in _SENTENCE_END.split(text.strip()) if s)


class Rouge(Metric):
    """Mean ROUGE-1/2/L/Lsum F-measure over all (prediction, reference) pairs seen.

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

    def update(self, predictions: Sequence[str], references: Sequence[str]) -> None:
        for prediction, reference in zip(predictions, references, strict=True):
            scores = self.scorer.score(split_sentences(reference), split_sentences(prediction))
            for key in ROUGE_KEYS:
                setattr(self, key, getattr(self, key) + scores[key].fmeasure)
        self.count += len(predictions)

    def compute(self) -> dict[str, torch.Tensor]:
        count = self.count.clamp(min=1)
        return {key: (getattr(self, key) / count).float() for key in ROUGE_KEYS}

    @property
    def signature(self) -> str:
        """How the scores were computed, to print beside them as sacreBLEU's signature is printed beside BLEU."""
        stemmer = "Porter stemmer" if self.use_stemmer else "no stemmer"
        return f"rouge-score {version('rouge-score')}, mean F1, {stemmer}, Lsum over sentences split at .!?"


def bleu_signature(tokenize: str, lowercase: bool = False) -> str:
    """sacreBLEU's signature of torchmetrics' ``SacreBLEUScore(tokenize, lowercase)`` with one reference and
    no smoothing (its default), so a reported score says how it was computed."""
    bleu = BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method="none", references=[[""]])
    return str(bleu.get_signature())
