"""The pre-tokenized training path (``prepare tokens``, ``--data.init_args.pretokenized``): the same batches as the
in-memory path on any number of ranks, exact mid-epoch resume, refused folders, and training under a memory cap."""

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import ROOT, RUN_TIMEOUT, env, fit_args

from torch_handle.cli import prepare_tokens
from torch_handle.data import DataError, SummarizationDataModule, Tokenizer, TranslationDataModule, base, io
from torch_handle.data.pretokenized import META, OFFSET, SIDES, TOKEN, PretokenizedDataset, describe, write_pretokenized
from torch_handle.data.tokenizer import Specials

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
LINES = 3000


def _trainer(replicas: int, rank: int, processed: int = 0) -> SimpleNamespace:
    """What the DataModule reads of a Trainer: its shard, accumulation and the batches trained this epoch."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(
        world_size=replicas,
        global_rank=rank,
        lightning_module=None,
        accumulate_grad_batches=2,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first lines of Multi30k's train and val, and their training split written pre-tokenized to ``tokens/``."""
    if not MULTI30K.is_dir():
        pytest.skip(f"real data not found at {MULTI30K}")
    folder = tmp_path_factory.mktemp("multi30k")
    for split in ("train", "val"):
        for lang in ("en", "de"):
            lines = (MULTI30K / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[:LINES]
            (folder / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert _module(folder).write_pretokenized(folder / "tokens") == LINES
    return folder


def _module(folder: Path, **options: object) -> TranslationDataModule:
    settings = {"bpe_vocab_size": 1000, "max_tokens": 600, "max_source_tokens": 24, "max_target_tokens": 24, "seed": 3}
    return TranslationDataModule(data_dir=str(folder), **{**settings, **options})


def _batches(dm: TranslationDataModule, epoch: int, **trainer: int) -> list[dict]:
    dm.trainer = _trainer(**trainer)
    loader = dm.train_dataloader()
    loader.batch_sampler.set_epoch(epoch)
    return [{k: b[k] for k in ("src", "tgt", "step_tokens", "repeat")} for b in loader]


def _assert_same(want: list[dict], got: list[dict]) -> None:
    assert len(want) == len(got) > 0
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a["src"], b["src"]) and torch.equal(a["tgt"], b["tgt"])
        assert (a["step_tokens"], a["repeat"]) == (b["step_tokens"], b["repeat"])


@pytest.mark.parametrize("replicas", [1, 3])
def test_batches_equal_the_in_memory_path(corpus: Path, replicas: int) -> None:
    """Every rank's batches of two epochs: the same ids, truncation, step token counts and repeats."""
    memory, disk = _module(corpus), _module(corpus, pretokenized=str(corpus / "tokens"))
    for epoch in (0, 1):
        for rank in range(replicas):
            _assert_same(
                _batches(memory, epoch, replicas=replicas, rank=rank),
                _batches(disk, epoch, replicas=replicas, rank=rank),
            )
    assert disk.tokenizer.to_str() == memory.tokenizer.to_str()


@pytest.mark.parametrize("specials", [Specials(), Specials(bos_id=2, source_prefix=(0,), target_prefix=(0, 1))])
def test_costs_from_counts_equal_each_examples(corpus: Path, specials: Specials) -> None:
    """The lengths and scored tokens both paths batch by, from token counts alone, are those of the collated rows."""
    dm = _module(corpus)
    examples = dm.dataset("train").examples
    collator = dataclasses.replace(dm.collator, specials=specials)
    lengths, scored = collator.costs(*dm.dataset("train").token_counts())
    assert lengths == [collator.length(e) for e in examples]
    assert scored == [collator.scored_tokens(e) for e in examples]
    assert max(len(e.src_ids) for e in examples) > collator.max_source_tokens  # truncation is exercised


def test_resumes_mid_epoch_exactly(corpus: Path) -> None:
    """A loader restored from the state a checkpoint saves after 5 trained batches yields the epoch's remaining ones."""
    dm = _module(corpus, pretokenized=str(corpus / "tokens"))
    full = _batches(dm, epoch=2, replicas=2, rank=1)
    dm.trainer = _trainer(replicas=2, rank=1, processed=5)
    state = dm.train_dataloader().state_dict() | {"epoch": 2}
    resumed = _module(corpus, pretokenized=str(corpus / "tokens"))
    resumed.trainer = _trainer(replicas=2, rank=1)
    loader = resumed.train_dataloader()
    loader.load_state_dict(state)
    loader.batch_sampler.set_epoch(2)  # Lightning sets the epoch again when it restarts the loop
    _assert_same(full[5:], [{k: b[k] for k in ("src", "tgt", "step_tokens", "repeat")} for b in loader])


def test_reads_only_the_ids_a_row_keeps(corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long example costs what the collator keeps of it (and one id more), not its whole length."""
    dm = _module(corpus, pretokenized=str(corpus / "tokens"))
    sizes: list[int] = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, size, offset: sizes.append(size) or pread(fd, size, offset))
    _batches(dm, 0, replicas=1, rank=0)
    sources, targets = dm.dataset("train").token_counts()
    assert max(sources) > 24 and max(targets) > 23  # the limits cut some examples
    assert len(sizes) == 2 * LINES and max(sizes) == 24 * TOKEN.itemsize


def test_the_truncation_policy_applies_to_pretokenized_examples(tmp_path: Path) -> None:
    """``--data.truncation error`` stops at the first long example, ``warn`` counts them, as for the text files."""
    train = tmp_path / "train.jsonl"
    rows = [{"document": "the cat sat " * n, "summary": "a cat"} for n in (2, 30, 3, 40)]
    train.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    options = {"train_file": str(train), "bpe_vocab_size": 300, "max_source_tokens": 20}
    SummarizationDataModule(**{**options, "max_source_tokens": 512}).write_pretokenized(tmp_path / "tokens")
    folder = str(tmp_path / "tokens")
    with pytest.raises(DataError) as text:
        SummarizationDataModule(**options, truncation="error").setup("fit")
    with pytest.raises(DataError) as tokens:
        SummarizationDataModule(**options, truncation="error", pretokenized=folder).setup("fit")
    problem = str(text.value).removeprefix(f"{train}:2: ")
    assert problem.startswith("source has ") and problem.endswith("or set --data.truncation=warn")
    assert str(tokens.value) == f"{folder} example 1: {problem}"
    with pytest.warns(UserWarning, match=rf"^{re.escape(folder)}: truncated 2 of 4 sources to 19 tokens; raise"):
        SummarizationDataModule(**options, pretokenized=folder).setup("fit")


def _copy(corpus: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "tokens"
    folder.mkdir()
    for file in (corpus / "tokens").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


def _truncate(folder: Path) -> None:
    with open(folder / "target.tokens", "r+b") as file:
        file.truncate(100)


def _edit_offsets(folder: Path) -> None:
    data = bytearray((folder / "source.offsets").read_bytes())
    data[8] ^= 1
    (folder / "source.offsets").write_bytes(bytes(data))


def _foreign(folder: Path) -> None:  # a litdata folder, say
    (folder / META).unlink()
    (folder / "index.json").write_text(json.dumps({"chunks": [], "config": {}}))


def _newer(folder: Path) -> None:
    meta = json.loads((folder / META).read_text())
    (folder / META).write_text(json.dumps({**meta, "version": 2}))


def _meta(folder: Path, **changes: object) -> None:
    meta = json.loads((folder / META).read_text())
    (folder / META).write_text(json.dumps({**meta, **changes}))


def _forged_offsets(data: bytes, examples: int) -> Callable[[Path], None]:
    """An attacker's offsets with their size and sha256 recorded, as ``prepare tokens`` would have."""

    def forge(folder: Path) -> None:
        (folder / "source.offsets").write_bytes(data)
        files = json.loads((folder / META).read_text())["files"]
        files["source.offsets"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _meta(folder, files=files, examples=examples)

    return forge


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncate, "target.tokens has 100 bytes, not the"),
        (lambda folder: _meta(folder, vocab_size=10**9), "says 1000000000 token ids, its tokenizer has"),
        (lambda folder: _meta(folder, examples=-1), "is damaged"),
        (_forged_offsets(np.array([0, 2**62 + 3], "<i8").tobytes(), 1), "source.offsets ends at"),
        (_forged_offsets(b"\0" * 12, 1), "source.offsets is not a whole number of offsets"),
        (_edit_offsets, "source.offsets fails its sha256"),
        (_foreign, "is not a pre-tokenized folder"),
        (_newer, "format version 2, this torch-handle reads 1"),
    ],
)
def test_damaged_or_foreign_folders_are_refused(corpus: Path, tmp_path: Path, damage, message: str) -> None:
    folder = _copy(corpus, tmp_path)
    damage(folder)
    with pytest.raises(DataError) as err:
        _module(corpus, pretokenized=str(folder)).setup("fit")
    assert "\n" not in str(err.value) and message in str(err.value)
    assert "prepare tokens" in str(err.value)


