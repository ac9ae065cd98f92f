"""Fixtures and markers shared by every test module."""

from __future__ import annotations

import gzip
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from torch_handle.model import TransformerConfig

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
"""Stack with ``@pytest.mark.gpu`` on GPU-only tests, as Lightning's ``RunIf(min_cuda_gpus=1)``."""


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2`` in setup.cfg), each worker's own tensors use its share of the cores: two workers
    of two threads each on two cores would spin OpenMP threads against each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """xdist's ``loadgroup`` hands a worker whole groups: a test module is one group (its module fixtures, such as a
    trained run, are built once), except the shipped-config matrix, where each combination of configs is one (its
    steps reuse the combination's run in order, and the combinations are the suite's largest share)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


USER_FOLDERS = ("runs", "data")
"""What a user's own commands leave in the checkout (``torch-handle fit --config demo``, ``torch-handle prepare``):
tests read and write only their temporary folders."""
_USER_FILES = pytest.StashKey[dict[str, tuple[int, int]]]()


def _user_files() -> dict[str, tuple[int, int]]:
    """Size and modification time of every file and folder under :data:`USER_FOLDERS`."""
    root = Path(__file__).resolve().parents[1]
    found = {}
    for folder in USER_FOLDERS:
        for path in (root / folder).rglob("*"):
            stat = path.lstat()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller, or a run without xdist
        session.config.stash[_USER_FILES] = _user_files()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fails the run if a test wrote into, or removed from, the checkout's ``runs/`` or ``data/``."""
    before = session.config.stash.get(_USER_FILES, None)
    if before is None:
        return
    after = _user_files()
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    if changed:
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"tests changed the user's files in the checkout: {', '.join(changed[:10])}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tells :func:`tests.helpers.env` the marks of the test whose fixtures and body run next."""
    from tests import helpers  # not at the top: Lightning imported before pytest captures logs would log around it

    helpers.running_marks = {mark.name for mark in item.iter_markers()}


