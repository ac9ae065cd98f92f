"""Tokenizer, batching, collation, DataModules and bad-input errors of ``torch_handle.data``."""

import json
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import tiny_config
from tokenizers import Tokenizer as _HFTokenizer

from torch_handle.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Collator,
    DataError,
    Example,
    ExampleDataset,
    LengthSortedSampler,
    SummarizationDataModule,
    TokenBudgetBatchSampler,
    Tokenizer,
    TranslationDataModule,
    demo_corpus,
)
from torch_handle.data.io import read_lines
from torch_handle.data.tokenizer import Specials, read_tokenizer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MULTI30K = DATA / "multi30k"
QMSUM = DATA / "qmsum" / "val.jsonl"
needs_multi30k = pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"real data not found at {MULTI30K}")
needs_qmsum = pytest.mark.skipif(not QMSUM.is_file(), reason=f"real data not found at {QMSUM}")


def _lines(path: Path, n: int | None = None) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()[:n]


@pytest.fixture(scope="module")
def small_tokenizer() -> Tokenizer:
    """A BPE trained on 2000 real Multi30k lines, enough for the round-trip and collation tests."""
    if not MULTI30K.is_dir():
        pytest.skip(f"real data not found at {MULTI30K}")
    texts = _lines(MULTI30K / "train.de", 1000) + _lines(MULTI30K / "train.en", 1000)
    return Tokenizer.train(texts, vocab_size=1000)


def _assert_one_line_error(err: pytest.ExceptionInfo[DataError], *parts: str) -> None:
    message = str(err.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# --- tokenizer ---------------------------------------------------------------------------------------------


@needs_multi30k
def test_tokenizer_round_trips_real_german(small_tokenizer: Tokenizer) -> None:
    texts = _lines(MULTI30K / "val.de")
    assert any(ch in "".join(texts) for ch in "äöüß")  # the check is only worth something with umlauts
    assert small_tokenizer.decode_batch(small_tokenizer.encode_batch(texts)) == texts
    assert all(small_tokenizer.decode(small_tokenizer.encode(t)) == t for t in texts[:50])


def test_tokenizer_never_needs_unk_and_fixes_special_ids() -> None:
    tokenizer = Tokenizer.train(["a small corpus"] * 10, vocab_size=300)
    text = "Straße, Übermut — naïve 😀\n  two  spaces"  # nothing of this but ASCII letters was seen in training
    ids = tokenizer.encode(text)
    assert tokenizer.unk_id not in ids and min(ids) > 3
    assert tokenizer.decode(ids) == text
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)


def test_decode_drops_specials_and_stops_at_first_eos() -> None:
    tokenizer = Tokenizer.train(["ein Hund", "eine Katze"] * 10, vocab_size=300)
    hund, katze = tokenizer.encode("ein Hund"), tokenizer.encode(" eine Katze")
    row = [BOS_ID, *hund, EOS_ID, *katze, PAD_ID]
    assert tokenizer.decode(row) == "ein Hund"
    assert tokenizer.decode_batch(torch.tensor([row, [BOS_ID, *hund, *katze, EOS_ID, PAD_ID]])) == [
        "ein Hund",
        "ein Hund eine Katze",
    ]


@needs_multi30k
def test_tokenizer_save_load_gives_identical_ids(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tok" / "tokenizer.json"
    small_tokenizer.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temporary file left behind
    texts = _lines(MULTI30K / "val.en", 200)
    assert Tokenizer.from_file(path).encode_batch(texts) == small_tokenizer.encode_batch(texts)
    assert Tokenizer.from_str(small_tokenizer.to_str()).encode_batch(texts) == small_tokenizer.encode_batch(texts)


@needs_multi30k
def test_tokenizer_training_is_deterministic(small_tokenizer: Tokenizer) -> None:
    texts = _lines(MULTI30K / "train.de", 1000) + _lines(MULTI30K / "train.en", 1000)
    assert Tokenizer.train(texts, vocab_size=1000).to_str() == small_tokenizer.to_str()


def test_tokenizer_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        Tokenizer.from_file(tmp_path / "missing.json")
    _assert_one_line_error(err, "missing.json", "not found")
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}', encoding="utf-8")
    with pytest.raises(DataError) as err:
        Tokenizer.from_file(bad)
    _assert_one_line_error(err, "bad.json", "not a torch-handle tokenizer")


