"""Download a corpus from its official repository, verify it, and write the files the configs read.

  torch-handle prepare multi30k --out data   ->  data/multi30k/{split}.en and {split}.de
  torch-handle prepare qmsum --out data      ->  data/qmsum/{train,val,test}.jsonl (general queries)
                                                 and {train,val,test}_all.jsonl (every query, as SCROLLS)
  torch-handle prepare squality --out data   ->  data/squality/{train,dev,test}_plot.jsonl (plot question)
                                                 and {train,dev,test}_all.jsonl (all five questions)

  torch-handle prepare tokens --config multi30k --out data/multi30k-tokens
                                             ->  the config's training split, tokenized, for
                                                 --data.init_args.pretokenized data/multi30k-tokens

(corpora also through python -m torch_handle.data.prepare), with the corpus's licences. Each file is checked against the
sha256 pinned in torch_handle/data/corpora.py before it is written, and is written whole or not at all; a later
run re-verifies what it finds and downloads only what is missing or wrong, so an interrupted run is simply run
again. Offline, copy the repository's files into a folder (a git clone has them) and pass --mirror FOLDER.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import sys
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from torch_handle.atomic import atomic_path
from torch_handle.commands import typed_command
from torch_handle.data.corpora import CORPORA, Corpus, CorpusFile, TooLarge, digest
from torch_handle.errors import DataError

log = logging.getLogger(__name__)
TIMEOUT = 60  # seconds without a byte before a download is given up


def prepare(corpus: Corpus, out: str | Path, mirror: str | None = None, splits: list[str] | None = None) -> int:
    """Writes the corpus's files for ``splits`` (default: all) into ``{out}/{corpus.name}``; the number downloaded.

    Args:
        corpus: What to fetch.
        out: The folder the corpus's folder goes in.
        mirror: Replaces the official base URL: a URL or a local folder holding the repository's files at
            the same paths (e.g. a ``git clone``).
        splits: The splits to write; a corpus's licences come with any.

    Raises:
        DataError: A download failed, or a file does not match its pinned checksum; nothing is left half-written.
    """
    folder = Path(out) / corpus.name
    files = [f for f in corpus.files if f.split is None or splits is None or f.split in splits]
    todo = [f for f in files if not _verified(folder / f.name, f)]
    if not todo:
        log.info("%s: all %d files present and verified; nothing to download", folder, len(files))
        return 0
    base = corpus.base_url if mirror is None else _base_url(mirror)
    for f in todo:
        url = base + f.source
        content = _convert(f, _download(url, corpus, todo, out), url, folder)
        with atomic_path(folder / f.name) as tmp:
            tmp.write_bytes(content)
        log.info("%s: written from %s (sha256 verified)", folder / f.name, url)
    log.info("%s: %d files downloaded, %d already present and verified", folder, len(todo), len(files) - len(todo))
    return len(todo)


def _verified(path: Path, file: CorpusFile) -> bool:
    if not path.is_file():
        return False
    try:
        if digest(path.read_bytes(), file.ordered) == file.sha256:
            return True
    except ValueError:  # an unordered pin parses JSON lines
        pass
    log.info("%s: does not match its pinned sha256; downloading it again", path)
    return False


def _base_url(mirror: str) -> str:
    base = mirror if "://" in mirror else Path(mirror).resolve().as_uri()
    return base.rstrip("/") + "/"


def _download(url: str, corpus: Corpus, todo: list[CorpusFile], out: str | Path) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        reason = f"HTTP {err.code} {err.reason}"
    except urllib.error.URLError as err:
        reason = str(err.reason)
    except (OSError, http.client.HTTPException) as err:  # timeouts, resets, a body cut short
        reason = str(err) or type(err).__name__
    raise DataError(
        f"cannot download {url} ({reason}); offline? copy {', '.join(f.source for f in todo)} from "
        f"https://github.com/{corpus.repository} (commit {corpus.commit[:7]}; a git clone has them) into a folder, "
        f"keeping those paths, and run {typed_command('prepare')} {corpus.name} --mirror FOLDER --out {out}"
    )


def _convert(file: CorpusFile, data: bytes, url: str, folder: Path) -> bytes:
    """The bytes to write, refused unless they match the pin."""
    try:
        content = file.convert(data)
        actual = digest(content, file.ordered)
    except TooLarge as err:
        raise DataError(
            f"{folder / file.name}: the file from {url} {err}, past any official file; it is corrupt or not the "
            "official file: run the command again, or give --mirror a copy of the official files"
        ) from None
    except (OSError, EOFError, zlib.error, ValueError, KeyError, IndexError, TypeError) as err:  # gzip, JSON, fields
        actual = f"unreadable: {type(err).__name__}"
    if actual != file.sha256:
        raise DataError(
            f"{folder / file.name}: the file from {url} does not match its pinned sha256 ({actual}); it is corrupt "
            "or not the official file: run the command again, or give --mirror a copy of the official files"
        )
    return content


def main(argv: list[str] | None = None) -> None:
    """``torch-handle prepare CORPUS [--out DIR] [--mirror URL] [--splits ...]`` (``prepare tokens`` is
    :func:`torch_handle.cli.prepare_tokens`: it reads ``fit``'s options)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog=typed_command("prepare"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "corpus", choices=sorted(CORPORA), help="the corpus to fetch (or tokens: see prepare tokens --help)"
    )
    parser.add_argument(
        "--out", default="data", help="folder to write CORPUS/ in (default: data, where the shipped configs look)"
    )
    parser.add_argument(
        "--mirror",
        metavar="URL",
        help="replaces the official base URL (https://raw.githubusercontent.com/OWNER/REPO/COMMIT/): a URL or a "
        "local folder holding the repository's files at the same paths, e.g. a git clone",
    )
    splits = "; ".join(f"{name}: {' '.join(corpus.splits)}" for name, corpus in CORPORA.items())
    parser.add_argument("--splits", nargs="+", metavar="SPLIT", help=f"only these splits (default: all; {splits})")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    corpus = CORPORA[options.corpus]
    unknown = sorted(set(options.splits or ()) - set(corpus.splits))
    if unknown:
        raise SystemExit(f"error: --splits {' '.join(unknown)}: {corpus.name} has {', '.join(corpus.splits)}")
    try:
        prepare(corpus, options.out, options.mirror, options.splits)
    except DataError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
