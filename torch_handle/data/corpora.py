"""The corpora ``torch-handle prepare`` fetches: where each file comes from, what it becomes, and its checksum.

Each file is pinned by the sha256 of the bytes *written* (the decompressed Multi30k text, the flattened JSON
lines), computed from the official repositories at the commits below. A pin on what we write, not on what is
served, lets a mirror recompress or re-serialize, lets a later run re-verify the files it finds without
downloading, and covers the conversion too. QMSum's ``train.jsonl`` was too large for the copy of its
repository these pins were computed from, so its pins are order-free: the meeting files in ``data/ALL/train/``
hold the same meetings, but not the order of the lines, which numbers the ids.

Each summarization corpus is written twice from the same official file: ``{split}.jsonl``/``{split}_plot.jsonl``
(one summary a document: QMSum's general query, SQuALITY's plot question) and ``{split}_all.jsonl`` (every
query or question, as SCROLLS poses QMSum and the SQuALITY paper scores SQuALITY).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from torch_handle.commands import typed_command


@dataclass(frozen=True)
class CorpusFile:
    """One file written under ``{out}/{corpus}/``."""

    name: str
    source: str  # its path in the official repository
    sha256: str  # of the bytes written (see :func:`digest`)
    convert: Callable[[bytes], bytes]  # the downloaded bytes -> the bytes written
    split: str | None  # None: a licence, written with any split
    ordered: bool = True


@dataclass(frozen=True)
class Corpus:
    """A corpus: its GitHub repository, pinned to a commit, and the files taken from it."""

    name: str
    repository: str
    commit: str
    files: tuple[CorpusFile, ...] = field(repr=False)

    @property
    def base_url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repository}/{self.commit}/"

    @property
    def splits(self) -> list[str]:
        return list(dict.fromkeys(f.split for f in self.files if f.split is not None))


def digest(data: bytes, ordered: bool = True) -> str:
    """The sha256 a file is pinned by: of its bytes, or for an unordered pin of its JSON lines' sorted sha256s
    with the ``id`` field left out (ids number the lines in file order)."""
    if ordered:
        return hashlib.sha256(data).hexdigest()
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    lines = sorted(hashlib.sha256(_dump({k: v for k, v in row.items() if k != "id"})).hexdigest() for row in rows)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _dump(row: dict) -> bytes:
    return json.dumps(row, ensure_ascii=False).encode("utf-8")


def _records(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line.strip()]


def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(_dump(row) + b"\n" for row in rows)


def qmsum_jsonl(data: bytes, split: str) -> bytes:
    """QMSum meetings -> one line per meeting: ``id, query, document, summary, doc_words``.

    The document is the transcript, one ``speaker: content`` turn per line; the summary answers the meeting's
    general query ("Summarize the whole meeting."); the query-focused questions are left out.
    """
    rows = []
    for i, meeting in enumerate(_records(data)):
        general = meeting["general_query_list"][0]
        document = "\n".join(f"{turn['speaker']}: {turn['content']}" for turn in meeting["meeting_transcripts"])
        rows.append(
            {
                "id": f"qmsum-{split}-{i}",
                "query": general["query"],
                "document": document,
                "summary": general["answer"],
                "doc_words": len(document.split()),
            }
        )
    return _jsonl(rows)


def squality_jsonl(data: bytes) -> bytes:
    """SQuALITY stories -> one line per story: ``id, document, summaries, summary``.

    ``summaries`` holds the four plot summaries (the answers to question 1, "What is the plot of the story?"),
    ``summary`` the first of them; the other questions are left out.
    """
    rows = []
    for story in _records(data):
        plot = [q for q in story["questions"] if q["question_number"] == 1]
        if len(plot) != 1:
            raise ValueError(f"story {story['metadata']['passage_id']} has no plot question")
        summaries = [response["response_text"] for response in plot[0]["responses"]]
        rows.append(
            {"id": story["metadata"]["passage_id"], "document": story["document"], "summaries": summaries}
            | {"summary": summaries[0]}
        )
    return _jsonl(rows)


def qmsum_queries_jsonl(data: bytes, split: str) -> bytes:
    """QMSum meetings -> one line per query, general and specific, as SCROLLS poses QMSum: ``id, query, document,
    summary``, the document being the transcript as in :func:`qmsum_jsonl` and the summary the query's answer."""
    rows = []
    for i, meeting in enumerate(_records(data)):
        document = "\n".join(f"{turn['speaker']}: {turn['content']}" for turn in meeting["meeting_transcripts"])
        queries = [*meeting["general_query_list"], *meeting["specific_query_list"]]
        rows.extend(
            {"id": f"qmsum-{split}-{i}-{j}", "query": q["query"], "document": document, "summary": q["answer"]}
            for j, q in enumerate(queries)
        )
    return _jsonl(rows)