@pytest.fixture(autouse=True)
def restore_default_dtype_and_seed() -> Iterator[None]:
    """Seed every test the same way and undo any ``torch.set_default_dtype`` it makes."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Run a test on one intra-op thread: tiny tensors gain nothing from more, and on a busy machine
    OpenMP's spinning threads slow small kernels down a hundredfold. Use with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The data sets shared across checkouts (``<workspace>/shared/data``); skips when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data directory {SHARED_DATA} is absent")
    return SHARED_DATA


@dataclass
class CorpusServer:
    """A local stand-in for the corpora's GitHub repositories: ``{url}/{corpus}/`` + a path in the repository;
    ``{url}/cut/{corpus}/...`` sends half of each file and hangs up."""

    url: str
    root: Path
    requests: list[str] = field(default_factory=list)  # paths asked for, in order


@pytest.fixture(scope="session")
def corpus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CorpusServer]:
    """Serves, on 127.0.0.1, the official files ``torch-handle prepare`` downloads, rebuilt from ``../shared/data``.

    Multi30k's train, val and test_2016_flickr are gzipped as the official repository has them (so their
    pinned checksums verify); QMSum's val and SQuALITY's train and dev are rebuilt as official records with only
    the fields the converters read (their bytes differ from the official files, their conversions to the general
    query and plot files do not). The shared data holds one query a meeting and one question a story, so each
    meeting also gets the specific queries and each story the other four questions of :func:`specific_queries`
    and :func:`other_questions`.
    """
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data directory {SHARED_DATA} is absent")
    root = tmp_path_factory.mktemp("corpus_server")
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            data = (SHARED_DATA / "multi30k" / f"{split}.{lang}").read_bytes()
            _put(root / "multi30k" / "data/task1/raw" / f"{split}.{lang}.gz", gzip.compress(data, mtime=0))
    meetings = [
        {
            "general_query_list": [{"query": row["query"], "answer": row["summary"]}],
            "specific_query_list": specific_queries(row),
            "meeting_transcripts": [dict(zip(("speaker", "content"), turn.split(": ", 1), strict=True))
                                    for turn in row["document"].split("\n")],
        }
        for row in _rows(SHARED_DATA / "qmsum" / "val.jsonl")
    ]  # fmt: skip
    _put(root / "qmsum" / "data/ALL/jsonl/val.jsonl", _jsonl(meetings))
    _put(root / "qmsum" / "LICENSE", (SHARED_DATA / "qmsum" / "LICENSE").read_bytes())
    for split in ("train", "dev"):
        stories = [
            {
                "metadata": {"passage_id": row["id"]},
                "document": row["document"],
                "questions": [  # the plot question is number 1, not necessarily first
                    *other_questions(row)[:1],
                    {
                        "question_text": PLOT_QUESTION,
                        "question_number": 1,
                        "responses": [{"response_text": text} for text in row["summaries"]],
                    },
                    *other_questions(row)[1:],
                ],
            }
            for row in _rows(SHARED_DATA / "squality" / f"{split}_plot.jsonl")
        ]
        _put(root / "squality" / "data/v1-3/txt" / f"{split}.jsonl", _jsonl(stories))
    for name, source in (("LICENSE_summaries_CC-BY-4.0", "LICENSE"), ("GUTENBERG_LICENSE", "GUTENBERG_LICENSE")):
        _put(root / "squality" / "data" / source, (SHARED_DATA / "squality" / name).read_bytes())

    server = CorpusServer("", root)

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            server.requests.append(self.path)
            if not self.path.startswith("/cut/"):
                super().do_GET()
                return
            data = (root / self.path.removeprefix("/cut/")).read_bytes()  # a connection lost halfway
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield server
    httpd.shutdown()
    httpd.server_close()
    thread.join()


PLOT_QUESTION = "What is the plot of the story?"


def specific_queries(meeting: dict) -> list[dict]:
    """Two query-focused questions about a QMSum meeting (a row of the shared ``val.jsonl``), in the official
    records' form: each answered by one of the meeting's turns."""
    turns = meeting["document"].split("\n")
    return [
        {"query": f"What did {turn.split(': ', 1)[0]} say in turn {i}?", "answer": turn.split(": ", 1)[1]}
        for i, turn in ((i, turns[i]) for i in (0, len(turns) // 2))
    ]


def other_questions(story: dict) -> list[dict]:
    """SQuALITY's questions 2 to 5 for a story (a row of the shared ``*_plot.jsonl``), in the official records'
    form, each with four responses."""
    return [
        {
            "question_text": f"Question {n} about {story['id']}?",
            "question_number": n,
            "responses": [{"response_text": f"Answer {k} to question {n}."} for k in range(1, 5)],
        }
        for n in (3, 2, 5, 4)  # not in question order
    ]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _put(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def tiny_config(**overrides: Any) -> TransformerConfig:
    """The tiny model the tests build in Python (the sizes of :data:`TINY_MODEL_ARGS`), with ``overrides``."""
    from torch_handle.model import TransformerConfig

    sizes: dict[str, Any] = dict(
        d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=64, dropout=0.0
    )  # fmt: skip
    return TransformerConfig(**(sizes | overrides))


TINY_MODEL_ARGS = [
    "--model.transformer.d_model=32",
    "--model.transformer.num_heads=2",
    "--model.transformer.num_encoder_layers=1",
    "--model.transformer.num_decoder_layers=1",
    "--model.transformer.d_ff=64",
    "--model.transformer.dropout=0.0",
]
"""Command-line overrides that make any config's model tiny, for end-to-end runs in seconds."""


@pytest.fixture(scope="session")
def tiny_demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with ``checkpoints/last.ckpt`` (and its tokenizer) of a tiny model trained for a few steps
    on the built-in demo through ``python cli.py fit``; shared by the CLI, module and notebook tests."""
    from torch_handle.cli import main

    root = tmp_path_factory.mktemp("tiny_demo_run")
    main(
        [
            "fit",
            f"--config={Path(__file__).resolve().parents[1] / 'configs' / 'demo.yaml'}",
            f"--trainer.default_root_dir={root}",
            "--trainer.max_steps=8",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.demo_size=600",
            "--data.init_args.bpe_vocab_size=300",
            "--model.num_beams=2",
            "--model.max_new_tokens=8",
            "--model.generate_every_n_val_epochs=0",
            *TINY_MODEL_ARGS,
        ]
    )
    return root
