"""``torch-handle prepare``: corpora from a local stand-in of their repositories, verified, resumable, trained on.

No test touches the network: ``corpus_server`` (conftest) serves files rebuilt from ``../shared/data``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import math
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PLOT_QUESTION, SHARED_DATA, CorpusServer, other_questions, specific_queries

from tests.helpers import RUN_TIMEOUT, env, fit_args, free_port, train_losses
from torch_handle.cli import main as cli_main
from torch_handle.data import corpora
from torch_handle.data.prepare import main

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ["train", "val", "test_2016_flickr"]  # the Multi30k splits the shared data (and the server) have
FILES = [f"{split}.{lang}" for split in SPLITS for lang in ("en", "de")]


def _prepare(tmp_path: Path, mirror: str, *args: str, out: Path | None = None) -> Path:
    out = out or tmp_path / "data"
    main(["multi30k", "--mirror", mirror, "--out", str(out), *args])
    return out / "multi30k"


def _error(exit_info: pytest.ExceptionInfo[SystemExit]) -> str:
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.mark.slow
def test_prepare_multi30k_then_fit_from_its_folder(
    corpus_server: CorpusServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The README's steps: ``prepare`` writes the official files, a second run downloads nothing, ``fit`` trains."""
    mirror = f"{corpus_server.url}/multi30k"
    prepared = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "prepare", "multi30k", "--mirror", mirror, "--out", "data"]
        + ["--splits", *SPLITS],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert prepared.returncode == 0, prepared.stderr
    folder = tmp_path / "data" / "multi30k"
    assert sorted(path.name for path in folder.iterdir()) == sorted(FILES)  # no temporary file left behind
    for name in FILES:
        assert (folder / name).read_bytes() == (SHARED_DATA / "multi30k" / name).read_bytes(), name

    corpus_server.requests.clear()
    with caplog.at_level(logging.INFO):
        _prepare(tmp_path, mirror, "--splits", *SPLITS)
    assert corpus_server.requests == []
    assert f"{folder}: all 6 files present and verified; nothing to download" in caplog.messages

    run = tmp_path / "run"
    args = fit_args(run, "--trainer.max_steps", "2", "--trainer.logger", "true")  # the config logs learning rates
    args[1:1] = ["--config", "multi30k"]  # the shipped config by name, its data_dir data/multi30k; then tiny sizes
    fit = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    losses = train_losses(run)
    assert list(losses) == [0, 1] and all(math.isfinite(loss) for loss in losses.values())


def test_a_gzip_bomb_is_refused_before_it_fills_memory(tmp_path: Path) -> None:
    served = tmp_path / "served" / "data/task1/raw"
    served.mkdir(parents=True)
    (served / "val.en.gz").write_bytes(gzip.compress(bytes(64 * 2**20)))  # 64 MiB of zeros, 64 KB gzipped
    tracemalloc.start()
    try:
        with pytest.raises(SystemExit) as exit_info:
            _prepare(tmp_path, str(tmp_path / "served"), "--splits", "val")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _error(exit_info) == (
        f"error: {tmp_path}/data/multi30k/val.en: the file from {(served / 'val.en.gz').as_uri()} decompresses to "
        f"more than {corpora.MULTI30K_MAX_BYTES} bytes, past any official file; it is corrupt or not the official "
        "file: run the command again, or give --mirror a copy of the official files"
    )
    assert peak < 4 * corpora.MULTI30K_MAX_BYTES  # a bounded buffer, never the whole 64 MiB
    assert not (tmp_path / "data" / "multi30k" / "val.en").exists()