def squality_questions_jsonl(data: bytes) -> bytes:
    """SQuALITY stories -> one line per story and question (five a story, in question order): ``id, query,
    document, summaries, summary``, ``summaries`` holding the question's four references and ``summary`` the
    first."""
    rows = []
    for story in _records(data):
        for question in sorted(story["questions"], key=lambda q: q["question_number"]):
            summaries = [response["response_text"] for response in question["responses"]]
            rows.append(
                {
                    "id": f"{story['metadata']['passage_id']}-{question['question_number']}",
                    "query": question["question_text"],
                    "document": story["document"],
                    "summaries": summaries,
                    "summary": summaries[0],
                }
            )
    return _jsonl(rows)


def _as_is(data: bytes) -> bytes:
    return data


MULTI30K_MAX_BYTES = 4 * 2**20
"""The most a Multi30k file may decompress to: twice its largest official file (``train.de``)."""


class TooLarge(ValueError):
    """A download that decompresses past the size its corpus allows (a gzip bomb, or not the official file)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"decompresses to more than {limit} bytes")
        self.limit = limit


def gunzip(data: bytes, limit: int = MULTI30K_MAX_BYTES) -> bytes:
    """``gzip.decompress`` that stops once the output passes ``limit`` bytes, so a gzip bomb never fills memory.

    Raises:
        TooLarge: The data decompresses to more than ``limit`` bytes.
        EOFError: The data ends before its gzip stream does.
    """
    inflater = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)  # | 16: a gzip header and trailer
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit:
        raise TooLarge(limit)
    if not inflater.eof:
        raise EOFError("compressed data ended before the end-of-stream marker was reached")
    return out


_MULTI30K_SHA256 = {
    "train.en": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    "train.de": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    "val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "test_2016_flickr.en": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
    "test_2016_flickr.de": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
    "test_2017_flickr.en": "ce1450ddc5ab0834502579d77a170849952e15a2938b34cc503bdc25ebb4fb98",
    "test_2017_flickr.de": "c3078bc3b36808bf9d20eb2347ed6137016179ef59ec0d2b9b8ecc3fb2880081",
    "test_2018_flickr.en": "4e585c2dd525911a6ea7730e9d0b516239af3f1b1ffae6a2130223cfb639f25e",
    "test_2018_flickr.de": "39fcc8b3331d76fb42d648d019c6898b0d5e58baac87bc2a0bb93f44ec8db207",
    "test_2017_mscoco.en": "43051fdfa86fd5395182e718a94ca67b1b227b9f7c79596ff0f6b813216981d2",
    "test_2017_mscoco.de": "58277df3c75f92f7145a11b910b553d1cf82c439249d4dc237c899609eafac22",
}

MULTI30K = Corpus(
    "multi30k",
    "multi30k/dataset",
    "a3d2e0d26b56f3846f66a952536ffed4e401d05a",
    tuple(
        CorpusFile(name, f"data/task1/raw/{name}.gz", sha256, gunzip, name.rsplit(".", 1)[0])
        for name, sha256 in _MULTI30K_SHA256.items()
    ),
)

QMSUM = Corpus(
    "qmsum",
    "Yale-LILY/QMSum",
    "83d7768c1f2b4dfeb091385d3dc7e239b8e5bb7e",
    (
        *(
            CorpusFile(
                f"{split}.jsonl",
                f"data/ALL/jsonl/{split}.jsonl",
                sha256,
                partial(qmsum_jsonl, split=split),
                split,
                ordered=split != "train",  # see the module's docstring
            )
            for split, sha256 in (
                ("train", "02914a49b603ceeb3970b532535cae51699fec216f3ebcb0f2a542def1f300fa"),
                ("val", "989ac31b5949bf00fca8106469042182e88cb30c903f756b3bee5eb1b9a2693b"),
                ("test", "760460528617754fdf27278b90e1e2a16bf7016ee1be8c079a3e33083a181f9d"),
            )
        ),
        *(
            CorpusFile(
                f"{split}_all.jsonl",
                f"data/ALL/jsonl/{split}.jsonl",
                sha256,
                partial(qmsum_queries_jsonl, split=split),
                split,
                ordered=split != "train",
            )
            for split, sha256 in (
                ("train", "f6c3071c86cbf78415d205d831856f45378f413b200b3a0a6887ea58270850ad"),
                ("val", "d5563b3c446e4cd31bde0090f0a5875a4129defb720814f863f9f2d7efa786c1"),
                ("test", "1f3a870117bfe702873bee8f5ef3c5f60d3a38143828e9014b6252ee8547539f"),
            )
        ),
        CorpusFile(
            "LICENSE", "LICENSE", "8308d90c6321345cbd4adc8b479ddbece28ddbdca44f3f0b9bf033c3999a4a80", _as_is, None
        ),
    ),
)

SQUALITY = Corpus(
    "squality",
    "nyu-mll/SQuALITY",
    "dc08d4f574639d773bc64ef3ab3527043108fb4e",
    (
        *(
            CorpusFile(f"{split}_plot.jsonl", f"data/v1-3/txt/{split}.jsonl", sha256, squality_jsonl, split)
            for split, sha256 in (
                ("train", "d0cf419a7abfac011a6c4f084a153f661e64bda83429ac0f3901ef1e58ef94f3"),
                ("dev", "0c2cb70859b9a9c96ce12a270ac5c0f880d1ef19f2b44df8f2ff3f9823203348"),
                ("test", "70925caba1fb8aad06b38883b827e77e576a41ed54a8112eab4a1eeac9455305"),
            )
        ),
        *(
            CorpusFile(f"{split}_all.jsonl", f"data/v1-3/txt/{split}.jsonl", sha256, squality_questions_jsonl, split)
            for split, sha256 in (
                ("train", "7dcd01d4cf97bdd19207bf16e120a2d62fbde0502d4fc37b17fa6b64b5cd47e3"),
                ("dev", "b71a9b5b721f955c7dc18aeea7fd3c6eed08eb3c691a311fda0eb40c9f5ce91e"),
                ("test", "a3e38430d9f7af952fa681266be2b21432a3a18a77968927cb909ff3f6e61b65"),
            )
        ),
        CorpusFile(
            "LICENSE_summaries_CC-BY-4.0",
            "data/LICENSE",
            "7e7170e3cebf88a9f60c7b8421418323c09304da1af4d5e90f4da1dc1c8a2661",
            _as_is,
            None,
        ),
        CorpusFile(
            "GUTENBERG_LICENSE",
            "data/GUTENBERG_LICENSE",
            "17e071c01e8610bf3d128f1e228f4946f360ebdea1dc8a5e3b816b1489e65325",
            _as_is,
            None,
        ),
    ),
)

CORPORA = {corpus.name: corpus for corpus in (MULTI30K, QMSUM, SQUALITY)}


def missing(path: str | Path, option: str | None = None) -> str | None:
    """The line for a missing corpus folder or file that ``prepare`` writes, naming the command; else None.

    Args:
        path: The folder (``data/multi30k``) or file (``data/squality/train_plot.jsonl``) that does not exist.
        option: The option that sets the path, offered as the alternative.
    """
    path = Path(path)
    for folder in (path, path.parent):
        corpus = CORPORA.get(folder.name)
        if corpus is not None and (folder == path or path.name in {f.name for f in corpus.files}):
            alternative = f" (or pass {option} PATH)" if option else ""
            prepare = typed_command("prepare")
            return f"{path} does not exist: download it with {prepare} {corpus.name} --out {folder.parent}{alternative}"
    return None
