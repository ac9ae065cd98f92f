"""Long documents: window chunking, hierarchical summarization, the Lead baseline, the 32k config, S x S-free steps."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from rouge_score import rouge_scorer
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_handle
from torch_handle.callbacks.prediction_writer import PredictionWriter
from torch_handle.data import EOS_ID, PAD_ID, Seq2SeqDataModule, SummarizationDataModule, Tokenizer
from torch_handle.data.tokenizer import Specials
from torch_handle.hierarchical import chunk_spans, summarize
from torch_handle.lightning_cli import TorchHandleCLI
from torch_handle.metrics import ROUGE_KEYS, Rouge, split_sentences
from torch_handle.model import ConfigError, Transformer, generate
from torch_handle.model.logits import DecodingControls
from torch_handle.module import Seq2SeqModule

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[1]
QMSUM = ROOT.parent / "shared" / "data" / "qmsum" / "val.jsonl"
needs_qmsum = pytest.mark.skipif(not QMSUM.is_file(), reason=f"real data not found at {QMSUM}")


# --- chunking ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "max_tokens", "overlap"),
    [(0, 8, 2), (5, 8, 2), (8, 8, 2), (9, 8, 2), (100, 8, 0), (100, 8, 7), (1000, 64, 16), (1001, 64, 16)],
)
def test_chunks_cover_every_token_within_the_limit_with_the_exact_overlap(
    length: int, max_tokens: int, overlap: int
) -> None:
    spans = chunk_spans(length, max_tokens, overlap)
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(0 < end - start <= max_tokens for start, end in spans if length)
    assert sorted({i for start, end in spans for i in range(start, end)}) == list(range(length))
    for (start, end), (next_start, next_end) in zip(spans, spans[1:]):
        assert end - next_start == overlap, "neighbours share exactly `overlap` tokens"
        assert next_start > start and next_end > end, "every window moves on"
    assert len(spans) == max(1, -(-(length - overlap) // (max_tokens - overlap)))  # no window is superfluous


@pytest.mark.parametrize(("max_tokens", "overlap"), [(8, 8), (8, -1), (0, 0)])
def test_chunking_rejects_windows_that_cannot_advance(max_tokens: int, overlap: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        chunk_spans(10, max_tokens, overlap)


# --- recursion, with a scripted model and a word-per-id tokenizer --------------------------------------------


class _WordTokenizer:
    """Token ids written as words, so every level's length is known exactly."""

    specials = Specials()

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]

    def decode_batch(self, rows: list[list[int]]) -> list[str]:
        return [" ".join(str(i) for i in row if i not in (PAD_ID, EOS_ID)) for row in rows]


class _ScriptedSummarizer(nn.Module):
    """Summarizes a window as its first ``summary_tokens`` tokens, and records every source it is given."""

    def __init__(self, summary_tokens: int) -> None:
        super().__init__()
        self.summary_tokens = summary_tokens
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the model a device
        self.sources: list[list[int]] = []

    def generate_fn(self, max_new_tokens: int) -> Callable[[Tensor], Tensor]:
        """What ``summarize`` calls instead of ``generate``."""
        return lambda src: self.generate(src, max_new_tokens)

    def generate(self, src: Tensor, max_new_tokens: int) -> Tensor:
        assert not self.training, "summarize decodes in evaluation mode"
        rows = [row[row != PAD_ID].tolist() for row in src]
        assert all(row[-1] == EOS_ID for row in rows), "every source ends in <eos>"
        self.sources += [row[:-1] for row in rows]
        n = min(self.summary_tokens, max_new_tokens)
        return torch.stack([F.pad(torch.tensor(row[:n]), (0, n - len(row[:n])), value=PAD_ID) for row in rows])


