"""Marian's (opus-mt's) tokenizer from its sentencepiece files, as ``transformers.MarianTokenizer`` reads them: sources
cut into pieces by ``source.spm``, targets by ``target.spm``, and every piece given its id in ``vocab.json`` (a piece
that file lacks is ``<unk>``), so that ids match the model's embeddings. A model with separate vocabularies
(``separate_vocabs`` in ``tokenizer_config.json``) gives target pieces their ids in ``target_vocab.json``.

Each ``.spm`` file becomes a ``tokenizers`` pipeline through transformers' own converter (the ``pretrained`` extra);
a ``.spm`` file is a protobuf message, parsed as data: a damaged or hostile one is refused in one line.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from torch_handle.data.tokenizer import MAX_TOKEN_ID, Specials, Tokenizer, check_ids, until_eos
from torch_handle.errors import DataError
from torch_handle.jsonfiles import json_object

SOURCE, TARGET, VOCAB, TARGET_VOCAB = "source.spm", "target.spm", "vocab.json", "target_vocab.json"
_AGAIN = "download the model's folder again"
_UNIGRAM = 1  # sentencepiece's TrainerSpec.model_type of a unigram model, opus-mt's


class PieceTokenizer(Tokenizer):
    """Two sentencepiece pipelines (source and target) over ``vocab.json`` (and ``target_vocab.json`` for targets when
    the vocabularies are separate): Marian's tokenizer.

    Pieces are ids through the vocabularies, not the pipelines' own ids, as in ``MarianTokenizer``; a leading language
    code (``>>fr<<``, multilingual opus-mt) is one token.
    """

    def __init__(
        self,
        source: _HFTokenizer,
        target: _HFTokenizer,
        vocab: dict[str, int],
        specials: Specials,
        models: dict[str, bytes],
        target_vocab: dict[str, int] | None = None,
    ) -> None:
        """Use :func:`read_marian` or :meth:`Tokenizer.from_str`.

        Args:
            source: The pipeline that cuts sources into pieces (``source.spm``'s).
            target: The pipeline that cuts targets into pieces (``target.spm``'s); its decoder joins pieces into text.
            vocab: The id of each piece (``vocab.json``); it holds ``<unk>``.
            specials: The model's special tokens.
            models: The bytes of ``source.spm`` and ``target.spm``, which :meth:`write_folder` writes back.
            target_vocab: The id of each target piece (``target_vocab.json``) when the vocabularies are separate.
        """
        for name, table in ((VOCAB, vocab), (TARGET_VOCAB, target_vocab)):
            if table is not None and "<unk>" not in table:
                raise DataError(f"{name} has no <unk>: pass the {name} of the model's folder")
        if target_vocab is not None and vocab.get("</s>") != specials.eos_id:
            raise DataError(
                f"{VOCAB} gives </s> the id {vocab.get('</s>')}, the model ends sources with {specials.eos_id}: "
                "only separate vocabularies that agree on </s> are read"
            )
        super().__init__(source, specials)
        self._target = target
        self.vocab = vocab
        self.target_vocab = target_vocab
        self.models = models
        self.unk_id = vocab["<unk>"]
        targets = vocab if target_vocab is None else target_vocab
        self._target_unk = targets["<unk>"]
        self._pieces = {i: piece for piece, i in targets.items()}
        self._skipped = {specials.pad_id, specials.eos_id, self._target_unk}  # MarianTokenizer's special ids

    @property
    def vocab_size(self) -> int:
        """The target vocabulary's size, the model's output (ids with gaps: the largest + 1)."""
        targets = self.vocab if self.target_vocab is None else self.target_vocab
        return max(len(targets), max(targets.values(), default=-1) + 1)

    @property
    def mask_id(self) -> int | None:
        return None

    def with_mask(self) -> Tokenizer:
        raise DataError("denoising needs a <mask> token, which a Marian tokenizer (source.spm) does not have")

    def to_str(self) -> str:
        return json.dumps(
            {
                "torch_handle_specials": dataclasses.asdict(self.specials),
                "marian": {
                    "source": self.backend.to_str(),
                    "target": self._target.to_str(),
                    "vocab": self.vocab,
                    **({} if self.target_vocab is None else {"target_vocab": self.target_vocab}),
                    "models": {name: base64.b64encode(data).decode("ascii") for name, data in self.models.items()},
                },
            }
        )

    def write_folder(self, out: Path) -> None:
        """Writes the files ``transformers.MarianTokenizer`` reads (``AutoTokenizer.from_pretrained(out)``)."""
        for name, data in self.models.items():
            (out / name).write_bytes(data)
        (out / VOCAB).write_text(json.dumps(self.vocab, ensure_ascii=False, indent=2), encoding="utf-8")
        names = {"pad_token": self.pad_id, "eos_token": self.eos_id, "unk_token": self._target_unk}
        config = {"tokenizer_class": "MarianTokenizer"} | {name: self._pieces[i] for name, i in names.items()}
        if self.target_vocab is not None:
            (out / TARGET_VOCAB).write_text(json.dumps(self.target_vocab, ensure_ascii=False, indent=2), "utf-8")
            config["separate_vocabs"] = True
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")

    @classmethod
    def from_parts(cls, parts: Any, specials: Specials) -> PieceTokenizer:
        """Rebuilds what :meth:`to_str` wrote (``parts``: its ``marian`` object), checking every id."""
        if not isinstance(parts, dict) or not isinstance(parts.get("vocab"), dict):
            raise DataError("not a tokenizer JSON (a marian entry without a vocab)")
        vocab, target_vocab = parts["vocab"], parts.get("target_vocab")
        if target_vocab is not None and not isinstance(target_vocab, dict):
            raise DataError("not a tokenizer JSON (a marian target_vocab that is not an object)")
        for piece, id_ in (vocab | (target_vocab or {})).items():
            if not isinstance(id_, int) or isinstance(id_, bool) or not 0 <= id_ <= MAX_TOKEN_ID:
                raise DataError(f"not a tokenizer JSON (piece {piece!r} has id {id_!r}, outside 0-{MAX_TOKEN_ID})")
        backends = []
        for side in ("source", "target"):
            json_str = parts.get(side)
            if not isinstance(json_str, str):
                raise DataError(f"not a tokenizer JSON (a marian entry without a {side})")
            check_ids(json_str)
            try:
                backends.append(_HFTokenizer.from_str(json_str))
            except Exception as err:  # the Rust binding raises a bare Exception
                raise DataError(f"not a tokenizer JSON ({str(err).splitlines()[0] if str(err) else err!r})") from None
        models = parts.get("models")
        if not isinstance(models, dict) or set(models) != {SOURCE, TARGET}:
            raise DataError(f"not a tokenizer JSON (a marian entry without {SOURCE} and {TARGET})")
        try:
            data = {name: base64.b64decode(text, validate=True) for name, text in models.items()}
        except (TypeError, ValueError) as err:
            raise DataError(f"not a tokenizer JSON (a sentencepiece model that is not base64: {err})") from None
        return cls(*backends, vocab, specials, data, target_vocab)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._ids(self.backend, self.vocab, texts)

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        return self._ids(self._target, self.vocab if self.target_vocab is None else self.target_vocab, texts)

    @staticmethod
    def _ids(backend: _HFTokenizer, vocab: dict[str, int], texts: list[str]) -> list[list[int]]:
        """The ``vocab`` ids of the pieces ``backend`` cuts ``texts`` into, after a leading language code."""
        codes = [text[: text.find("<<") + 2] if text.startswith(">>") and "<<" in text else "" for text in texts]
        rests = [text[len(code) :] for code, text in zip(codes, texts, strict=True)]
        encodings = backend.encode_batch(rests, add_special_tokens=False)
        unk = vocab["<unk>"]
        return [
            [vocab.get(piece, unk) for piece in ([code] if code else []) + encoding.tokens]
            for code, encoding in zip(codes, encodings, strict=True)
        ]

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_batch([ids])[0]

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        rows = [[i for i in until_eos(ids, self.eos_id) if i not in self._skipped] for ids in batch]
        return [self._target.decoder.decode([self._pieces.get(i, "") for i in row]).strip() for row in rows]


def read_marian(folder: Path, specials: Specials) -> PieceTokenizer:
    """The tokenizer of a Marian folder with ``source.spm``, ``target.spm`` and ``vocab.json`` (and
    ``target_vocab.json`` where ``tokenizer_config.json`` says ``separate_vocabs``, as ``MarianTokenizer`` reads it).

    Raises:
        DataError: a missing or damaged file, or no ``transformers`` to convert the sentencepiece models; the message
            names it.
    """
    for name in (SOURCE, TARGET, VOCAB):
        if not (folder / name).is_file():
            raise DataError(f"{folder} has no {name}: download the model's whole folder")
    settings = folder / "tokenizer_config.json"
    separate = settings.is_file() and json_object(settings, DataError, _AGAIN).get("separate_vocabs") is True
    if separate and not (folder / TARGET_VOCAB).is_file():
        raise DataError(f"{folder} has separate vocabularies but no {TARGET_VOCAB}: download the model's whole folder")
    encoded = {name: base64.b64encode((folder / name).read_bytes()).decode("ascii") for name in (SOURCE, TARGET)}
    parts = {"source": _pipeline(folder / SOURCE), "target": _pipeline(folder / TARGET), "models": encoded}
    parts["vocab"] = json_object(folder / VOCAB, DataError, _AGAIN)
    if separate:
        parts["target_vocab"] = json_object(folder / TARGET_VOCAB, DataError, _AGAIN)
    try:
        return PieceTokenizer.from_parts(parts, specials)
    except DataError as err:
        raise DataError(f"{folder / VOCAB}: {err}") from None


def _pipeline(path: Path) -> str:
    """The ``tokenizers`` JSON of the sentencepiece model ``path``, converted as transformers converts it."""
    try:  # transformers' converter follows the model's normalizer settings from 5.24 on
        from google.protobuf.message import DecodeError
        from packaging.version import Version
        from transformers import __version__
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

        if Version(__version__) < Version("5.24"):
            raise ImportError(__version__)
        proto = import_protobuf().ModelProto()
    except ImportError:
        raise DataError(
            f"reading {path.name} needs transformers>=5.24 and sentencepiece: pip install 'torch-handle[pretrained]'"
        ) from None
    try:
        proto.ParseFromString(path.read_bytes())
    except DecodeError as err:
        raise DataError(f"{path} is not a sentencepiece model ({err}): download the model's folder again") from None
    if proto.trainer_spec.model_type != _UNIGRAM or not proto.pieces:
        raise DataError(f"{path} is not a sentencepiece unigram model (opus-mt's): download the model's folder again")
    try:
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, [(p.piece, p.score) for p in proto.pieces])
    except Exception as err:  # the Rust binding raises a bare Exception
        raise DataError(f"{path} is not a usable sentencepiece model ({err}): download the folder again") from None
    return backend.to_str()