@pytest.mark.parametrize("value", [-1, 1000])
def test_ids_out_of_the_vocabulary_are_refused_when_read(corpus: Path, tmp_path: Path, value: int) -> None:
    """A token file changed in place (its size kept) is caught on reading, not as an index error in the model."""
    folder = _copy(corpus, tmp_path)
    with open(folder / "source.tokens", "r+b") as file:
        file.write(np.array([value], TOKEN).tobytes())
    dataset = PretokenizedDataset(folder)
    assert dataset.example(1).src_ids  # other examples read
    with pytest.raises(DataError, match=r"source.tokens changed after it was written \(example 0 reads wrong\)"):
        dataset.example(0)


def test_a_folder_of_another_tokenizer_is_refused(corpus: Path, tmp_path: Path) -> None:
    """Stale: the run's tokenizer (given, or a checkpoint's) is not the one the folder's ids come from."""
    other = Tokenizer.train(["ein Hund läuft", "a dog runs"] * 50, 300)
    other.save(tmp_path / "other.json")
    for dm, load in (
        (_module(corpus, pretokenized=str(corpus / "tokens"), tokenizer_path=str(tmp_path / "other.json")), None),
        (_module(corpus, pretokenized=str(corpus / "tokens")), {"tokenizer": other.to_str()}),
    ):
        with pytest.raises(DataError, match=r"was tokenized with another tokenizer than (.*tokenizer_path|the checkp)"):
            dm.setup("fit")
            dm.load_state_dict(load)