def test_a_corrupt_or_wrong_file_is_refused_and_nothing_is_written(corpus_server: CorpusServer, tmp_path: Path) -> None:
    served = tmp_path / "served" / "data/task1/raw"
    served.mkdir(parents=True)
    official = (corpus_server.root / "multi30k/data/task1/raw/val.en.gz").read_bytes()
    cases = {
        "truncated": (official[: len(official) // 2], "unreadable: EOFError"),
        "another file": (gzip.compress(b"a caption\n"), corpora.digest(b"a caption\n")),
    }
    for case, (data, actual) in cases.items():
        (served / "val.en.gz").write_bytes(data)
        out = tmp_path / case
        with pytest.raises(SystemExit) as exit_info:
            _prepare(tmp_path, str(tmp_path / "served"), "--splits", "val", out=out)
        url = (served / "val.en.gz").as_uri()
        assert _error(exit_info) == (
            f"error: {out}/multi30k/val.en: the file from {url} does not match its pinned sha256 ({actual}); it is "
            "corrupt or not the official file: run the command again, or give --mirror a copy of the official files"
        ), case
        assert not out.exists() or not any(out.rglob("*")), case


def test_an_unreachable_server_is_one_line_naming_the_url_and_the_files(tmp_path: Path) -> None:
    mirror = f"http://127.0.0.1:{free_port()}/multi30k"  # nothing listens there
    with pytest.raises(SystemExit) as exit_info:
        _prepare(tmp_path, mirror, "--splits", "val")
    message = _error(exit_info)
    assert message.startswith(f"error: cannot download {mirror}/data/task1/raw/val.en.gz (")
    assert message.endswith(
        "offline? copy data/task1/raw/val.en.gz, data/task1/raw/val.de.gz from https://github.com/multi30k/dataset "
        "(commit a3d2e0d; a git clone has them) into a folder, keeping those paths, and run torch-handle prepare "
        f"multi30k --mirror FOLDER --out {tmp_path / 'data'}"
    )
    assert not (tmp_path / "data").exists()


def test_an_interrupted_run_keeps_what_it_verified_and_the_next_fetches_the_rest(
    corpus_server: CorpusServer, tmp_path: Path
) -> None:
    cut = f"{corpus_server.url}/cut/multi30k"  # the connection drops halfway through the first file
    with pytest.raises(SystemExit) as exit_info:
        _prepare(tmp_path, cut, "--splits", "val")
    assert _error(exit_info).startswith(f"error: cannot download {cut}/data/task1/raw/val.en.gz (IncompleteRead(")
    assert not (tmp_path / "data").exists()

    partial = tmp_path / "partial" / "data/task1/raw"  # a mirror that fails after val.en
    partial.mkdir(parents=True)
    (partial / "val.en.gz").write_bytes((corpus_server.root / "multi30k/data/task1/raw/val.en.gz").read_bytes())
    with pytest.raises(SystemExit) as exit_info:
        _prepare(tmp_path, str(tmp_path / "partial"), "--splits", "val")
    assert _error(exit_info).startswith(f"error: cannot download {(partial / 'val.de.gz').as_uri()} (")
    folder = tmp_path / "data" / "multi30k"
    assert [path.name for path in folder.iterdir()] == ["val.en"]  # verified and kept; no temporary file

    (folder / "val.en").write_bytes(b"edited\n")  # a file that no longer verifies is fetched again
    corpus_server.requests.clear()
    _prepare(tmp_path, f"{corpus_server.url}/multi30k", "--splits", "val")
    assert corpus_server.requests == ["/multi30k/data/task1/raw/val.en.gz", "/multi30k/data/task1/raw/val.de.gz"]
    for name in ("val.en", "val.de"):
        assert (folder / name).read_bytes() == (SHARED_DATA / "multi30k" / name).read_bytes()


def _qmsum_queries(split: str) -> list[dict]:
    """Every query of each shared meeting as SCROLLS poses QMSum: the general query, then the specific ones."""
    rows = []
    for i, meeting in enumerate(_shared_rows("qmsum", f"{split}.jsonl")):
        queries = [(meeting["query"], meeting["summary"])] + [
            (q["query"], q["answer"]) for q in specific_queries(meeting)
        ]
        rows += [
            {"id": f"qmsum-{split}-{i}-{j}", "query": query, "document": meeting["document"], "summary": answer}
            for j, (query, answer) in enumerate(queries)
        ]
    return rows


def _squality_questions(split: str) -> list[dict]:
    """Each shared story's five questions in question order, each with its four references."""
    rows = []
    for story in _shared_rows("squality", f"{split}_plot.jsonl"):
        questions = [(1, PLOT_QUESTION, story["summaries"])] + sorted(
            (q["question_number"], q["question_text"], [r["response_text"] for r in q["responses"]])
            for q in other_questions(story)
        )
        rows += [
            {"id": f"{story['id']}-{n}", "query": text, "document": story["document"], "summaries": refs}
            | {"summary": refs[0]}
            for n, text, refs in questions
        ]
    return rows


def _shared_rows(corpus: str, name: str) -> list[dict]:
    return [json.loads(line) for line in (SHARED_DATA / corpus / name).read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize(
    ("corpus", "splits", "names", "queries"),
    [
        ("qmsum", ["val"], ["val.jsonl", "LICENSE"], _qmsum_queries),
        ("squality", ["train", "dev"], ["train_plot.jsonl", "dev_plot.jsonl", "LICENSE_summaries_CC-BY-4.0"],
         _squality_questions),
    ],
)  # fmt: skip
def test_summarization_corpora_are_flattened_to_the_json_lines_the_datamodule_reads(
    corpus: str,
    splits: list[str],
    names: list[str],
    queries: Callable[[str], list[dict]],
    corpus_server: CorpusServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The served records hold only the fields the converters read, so their conversions are pinned here: the one
    # summary a document by the shared files' checksums, every query by its conversion's; the licences are served
    # as the official bytes and keep their real pins.
    official = corpora.CORPORA[corpus]
    expected = {name: (SHARED_DATA / corpus / name).read_bytes() for name in names}
    files = []
    for f in official.files:
        if f.name in expected and f.name.endswith(".jsonl"):
            f = dataclasses.replace(f, sha256=corpora.digest(expected[f.name]))
        elif f.name.endswith("_all.jsonl") and f.split in splits:
            served = (corpus_server.root / corpus / f.source).read_bytes()
            f = dataclasses.replace(f, sha256=corpora.digest(f.convert(served), f.ordered))
        files.append(f)
    monkeypatch.setitem(corpora.CORPORA, corpus, dataclasses.replace(official, files=tuple(files)))
    main([corpus, "--mirror", f"{corpus_server.url}/{corpus}", "--out", str(tmp_path), "--splits", *splits])
    for name in names:
        assert (tmp_path / corpus / name).read_bytes() == expected[name], name
    for split in splits:  # every query (general, then specific) or question (in order) with its references
        written = (tmp_path / corpus / f"{split}_all.jsonl").read_text(encoding="utf-8").splitlines()
        want = queries(split)
        documents = _shared_rows(corpus, f"{split}.jsonl" if corpus == "qmsum" else f"{split}_plot.jsonl")
        assert len(want) == (3 if corpus == "qmsum" else 5) * len(documents)  # each meeting's 3 queries, story's 5
        assert [json.loads(line) for line in written] == want, split


def test_the_pinned_multi30k_checksums_are_those_of_the_shared_files() -> None:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data directory {SHARED_DATA} is absent")
    pinned = {f.name: f.sha256 for f in corpora.MULTI30K.files}
    for name in FILES:
        assert corpora.digest((SHARED_DATA / "multi30k" / name).read_bytes()) == pinned[name], name


def test_an_unordered_pin_ignores_line_order_and_ids_but_not_content() -> None:
    lines = [b'{"id": "a-0", "text": "one"}\n', b'{"id": "a-1", "text": "two"}\n']
    renumbered = [b'{"id": "a-0", "text": "two"}\n', b'{"id": "a-1", "text": "one"}\n']
    pin = corpora.digest(b"".join(lines), ordered=False)
    assert corpora.digest(b"".join(renumbered), ordered=False) == pin
    assert corpora.digest(b"".join(lines[:1]), ordered=False) != pin
    assert corpora.digest(b"".join(renumbered), ordered=True) != corpora.digest(b"".join(lines), ordered=True)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            "multi30k",
            "error: data/multi30k does not exist: download it with torch-handle prepare multi30k --out data "
            "(or pass --data.init_args.data_dir PATH)",
        ),
        (
            "summarization",
            "error: data/squality/train_plot.jsonl does not exist: download it with torch-handle prepare squality "
            "--out data (or pass --data.init_args.train_file PATH)",
        ),
    ],
    ids=["multi30k", "summarization"],
)
def test_a_missing_data_folder_names_the_prepare_command(
    config: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["torch-handle"])  # LightningCLI warns when given args beside pytest's argv
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", config, f"--trainer.default_root_dir={tmp_path}"])
    assert _error(exit_info) == expected


def test_a_missing_corpus_file_names_the_prepare_command_and_other_paths_do_not() -> None:
    assert corpora.missing("data/multi30k/test_2017_mscoco.de", "--data.init_args.data_dir") == (
        "data/multi30k/test_2017_mscoco.de does not exist: download it with torch-handle prepare multi30k --out data "
        "(or pass --data.init_args.data_dir PATH)"
    )
    assert corpora.missing("/srv/corpora/squality") == (
        "/srv/corpora/squality does not exist: download it with torch-handle prepare squality --out /srv/corpora"
    )
    assert corpora.missing("data/multi30k/notes.txt") is None  # not a file prepare writes
    assert corpora.missing("data/my_corpus") is None