def test_summarize_recurses_until_one_summary_fits_and_sees_every_token() -> None:
    model, document = _ScriptedSummarizer(summary_tokens=4), " ".join(str(i) for i in range(10, 210))
    summary = summarize(
        model,
        _WordTokenizer(),
        document,
        max_source_tokens=17,
        overlap=4,
        max_new_tokens=4,
        generate_fn=model.generate_fn(4),
    )
    limit, lengths = 16, [len(s) for s in model.sources]
    assert all(n <= limit for n in lengths), "no window exceeds the context"
    level0 = model.sources[:17]  # 200 tokens in windows of 16 that advance by 12
    assert {t for window in level0 for t in window} == set(range(10, 210)), "the first level reads every token"
    # 17 windows x 4 = 68 tokens -> 6 windows x 4 = 24 -> 2 windows x 4 = 8, which fit: the final summary.
    assert len(model.sources) == 17 + 6 + 2 + 1
    assert summary == "10 11 12 13" and model.training, "the model is back in training mode"


def test_summarize_terminates_when_summaries_do_not_shrink(caplog: pytest.LogCaptureFixture) -> None:
    model, document = _ScriptedSummarizer(summary_tokens=16), " ".join(str(i) for i in range(10, 110))
    with caplog.at_level(logging.WARNING, logger="torch_handle.hierarchical"):
        summarize(model, _WordTokenizer(), document, max_source_tokens=17, overlap=4, generate_fn=model.generate_fn(16))
    assert "did not shorten" in caplog.text
    assert all(len(s) <= 16 for s in model.sources)
    # 100 tokens -> 8 windows whose summaries are the windows themselves (128 tokens) -> cut to 16 -> summary.
    assert len(model.sources) == 8 + 1 and model.sources[-1] == list(range(10, 26))


def test_summarize_stops_after_max_levels(caplog: pytest.LogCaptureFixture) -> None:
    model, document = _ScriptedSummarizer(summary_tokens=4), " ".join(str(i) for i in range(10, 210))
    with caplog.at_level(logging.WARNING, logger="torch_handle.hierarchical"):
        summarize(
            model,
            _WordTokenizer(),
            document,
            max_source_tokens=17,
            overlap=4,
            max_levels=1,
            generate_fn=model.generate_fn(4),
        )
    assert "after the last level" in caplog.text
    assert len(model.sources) == 17 + 1 and len(model.sources[-1]) == 16


def test_a_document_that_fits_is_summarized_directly() -> None:
    model = _ScriptedSummarizer(summary_tokens=3)
    summary = torch_handle.summarize(
        model, _WordTokenizer(), "5 6 7 8", max_source_tokens=5, overlap=2, generate_fn=model.generate_fn(256)
    )
    assert summary == "5 6 7"
    assert model.sources == [[5, 6, 7, 8]]


def test_an_overlap_the_windows_cannot_hold_is_one_line_naming_it() -> None:
    model, refused = _ScriptedSummarizer(summary_tokens=3), r"^overlap=16 does not fit the 16-token windows .* 15$"
    with pytest.raises(ConfigError, match=refused):
        summarize(model, _WordTokenizer(), "5 6", max_source_tokens=17, overlap=16, generate_fn=model.generate_fn(4))


def test_a_chunk_overlap_the_windows_cannot_hold_is_fitted_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default ``chunk_overlap`` (256) with a 256-token source length (a config made for longer sources, run
    smaller): said when the trainer sets up, before training, and a quarter of the window is used, where ``test``,
    ``predict`` and ``summarize`` failed after training."""
    rows = [{"document": "a b c d", "summary": "a b"}] * 4
    data = SummarizationDataModule(
        train_file=str(_write_jsonl(tmp_path / "train.jsonl", rows)), bpe_vocab_size=300, max_source_tokens=256
    )
    module = _tiny_module(300, chunk_overlap=256)
    with caplog.at_level(logging.WARNING, logger="torch_handle.hierarchical"):
        _trainer(max_steps=1, limit_val_batches=0).fit(module, datamodule=data)
    assert "chunk_overlap=256 does not fit the 255-token windows of a long document: using 63" in caplog.text
    assert module.chunk_overlap == 63 and module.hparams.chunk_overlap == 256


# --- real data: the longest QMSum meeting end to end, and the Lead baseline --------------------------------


@pytest.fixture(scope="module")
def meetings() -> list[dict[str, Any]]:
    """QMSum meetings, shortest first."""
    if not QMSUM.is_file():
        pytest.skip(f"real data not found at {QMSUM}")
    rows = [json.loads(line) for line in QMSUM.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(rows, key=lambda r: len(r["document"]))


@pytest.fixture(scope="module")
def tokenizer_file(meetings: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE trained on the three shortest meetings and every summary."""
    texts = [r["document"] for r in meetings[:3]] + [r["summary"] for r in meetings]
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    Tokenizer.train(texts, vocab_size=1000).save(path)
    return path