def test_prepare_tokens_writes_what_fit_would_read(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``prepare tokens`` parses fit's options with fit's parser: the config's data section, any override fit takes
    (here the ``--data.NAME`` shorthand for another tokenizer), and bad input as one line."""
    config = tmp_path / "data.yaml"
    config.write_text(
        "data:\n  class_path: torch_handle.data.TranslationDataModule\n  init_args:\n"
        f"    data_dir: {corpus}\n    bpe_vocab_size: 1000\n    pretokenized: elsewhere\n"
    )
    other = tmp_path / "other.json"
    Tokenizer.train(["ein Hund läuft", "a dog runs"] * 50, 300).save(other)
    prepare_tokens(["--config", str(config), "--out", str(tmp_path / "out"), "--data.tokenizer_path", str(other)])
    _module(corpus, tokenizer_path=str(other)).write_pretokenized(tmp_path / "reference")
    for name in ("source.tokens", "target.offsets", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
        assert (tmp_path / "out" / name).read_bytes() != (corpus / "tokens" / name).read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        prepare_tokens(["--config", str(config), "--out", str(tmp_path / "o2"), "--data.init_args.max_tokenz=1"])
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and "Option 'max_tokenz' is not accepted" in error
    assert not (tmp_path / "o2").exists()
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    with pytest.raises(SystemExit) as exit_info:  # again into the written folder: refused, the folder untouched
        prepare_tokens(["--config", str(config), "--out", str(tmp_path / "out")])
    out = tmp_path / "out"
    assert (
        str(exit_info.value.code)
        == f"error: {out} already exists and is not empty: pass a new --out, or remove {out} first"
    )
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


def _translation(folder: Path) -> Callable[[], TranslationDataModule]:
    """Multi30k's first lines, made awkward: a blank pair, CRLF, a Unicode line separator, NUL bytes, no newline at
    the end."""
    if not MULTI30K.is_dir():
        pytest.skip(f"real data not found at {MULTI30K}")
    for lang in ("en", "de"):
        lines = (MULTI30K / f"train.{lang}").read_text(encoding="utf-8").splitlines()[:300]
        lines[4], lines[9] = ("  " if lang == "en" else lines[4]), lines[9] + "\r"
        lines[12], lines[20] = lines[12].replace(" ", "\u2028", 1), lines[20] + "\0" * (lang == "en")
        (folder / f"train.{lang}").write_text("\n".join(lines), encoding="utf-8")
    return lambda: _module(folder, max_source_tokens=16, max_target_tokens=16)


def _summarization(folder: Path, truncation: str = "warn") -> Callable[[], SummarizationDataModule]:
    """Short stories with a question and one to three references each, and a blank line among them: the third has a
    long summary, the 21st (line 22) is the first long story."""
    words = "the cat sat on a mat and saw dog run über 🙂 tree".split()
    rows = [
        {
            "document": " ".join(words[(i + j) % len(words)] for j in range(3 + (i * 7) % 20 + 40 * (i == 20))),
            "summary": " ".join((words * 3)[: 2 + (i % 4) + 30 * (i == 2)]),
            "summaries": [f"ref {k} of {i}" for k in range(1 + i % 3)],
            "query": f"what does the cat do {i}?",
        }
        for i in range(40)
    ]
    lines = [json.dumps(row, ensure_ascii=i % 2 == 0) for i, row in enumerate(rows)]
    (folder / "train.jsonl").write_text("\n".join(lines[:5] + ["  "] + lines[5:]) + "\n", encoding="utf-8")
    options = {"bpe_vocab_size": 300, "max_source_tokens": 48, "max_target_tokens": 24, "truncation": truncation}
    options |= {"query_field": "query"}
    return lambda: SummarizationDataModule(train_file=str(folder / "train.jsonl"), **options)


@pytest.mark.parametrize("corpus_of", [_translation, _summarization])
def test_prepare_streams_what_the_in_memory_path_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corpus_of: Callable
) -> None:
    """``prepare tokens`` reads, tokenizes and writes the training split a few examples at a time, never the whole
    split (``read_split``): the folder is byte for byte what tokenizing the split in memory writes (the tokenizer
    ``fit`` would train, the ids, truncation, skipped lines, order), with the same warnings, once."""
    module = corpus_of(tmp_path)
    with warnings.catch_warnings(record=True) as said_in_memory:
        warnings.simplefilter("always")
        memory = module()
        examples = memory.dataset("train").examples
        write_pretokenized(
            tmp_path / "memory",
            memory.tokenizer,
            [([e.src_ids for e in examples], [e.tgt_ids or [] for e in examples])],
        )
    streamed, sizes = module(), []
    monkeypatch.setattr(base, "CHUNK", 7)
    monkeypatch.setattr(type(streamed), "read_split", lambda self, split: pytest.fail(f"read the {split} split whole"))
    write = base.write_pretokenized
    monkeypatch.setattr(
        base,
        "write_pretokenized",
        lambda out, tokenizer, rows: write(out, tokenizer, (sizes.append(len(r[0])) or r for r in rows)),
    )
    with warnings.catch_warnings(record=True) as said_streaming:
        warnings.simplefilter("always")
        assert streamed.write_pretokenized(tmp_path / "streamed") == len(examples)
    assert max(sizes) == 7 and len(sizes) == -(-len(examples) // 7)
    assert [str(w.message) for w in said_streaming] == [str(w.message) for w in said_in_memory]
    assert any("truncated" in str(w.message) for w in said_streaming)
    for file in (tmp_path / "memory").iterdir():  # tokenizer.json too: fit trains the same tokenizer from the text
        assert (tmp_path / "streamed" / file.name).read_bytes() == file.read_bytes(), file.name


def test_parts_end_at_a_number_of_examples_or_of_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part of long documents holds fewer examples: its memory is bounded by its text, not its count."""
    monkeypatch.setattr(io, "PART_TEXT", 10)
    parts = io.chunked(["ab", "cdefghijkl", "m", "n", "o", "p"], 3, len)
    assert list(parts) == [["ab", "cdefghijkl"], ["m", "n", "o"], ["p"]]


def _edit(path: Path, edit: Callable[[list[str]], object]) -> None:
    lines = path.read_text(encoding="utf-8").split("\n")
    edit(lines)
    path.write_text("\n".join(lines), encoding="utf-8")


@pytest.mark.filterwarnings("ignore:.*NUL byte")
@pytest.mark.parametrize(
    ("corpus_of", "damage", "problem"),
    [
        (
            _translation,
            lambda f: f.joinpath("train.de").write_bytes(f.joinpath("train.de").read_bytes() + b" \xff"),
            ":300: not UTF-8 (byte 0xff)",
        ),
        (_translation, lambda f: _edit(f / "train.de", lambda lines: lines.pop(50)), "has 300 lines but"),
        (
            _summarization,
            lambda f: _edit(f / "train.jsonl", lambda lines: lines.insert(30, "{}")),
            ":31: no field 'query'",
        ),
        (partial(_summarization, truncation="error"), lambda f: None, ":22: source has"),  # after a long target
    ],
)
def test_prepare_streaming_refuses_bad_input_as_the_in_memory_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corpus_of: Callable, damage: Callable, problem: str
) -> None:
    """The same one-line error, found in a later part of the split (the files checked a few bytes at a time, so that
    multi-byte characters straddle blocks), and no folder."""
    module = corpus_of(tmp_path)
    damage(tmp_path)
    with pytest.raises(DataError) as memory:
        module().dataset("train")
    monkeypatch.setattr(base, "CHUNK", 7)
    monkeypatch.setattr(io, "BLOCK", 5)
    with pytest.raises(DataError) as streamed:
        module().write_pretokenized(tmp_path / "tokens")
    assert str(streamed.value) == str(memory.value) and problem in str(memory.value)
    assert not (tmp_path / "tokens").exists()