def _wordpiece_with_a_gap() -> str:
    """A WordPiece tokenizer whose ids skip 2, as ``tokenizers`` accepts."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    return Backend(models.WordPiece({"[PAD]": 0, "[UNK]": 1, "x": 3}, unk_token="[UNK]")).to_str()


def _unigram_with_a_repeated_piece() -> str:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    return Backend(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("a", -2.0), ("b", -1.5)], unk_id=0)).to_str()


@pytest.mark.parametrize("build", [_wordpiece_with_a_gap, _unigram_with_a_repeated_piece])
def test_tokenizer_ids_with_gaps_or_repeats_load(build: Callable[[], str], tmp_path: Path) -> None:
    """The id check bounds ids, not their count: what ``tokenizers`` accepts loads, in both readers."""
    json_str = build()
    expected = _HFTokenizer.from_str(json_str).encode("x a b").ids
    wrapped = json.dumps({"torch_handle_specials": {"pad_id": 0, "bos_id": 0, "eos_id": 1}, "tokenizer": json_str})
    assert Tokenizer.from_str(wrapped).backend.encode("x a b").ids == expected
    (tmp_path / "tokenizer.json").write_text(json_str, encoding="utf-8")
    assert read_tokenizer(tmp_path, Specials(0, 0, 1)).backend.encode("x a b").ids == expected


def test_a_tokenizer_with_gaps_sizes_the_embedding_by_its_largest_id(tmp_path: Path) -> None:
    """Ids 0, 1 and 3: three tokens, but an embedding of three rows has no row 3."""
    (tmp_path / "tokenizer.json").write_text(_wordpiece_with_a_gap(), encoding="utf-8")
    tokenizer = read_tokenizer(tmp_path, Specials(0, 0, 1))
    assert tokenizer.backend.encode("x").ids == [3]
    assert tokenizer.vocab_size == 4


def test_pretrained_tokenizer_with_a_huge_id_is_one_line(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    """A Hugging Face folder's tokenizer.json is id-checked before the Rust library sizes a table by its ids."""
    data = json.loads(small_tokenizer.to_str())
    token = next(token for token, id_ in data["model"]["vocab"].items() if id_ == 100)
    data["model"]["vocab"][token] = 1_500_000_000
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_tokenizer(tmp_path, Specials())
    assert str(err.value) == (
        f"{path} is not a tokenizer: not a tokenizer JSON (token {token!r} has id 1500000000, outside 0-16777215)"
    )


# --- batch sampler -----------------------------------------------------------------------------------------


def _lengths(n: int = 500, seed: int = 0) -> list[int]:
    return torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_sampler_yields_each_index_once_within_budget() -> None:
    lengths = _lengths()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=256, shuffle=True, seed=3)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 256 for b in batches)
    assert len(sampler) == len(batches)
    # length bucketing: padding stays small
    assert sum(len(b) * max(lengths[i] for i in b) for b in batches) < 1.2 * sum(lengths)


def test_sampler_puts_an_over_long_example_alone() -> None:
    batches = list(TokenBudgetBatchSampler([5, 500, 5, 5], max_tokens=100, shuffle=False))
    assert [1] in batches and sorted(map(len, batches)) == [1, 3]