def _tiny_module(vocab_size: int, **overrides: Any) -> Seq2SeqModule:
    transformer = tiny_config(
        norm_first=True,
        position="alibi",
        encoder_attention="local",
        window=64,
        cross_downsample=4,
        tie_embeddings=True,
    )
    settings = {"task": "summarization", "num_beams": 2, "max_new_tokens": 12, "chunk_overlap": 64} | overrides
    return Seq2SeqModule(transformer=transformer, vocab_size=vocab_size, **settings)


def _trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@needs_qmsum
def test_longest_meeting_is_summarized_hierarchically_by_predict(
    meetings: list[dict[str, Any]], tokenizer_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    longest = meetings[-1]
    data = SummarizationDataModule(
        predict_file=str(_write_jsonl(tmp_path / "longest.jsonl", [{"document": longest["document"]}])),
        tokenizer_path=str(tokenizer_file),
        max_source_tokens=4096,
    )
    assert len(data.tokenizer.encode(longest["document"])) > 4 * 4096, "the meeting spans many windows"
    module = _tiny_module(data.vocab_size)
    output = tmp_path / "predictions.txt"
    with caplog.at_level(logging.INFO, logger="torch_handle.hierarchical"):
        predictions = _trainer(callbacks=[PredictionWriter(str(output))]).predict(module, datamodule=data)
    assert "level 0:" in caplog.text and "level 1:" not in caplog.text, "one level of windows, then the summary"
    (summary,) = [text for batch in predictions for text in batch]
    assert output.read_text(encoding="utf-8") == " ".join(summary.split()) + "\n"
    rouge = Rouge()
    rouge.update([summary], [longest["summary"]])
    assert all(0.0 <= float(v) <= 1.0 for v in rouge.compute().values())


@needs_qmsum
def test_long_documents_cut_are_summarized_from_their_first_tokens_in_one_pass(
    meetings: list[dict[str, Any]], tokenizer_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--model.long_documents cut``: a meeting over ``max_source_tokens`` is decoded as the collator cut it, as
    training reads it: no windows, and the summary ``generate`` writes from its first 511 tokens and ``<eos>``."""
    rows = [{"document": r["document"]} for r in meetings[:2]]
    data = SummarizationDataModule(
        predict_file=str(_write_jsonl(tmp_path / "two.jsonl", rows)), tokenizer_path=str(tokenizer_file),
        max_source_tokens=512,
    )  # fmt: skip
    sampled = {"num_beams": 1, "do_sample": True, "seed": 1}  # an untrained model's greedy output ignores the source
    module = _tiny_module(data.vocab_size, long_documents="cut", **sampled)
    with caplog.at_level(logging.INFO, logger="torch_handle.hierarchical"):
        predictions = [text for batch in _trainer().predict(module, datamodule=data) for text in batch]
    assert "level 0:" not in caplog.text, "decoded in windows"
    ids = data.tokenizer.encode_batch([r["document"] for r in rows])
    assert min(map(len, ids)) > 512
    src = torch.tensor([row[:511] + [EOS_ID] for row in ids])
    module.model.eval()
    controls = DecodingControls(do_sample=True, seed=1)
    want = data.tokenizer.decode_batch(generate(module.model, src, max_new_tokens=12, controls=controls).tolist())
    assert predictions == want and len(set(want)) == 2
    windows = _tiny_module(data.vocab_size, **sampled)  # the default reads the rest too
    windows.load_state_dict(module.state_dict())
    with caplog.at_level(logging.INFO, logger="torch_handle.hierarchical"):
        _trainer().predict(windows, datamodule=data)
    assert "level 0:" in caplog.text


@needs_qmsum
def test_test_reports_rouge_beside_the_lead_baseline_computed_by_rouge_score(
    meetings: list[dict[str, Any]], tokenizer_file: Path, tmp_path: Path
) -> None:
    rows = meetings[:3]
    data = SummarizationDataModule(
        test_file=str(_write_jsonl(tmp_path / "test.jsonl", rows)),
        tokenizer_path=str(tokenizer_file),
        max_source_tokens=2048,  # the shortest meetings still exceed it: test decodes hierarchically too
        max_tokens=4096,
    )
    trainer = _trainer()
    (metrics,) = trainer.test(_tiny_module(data.vocab_size, lead_words=60), datamodule=data)
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    for key in ROUGE_KEYS:
        lead = [
            scorer.score(split_sentences(r["summary"]), split_sentences(" ".join(r["document"].split()[:60])))[key]
            for r in rows
        ]
        expected = sum(score.fmeasure for score in lead) / len(rows)
        assert metrics[f"test/lead_{key}"] == pytest.approx(100 * expected, rel=1e-5), key  # 0-100, as papers
        assert 0.0 <= metrics[f"test/{key}"] <= 100.0
    assert metrics["test/lead_rouge1"] > 5, "the lead of a meeting shares words with its summary"


# --- the 32k config and the cost of a long step --------------------------------------------------------------


@needs_qmsum
def test_the_32k_config_builds_a_local_attention_model(tokenizer_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the config's data paths are relative to the project root
    args = ["--config", "configs/summarization_32k.yaml", "--data.tokenizer_path", str(tokenizer_file)]
    cli = TorchHandleCLI(Seq2SeqModule, Seq2SeqDataModule, subclass_mode_data=True, args=args, run=False)
    config = cli.model.model.config
    assert (config.encoder_attention, config.window, config.cross_downsample) == ("local", 512, 4)
    assert config.activation_checkpointing and config.position in ("alibi", "rope")
    assert config.src_vocab_size == cli.datamodule.vocab_size
    assert cli.datamodule.collator.max_source_tokens == 32768 and cli.datamodule.max_tokens == 32768


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator produces (forward, backward and optimizer alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _largest_tensor_of_a_training_step(length: int, encoder_attention: str = "local") -> int:
    config = tiny_config(
        src_vocab_size=500,
        tgt_vocab_size=500,
        num_encoder_layers=2,
        dropout=0.1,
        position="alibi",
        encoder_attention=encoder_attention,
        window=64,
        cross_downsample=4,
        activation_checkpointing=True,
        attention_backend="sdpa",
    )
    model = Transformer(config).train()
    optimizer = torch.optim.AdamW(model.parameters())
    src, tgt = torch.randint(4, 500, (1, length)), torch.randint(4, 500, (1, 33))
    with _LargestTensor() as largest:
        logits = model(src, tgt[:, :-1])  # (1, 32, V)
        F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten()).backward()
        optimizer.step()
    return largest.numel


@pytest.fixture
def default_threads() -> Iterator[None]:
    """Undo ``single_thread`` for the one test with large tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("default_threads")
def test_a_long_training_step_never_materialises_s_by_s() -> None:
    assert _largest_tensor_of_a_training_step(1024, "full") >= 1024 * 1024, "the probe sees S x S when it is there"
    short, long = _largest_tensor_of_a_training_step(2048), _largest_tensor_of_a_training_step(8192)
    assert long < 8192 * 8192 // 16, f"a tensor of {long} elements at 8k tokens: an S x S score matrix is back"
    assert long <= 4.2 * short, f"the largest tensor grows from {short} to {long} for 4x the length: not linear"