CAP = 2_500_000_000  # bytes of address space: a tiny CPU fit needs less, the corpus below is over three times this


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT)
def test_trains_under_an_address_space_cap_the_corpus_exceeds(tmp_path: Path) -> None:
    """``fit`` under ``prlimit --as`` trains on a generated pre-tokenized corpus over three times the cap: nothing maps
    or holds the whole corpus. The token files are sparse (ids of 0, the same read path), so the test writes little."""
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    rows, length = 100_000, 10_000  # 2 x 4 GB of int32 ids, cut to max_source_tokens per example by the collator
    for side in SIDES:
        np.arange(0, (rows + 1) * length, length, dtype=OFFSET).tofile(tokens / f"{side}.offsets")
        with open(tokens / f"{side}.tokens", "wb") as file:
            file.truncate(rows * length * TOKEN.itemsize)
    describe(tokens, Tokenizer.train([f"w{i} v{i}" for i in range(300)], 300), rows)
    assert sum(f.stat().st_size for f in tokens.iterdir()) > 3 * CAP
    args = fit_args(
        tmp_path / "run",
        "--data.init_args.pretokenized", str(tokens),
        "--data.init_args.max_tokens", "256",
        "--data.init_args.max_source_tokens", "32",
        "--data.init_args.max_target_tokens", "32",
        "--trainer.max_steps", "3",
    )  # fmt: skip
    run = subprocess.run(
        ["prlimit", f"--as={CAP}", sys.executable, "cli.py", *args],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in run.stderr