def test_sampler_is_deterministic_per_seed_and_epoch() -> None:
    lengths = _lengths()

    def order(seed: int, epoch: int) -> list[list[int]]:
        sampler = TokenBudgetBatchSampler(lengths, max_tokens=256, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(0, 0) == order(0, 0)
    assert order(0, 1) == order(0, 1)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    unshuffled = TokenBudgetBatchSampler(lengths, max_tokens=256, shuffle=False)
    first = list(unshuffled)
    unshuffled.set_epoch(1)
    assert list(unshuffled) == first


@pytest.mark.parametrize("num_items", [200, 210])  # 20 batches split evenly, 21 need one repeated
def test_sampler_shards_across_two_replicas(num_items: int) -> None:
    lengths = [10] * num_items  # 10 per batch under a 100-token budget

    def shard(rank: int, drop_last: bool = False) -> list[list[int]]:
        sampler = TokenBudgetBatchSampler(
            lengths, 100, shuffle=True, seed=1, num_replicas=2, rank=rank, drop_last=drop_last
        )
        sampler.set_epoch(2)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        return batches

    rank0, rank1 = shard(0), shard(1)
    assert len(rank0) == len(rank1) == 10 + num_items % 200 // 10
    seen0, seen1 = [i for b in rank0 for i in b], [i for b in rank1 for i in b]
    real0, real1 = {i for i in seen0 if i < num_items}, {i for i in seen1 if i < num_items}
    assert real0 | real1 == set(range(num_items)) and not real0 & real1  # every example once
    # The repeated batch (when the count is uneven) comes shifted by num_items, so the dataset marks it.
    repeats = [i - num_items for i in seen0 + seen1 if i >= num_items]
    assert len(repeats) == (0 if num_items == 200 else 10) and set(repeats) <= set(range(num_items))
    dropped0, dropped1 = shard(0, drop_last=True), shard(1, drop_last=True)
    assert len(dropped0) == len(dropped1) == 10
    assert not {i for b in dropped0 for i in b} & {i for b in dropped1 for i in b}


@pytest.mark.parametrize("num_items", [9, 10])
def test_prediction_order_is_longest_first_and_shards_evenly(num_items: int) -> None:
    lengths = [int(n) for n in torch.randint(1, 50, (num_items,), generator=torch.Generator().manual_seed(0))]
    shards = [list(LengthSortedSampler(lengths, num_replicas=2, rank=rank)) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 5  # a tenth index, when needed, repeats the longest example
    shards[1] = shards[1][: num_items // 2]  # without the repeat
    for shard in shards:
        assert [lengths[i] for i in shard] == sorted((lengths[i] for i in shard), reverse=True)
    assert sorted(shards[0] + shards[1]) == list(range(num_items))
    alone = list(LengthSortedSampler(lengths))
    assert sorted(alone) == list(range(num_items)) and alone[0] == max(range(num_items), key=lengths.__getitem__)


def test_sampler_resumes_mid_epoch() -> None:
    lengths = _lengths()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=256, shuffle=True, seed=5)
    sampler.set_epoch(3)
    full = list(sampler)
    iterator = iter(sampler)
    for _ in range(4):
        next(iterator)
    state = sampler.state_dict()
    assert state == {"epoch": 3, "batches_done": 4}

    resumed = TokenBudgetBatchSampler(lengths, max_tokens=256, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # Lightning sets the epoch again when it restarts the loop
    assert list(resumed) == full[4:]
    assert list(resumed) == full  # the skip applies once
    other_epoch = TokenBudgetBatchSampler(lengths, max_tokens=256, shuffle=True, seed=5)
    other_epoch.load_state_dict(state)
    other_epoch.set_epoch(4)
    assert len(list(other_epoch)) == len(full)  # a skip meant for epoch 3 does not cut epoch 4


# --- collation ---------------------------------------------------------------------------------------------


def test_collator_adds_specials_pads_and_truncates() -> None:
    collate = Collator(max_source_tokens=4, max_target_tokens=5)
    long = Example([5, 6, 7, 8, 9], "long", [10, 11, 12, 13], "long target")
    short = Example([5], "short", [10], "short target")
    batch = collate([long, short])
    assert batch["src"].dtype == batch["tgt"].dtype == torch.long
    assert batch["src"].tolist() == [[5, 6, 7, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]]
    assert batch["tgt"].tolist() == [[BOS_ID, 10, 11, 12, EOS_ID], [BOS_ID, 10, EOS_ID, PAD_ID, PAD_ID]]
    assert batch["src_text"] == ["long", "short"] and batch["tgt_text"] == ["long target", "short target"]
    assert collate.length(long) == 5 and collate.length(short) == 3
    assert batch["src_truncated"] == [True, False]  # 5 source tokens do not fit 3 + <eos>
    fits = Example([5, 6, 7], "fits", [10], "t")
    assert collate([fits])["src_truncated"] == [False]


def test_collator_predict_batch_has_no_target() -> None:
    batch = Collator(8, 8)([Example([5, 6], "a"), Example([7], "b")])
    assert set(batch) == {"src", "src_lengths", "src_text", "src_truncated", "repeat"}  # no target keys
    assert batch["src_lengths"] == [3, 2]
    assert batch["src"].tolist() == [[5, 6, EOS_ID], [7, EOS_ID, PAD_ID]]


# --- DataModules -------------------------------------------------------------------------------------------


@pytest.mark.slow  # tokenizes all of Multi30k
@needs_multi30k
def test_translation_datamodule_on_multi30k() -> None:
    dm = TranslationDataModule(data_dir=str(MULTI30K), test_split="test_2016_flickr", bpe_vocab_size=1000)
    assert dm.vocab_size == 1000  # known before setup, for the CLI to size the model
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["src"].shape[0] == batch["tgt"].shape[0] == len(batch["src_text"])
    assert batch["src"].numel() <= dm.max_tokens and batch["tgt"].numel() <= dm.max_tokens
    assert (batch["tgt"][:, 0] == BOS_ID).all()
    originals = {" ".join(line.split()) for line in _lines(MULTI30K / "train.en")}
    decoded = dm.tokenizer.decode_batch(batch["src"])
    assert decoded == batch["src_text"] and set(decoded) <= originals
    assert dm.tokenizer.decode_batch(batch["tgt"]) == batch["tgt_text"]
    assert sum(len(b["src_text"]) for b in dm.val_dataloader()) == 1014
    dm.setup("test")
    assert sum(len(b["src_text"]) for b in dm.test_dataloader()) == 1000


@needs_multi30k
def test_checkpointed_tokenizer_replaces_and_retokenizes(small_tokenizer: Tokenizer) -> None:
    dm = TranslationDataModule(demo_size=200, bpe_vocab_size=300)
    dm.setup("fit")
    dm.load_state_dict({"tokenizer": small_tokenizer.to_str()})
    assert dm.vocab_size == small_tokenizer.vocab_size
    example = dm.dataset("train").examples[0]
    assert example.src_ids == small_tokenizer.encode(example.src_text)
    assert Tokenizer.from_str(dm.state_dict()["tokenizer"]).to_str() == small_tokenizer.to_str()


def test_translation_demo_and_predict(tmp_path: Path) -> None:
    predict = tmp_path / "in.txt"
    predict.write_text("the dog sees a cat\n\nmy   two old birds  helped the king\n", encoding="utf-8")
    dm = TranslationDataModule(demo_size=500, predict_file=str(predict), predict_batch_size=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert dm.tokenizer.decode_batch(batch["tgt"]) == batch["tgt_text"]
    dm.setup("predict")
    batches = list(dm.predict_dataloader())
    texts = [t for b in batches for t in b["src_text"]]
    assert texts == ["my two old birds helped the king", "the dog sees a cat", ""]  # longest first, blanks kept
    assert all("tgt" not in b for b in batches)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def qmsum_subset(tmp_path: Path) -> Path:
    if not QMSUM.is_file():
        pytest.skip(f"real data not found at {QMSUM}")
    rows = [json.loads(line) for line in _lines(QMSUM, 4)]
    return _write_jsonl(tmp_path / "qmsum.jsonl", rows)


def test_summarization_datamodule_truncates_with_one_warning(qmsum_subset: Path) -> None:
    dm = SummarizationDataModule(
        train_file=str(qmsum_subset), bpe_vocab_size=1000, max_source_tokens=2048, max_tokens=8192
    )
    with pytest.warns(UserWarning, match=r"truncated 4 of 4 sources to 2047 tokens") as record:
        dm.setup("fit")
    assert len(record) == 1
    assert dm.val_dataloader() == []  # no val_file: validation is skipped
    batches = list(dm.train_dataloader())
    assert sum(len(b["src_text"]) for b in batches) == 4
    for batch in batches:
        assert batch["src"].shape[1] == 2048 and (batch["src"][:, -1] == EOS_ID).all()
        assert batch["src"].numel() <= 8192
        assert dm.tokenizer.decode_batch(batch["tgt"]) == batch["tgt_text"]


def test_summarization_truncation_error_names_file_line_and_length(qmsum_subset: Path) -> None:
    dm = SummarizationDataModule(
        train_file=str(qmsum_subset), bpe_vocab_size=1000, max_source_tokens=2048, truncation="error"
    )
    with pytest.raises(DataError) as err:
        dm.setup("fit")
    length = len(dm.tokenizer.encode(json.loads(_lines(qmsum_subset, 1)[0])["document"].strip()))
    _assert_one_line_error(err, f"{qmsum_subset}:1:", f"{length} tokens", "--data.max_source_tokens")


def test_summarization_predict_accepts_json_lines_and_plain_text(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", [{"document": "a long meeting", "summary": "short"}] * 5)
    json_in = _write_jsonl(tmp_path / "in.jsonl", [{"document": "first doc"}, {"document": "{second} doc"}])
    text_in = tmp_path / "in.txt"
    text_in.write_text("{disfmarker} first doc\nsecond doc\n", encoding="utf-8")
    for path, expected in (
        (json_in, ["first doc", "{second} doc"]),
        (text_in, ["{disfmarker} first doc", "second doc"]),
    ):
        dm = SummarizationDataModule(train_file=str(train), predict_file=str(path), bpe_vocab_size=300)
        dm.setup("predict")
        assert sorted(t for b in dm.predict_dataloader() for t in b["src_text"]) == sorted(expected)


def test_summarization_reads_a_query_before_the_document_and_every_reference(tmp_path: Path) -> None:
    rows = [
        {
            "query": "Who won?",
            "document": " The red team won. ",
            "summaries": ["Red won.", "The reds."],
            "summary": "x",
        },
        {"query": "Why?", "document": "It rained.", "summary": "Rain."},  # one reference: the summary
    ]
    test = _write_jsonl(tmp_path / "test.jsonl", rows)
    dm = SummarizationDataModule(train_file=str(test), test_file=str(test), query_field="query", bpe_vocab_size=300)
    dm.setup("test")
    (batch,) = dm.test_dataloader()
    by_source = dict(zip(batch["src_text"], batch["references"], strict=True))
    assert by_source == {"Who won?\n\nThe red team won.": ["Red won.", "The reds."], "Why?\n\nIt rained.": ["Rain."]}
    assert sorted(batch["tgt_text"]) == ["Rain.", "x"]  # trained on (and the loss read from) the summary field
    assert dm.summary_ratio() == pytest.approx((1 / len("Who won?\n\nThe red team won.") + 5 / 16) / 2)

    bad = _write_jsonl(tmp_path / "bad.jsonl", [rows[1], rows[0] | {"summaries": ["ok", 3]}])
    dm = SummarizationDataModule(train_file=str(test), test_file=str(bad), query_field="query", bpe_vocab_size=300)
    with pytest.raises(DataError) as err:
        dm.setup("test")
    _assert_one_line_error(err, f"{bad}:2: field 'summaries' must be a non-empty list of strings")
    no_query = _write_jsonl(tmp_path / "no_query.jsonl", [{"document": "d", "summary": "s"}])
    dm = SummarizationDataModule(train_file=str(test), test_file=str(no_query), query_field="query", bpe_vocab_size=300)
    with pytest.raises(DataError) as err:
        dm.setup("test")
    _assert_one_line_error(err, f"{no_query}:1: no field 'query'", "--data.query_field")
    plain = tmp_path / "plain.txt"
    plain.write_text("a meeting transcript, one document a line\n")
    dm = SummarizationDataModule(train_file=str(test), predict_file=str(plain), query_field="query", bpe_vocab_size=300)
    with pytest.raises(DataError) as err:
        dm.setup("predict")
    assert str(err.value) == (
        f"{plain} is plain text, which holds no 'query' to ask: write JSON lines with 'query' and 'document', or pass "
        "--data.init_args.query_field null"
    )
    plain.write_text('{"query": "who spoke?", "document": "broken\n')  # JSON lines, the first one broken
    with pytest.raises(DataError, match=rf"^{plain}:1: not valid JSON"):
        dm.setup("predict")


class _EpochRecorder(pl.LightningModule):
    """Records the first batch of each training epoch, to see that Lightning advances the sampler's epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.first_batches: list[list[str]] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            self.first_batches.append(batch["src_text"])
        return self.weight.sum() * batch["src"].float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_reshuffles_token_budget_batches_each_epoch(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model = _EpochRecorder()
    trainer.fit(model, datamodule=TranslationDataModule(demo_size=500, bpe_vocab_size=300, max_tokens=512))
    assert len(model.first_batches) == 2 and model.first_batches[0] != model.first_batches[1]


# --- bad input ---------------------------------------------------------------------------------------------


def _parallel(tmp_path: Path, src: bytes, tgt: bytes) -> TranslationDataModule:
    for split in ("train", "val"):
        (tmp_path / f"{split}.en").write_bytes(src)
        (tmp_path / f"{split}.de").write_bytes(tgt)
    return TranslationDataModule(data_dir=str(tmp_path), bpe_vocab_size=300)


def test_error_for_missing_data_dir(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        TranslationDataModule(data_dir=str(tmp_path / "nowhere"))
    _assert_one_line_error(err, "nowhere", "not found")


def test_error_for_missing_file(tmp_path: Path) -> None:
    (tmp_path / "train.en").write_text("a\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        TranslationDataModule(data_dir=str(tmp_path)).setup("fit")
    _assert_one_line_error(err, "train.de", "not found")


def test_error_for_unequal_line_counts(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        _parallel(tmp_path, b"a\nb\nc\n", b"x\ny\n").setup("fit")
    _assert_one_line_error(err, "train.en has 3 lines", "train.de has 2")


def test_error_for_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        _parallel(tmp_path, b"", b"").setup("fit")
    _assert_one_line_error(err, "train.en", "empty")


def test_error_for_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    # line 2 is valid multi-byte UTF-8; the Latin-1 byte on line 3 is the one to report
    with pytest.raises(DataError) as err:
        _parallel(tmp_path, "ok\nschön\n".encode() + b"caf\xe9\n", b"a\nb\nc\n").setup("fit")
    _assert_one_line_error(err, "train.en:3:", "UTF-8")


def test_error_for_invalid_json_line(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"document": "d", "summary": "s"}\n{"document": "d", "summary": \n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        SummarizationDataModule(train_file=str(path)).setup("fit")
    _assert_one_line_error(err, f"{path}:2:", "not valid JSON")


def test_error_for_json_line_without_field(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [{"document": "d", "summary": "s"}, {"document": "d"}])
    with pytest.raises(DataError) as err:
        SummarizationDataModule(train_file=str(path)).setup("fit")
    _assert_one_line_error(err, f"{path}:2:", "'summary'", "--data.summary_field")


def test_error_for_missing_tokenizer_source() -> None:
    with pytest.raises(DataError) as err:
        _ = SummarizationDataModule().vocab_size
    _assert_one_line_error(err, "--data.train_file", "--data.tokenizer_path")


# --- demo task ---------------------------------------------------------------------------------------------


def test_demo_corpus_is_deterministic_disjoint_and_not_a_copy() -> None:
    train = demo_corpus("train", 2000, seed=0)
    assert train == demo_corpus("train", 2000, seed=0)
    assert train != demo_corpus("train", 2000, seed=1)
    val, test = demo_corpus("val", 300, seed=0), demo_corpus("test", 300, seed=0)
    sources = [{s for s, _ in split} for split in (train, val, test)]
    assert [len(s) for s in sources] == [2000, 300, 300]  # no duplicates within a split
    assert not (sources[0] & sources[1] or sources[0] & sources[2] or sources[1] & sources[2])
    assert all(4 <= len(s.split()) <= 14 for s, _ in train)
    source_words = {w for s, _ in train for w in s.split()}
    target_words = {w for _, t in train for w in t.split()}
    assert not source_words & target_words  # its own vocabulary
    with_sees = [(s, t) for s, t in train if " sees " in s]
    assert with_sees and all(t.split()[-1] == "vid" for _, t in with_sees)  # the verb moves to the end
    with pytest.raises(DataError):
        demo_corpus("dev", 10, seed=0)


def test_repeated_examples_come_marked_in_their_batch() -> None:
    examples = [Example([5, 6], "a b", [7], "c"), Example([8], "d", [9, 10], "e f")]
    dataset, collate = ExampleDataset(examples), Collator(16, 16)
    assert dataset[3] == Example([8], "d", [9, 10], "e f", repeat=True)  # index n + i repeats example i
    assert collate([dataset[0], dataset[1]])["repeat"] is False
    assert collate([dataset[2], dataset[3]])["repeat"] is True


def test_length_limits_follow_the_model_context() -> None:
    """A model with a 12-position table gets batches it can read; unlimited positions change nothing."""
    from torch_handle.model import Transformer

    dm = TranslationDataModule(demo_size=300, bpe_vocab_size=300, max_source_tokens=256, max_target_tokens=256)
    dm.fit_context(None)  # rope/alibi: no table to outgrow
    assert (dm.collator.max_source_tokens, dm.collator.max_target_tokens) == (256, 256)
    lowered = r"max_len=12 positions: lowered --data.max_source_tokens=256 to 12, --data.max_target_tokens=256 to 13"
    with pytest.warns(UserWarning, match=lowered):
        dm.fit_context(12)
    with pytest.warns(UserWarning, match=r"truncated \d+ of 300 sources to 11 tokens"):
        dm.setup("fit")
    size = dm.vocab_size
    model = Transformer(tiny_config(src_vocab_size=size, tgt_vocab_size=size, d_model=8, d_ff=8, max_len=12))
    batch = max(dm.train_dataloader(), key=lambda b: b["src"].shape[1])
    assert batch["src"].shape[1] == 12
    model(batch["src"], batch["tgt"][:, :-1])  # the positions table would raise for a longer batch


def test_target_limits_follow_a_shorter_decoder_table() -> None:
    """LED's decoder reads fewer positions than its encoder: targets are lowered to the decoder's table alone."""
    dm = TranslationDataModule(demo_size=300, bpe_vocab_size=300, max_source_tokens=64, max_target_tokens=64)
    with pytest.warns(
        UserWarning,
        match=r"max_len=128, max_target_len=16 positions: lowered --data.max_target_tokens="
        r"64 to 17; raise",
    ):
        dm.fit_context(128, 16)
    assert (dm.collator.max_source_tokens, dm.collator.max_target_tokens) == (64, 17)
    dm = TranslationDataModule(demo_size=300, bpe_vocab_size=300, max_source_tokens=256, max_target_tokens=64)
    trained = r"^the trained model's position tables read at most 128 and 16 positions: lowered --data.max_source_"
    with pytest.warns(UserWarning, match=trained + r"tokens=256 to 128, --data.max_target_tokens=64 to 17$"):
        dm.fit_context(128, 16, trained=True)  # a checkpoint's or a pretrained folder's tables: nothing to raise


def test_a_file_with_nul_bytes_is_read_with_one_warning(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"the dog sees a cat\n\0\0\0\0\n")
    with pytest.warns(UserWarning) as record:
        assert read_lines(path) == ["the dog sees a cat", "\0\0\0\0"]
    assert [str(w.message) for w in record] == [
        f"{path}:2: 4 NUL byte(s), which text never holds: is this the file you meant?"
    ]


def test_a_file_with_a_byte_order_mark_names_its_first_bad_byte(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbfthe dog\nsees \xff cat\n")
    with pytest.raises(DataError) as err:
        read_lines(path)
    assert str(err.value) == f"{path}:2: not UTF-8 (byte 0xff); re-save the file as UTF-8"
