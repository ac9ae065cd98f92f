"""Byte-level BPE tokenizer with the special tokens at fixed ids."""

import dataclasses
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from torch_handle.atomic import atomic_write_text
from torch_handle.errors import DataError

log = logging.getLogger(__name__)

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_WRAPPED = '{"torch_handle_specials"'  # how to_str marks a pretrained tokenizer's JSON
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # in id order
MASK_TOKEN = "<mask>"  # denoising pretraining's (BART's name): added after the last id, so no id moves
_WORD_START_MARKS = frozenset("\u2581" + "".join(chr(256 + byte) for byte in b"\t\n\v\f\r "))
"""A piece's first character when it starts with white space: SentencePiece's ``▁``, and byte-level BPE's stand-ins
for the white-space bytes (GPT-2's byte-to-unicode table maps bytes 0-32 to ``chr(256 + byte)``: ``Ġ`` for a space)."""
MAX_TOKEN_ID = 2**24 - 1  # far above any real vocabulary, far below an id whose table would exhaust memory


@dataclass(frozen=True)
class Specials:
    """Where the special tokens sit, and which a row starts with: ours by default, a pretrained model's otherwise.

    Args:
        pad_id: Padding.
        bos_id: The decoder's start token (a pretrained model's ``decoder_start_token_id``).
        eos_id: The token that ends a source and a target.
        source_prefix: Tokens before a source's own (BART's ``<s>``).
        target_prefix: Tokens between the start token and a target's own (BART's ``<s>`` again).
    """

    pad_id: int = PAD_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    source_prefix: tuple[int, ...] = ()
    target_prefix: tuple[int, ...] = ()


class Tokenizer:
    """Subword BPE from the ``tokenizers`` library, special tokens at fixed ids, or a pretrained model's tokenizer.

    Byte-level pre-tokenization and decoding make ``decode(encode(text)) == text`` for any UTF-8 text
    (umlauts, emoji, newlines, repeated spaces): every byte has a token, so nothing becomes ``<unk>``.
    """

    unk_id: int = UNK_ID

    def __init__(self, backend: _HFTokenizer, specials: Specials | None = None) -> None:
        """Wraps a ``tokenizers.Tokenizer``; use :meth:`train`, :meth:`from_file` or :meth:`from_str`.

        Args:
            backend: A tokenizer whose special tokens sit at ids 0-3 in the order of ``SPECIAL_TOKENS``;
                the model and the collator rely on those ids.
            specials: A pretrained model's special tokens instead (:mod:`torch_handle.pretrained`); ``backend`` is
                then taken as it is.
        """
        if specials is None:
            ids = [backend.token_to_id(token) for token in SPECIAL_TOKENS]
            if ids != list(range(len(SPECIAL_TOKENS))):
                found = ", ".join(f"{t}={i}" for t, i in zip(SPECIAL_TOKENS, ids, strict=True))
                raise DataError(f"tokenizer has special tokens at the wrong ids ({found}); expected 0-3 in that order")
        self._backend = backend
        self.specials = Specials() if specials is None else specials

    @property
    def backend(self) -> _HFTokenizer:
        """The ``tokenizers.Tokenizer`` it wraps."""
        return self._backend

    @property
    def pad_id(self) -> int:
        return self.specials.pad_id

    @property
    def bos_id(self) -> int:
        return self.specials.bos_id

    @property
    def eos_id(self) -> int:
        return self.specials.eos_id

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        """Learns a BPE vocabulary; the same texts and size always give the same tokenizer.

        Args:
            texts: Training text, for translation both languages (one joint vocabulary lets the model tie
                its embeddings).
            vocab_size: Target size including the 4 special tokens and 256 byte tokens; the result can be
                smaller when the text has fewer distinct merges (see :attr:`vocab_size`).
        """
        backend = _HFTokenizer(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        log.info("trained a BPE tokenizer with %d tokens", backend.get_vocab_size())
        return cls(backend)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Loads a tokenizer saved by :meth:`save`.

        Args:
            path: A ``tokenizer.json`` file.
        """
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file {path} not found; pass the path of a saved tokenizer.json")
        try:
            return cls.from_str(path.read_text(encoding="utf-8"))
        except (DataError, UnicodeDecodeError) as err:
            raise DataError(f"{path} is not a torch-handle tokenizer file: {err}") from None

    @classmethod
    def from_str(cls, json_str: str) -> "Tokenizer":
        """Rebuilds a tokenizer from :meth:`to_str` output (as stored in checkpoints).

        Args:
            json_str: The tokenizer's JSON serialization.
        """
        specials = None
        if json_str.startswith(_WRAPPED):  # a pretrained tokenizer's, with its special tokens
            try:
                wrapped = json.loads(json_str)
                fields = wrapped["torch_handle_specials"]
                specials = Specials(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
                if "marian" in wrapped:  # sentencepiece files with a vocab.json (torch_handle.data.marian)
                    from torch_handle.data.marian import PieceTokenizer

                    return PieceTokenizer.from_parts(wrapped["marian"], specials)
                json_str = wrapped["tokenizer"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"not a tokenizer JSON ({err})") from None
        check_ids(json_str)
        try:
            backend = _HFTokenizer.from_str(json_str)
        except Exception as err:  # the Rust binding raises a bare Exception
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(f"not a tokenizer JSON ({reason})") from None
        return cls(backend, specials)

    def to_str(self) -> str:
        """The JSON serialization, from which :meth:`from_str` rebuilds an identical tokenizer: the ``tokenizers``
        JSON, wrapped with the special tokens where they are a pretrained model's."""
        if self.specials == Specials():
            return self._backend.to_str()
        specials = dataclasses.asdict(self.specials)
        return json.dumps({"torch_handle_specials": specials, "tokenizer": self._backend.to_str()})

    def save(self, path: str | Path) -> None:
        """Writes the tokenizer JSON atomically, so a crash never leaves a half-written file.

        Args:
            path: Destination file; its folder is created if needed.
        """
        atomic_write_text(path, self.to_str())

    def with_mask(self) -> "Tokenizer":
        """This tokenizer with a :data:`MASK_TOKEN`: itself if it has one (BART's), else a copy with one more id."""
        if self._backend.token_to_id(MASK_TOKEN) is not None:
            return self
        copy = Tokenizer.from_str(self.to_str())
        copy.backend.add_special_tokens([MASK_TOKEN])
        if self._backend.id_to_token(copy.mask_id) is not None:  # ids with gaps: the count is a used id
            raise DataError(
                f"the tokenizer's ids have gaps, so {MASK_TOKEN} would take id {copy.mask_id} of "
                f"{self._backend.id_to_token(copy.mask_id)!r}: add {MASK_TOKEN} to its tokenizer.json yourself"
            )
        return copy

    @property
    def mask_id(self) -> int | None:
        """The id of :data:`MASK_TOKEN`; None without one (see :meth:`with_mask`)."""
        return self._backend.token_to_id(MASK_TOKEN)

    def word_starts(self) -> tuple[bool, ...]:
        """Whether each id's piece starts a word (whole-word masking): a byte-level or SentencePiece piece that starts
        with white space (``Ġ``, ``Ċ``, ``▁``), a WordPiece piece without its ``##``, and every special token, as
        fairseq's ``get_whole_word_mask`` reads them (which, for GPT-2's pieces, counts a leading space only)."""
        prefix = getattr(self._backend.model, "continuing_subword_prefix", None)
        added = self._backend.get_added_tokens_decoder()

        def starts(id_: int) -> bool:
            piece = self._backend.id_to_token(id_)
            if id_ in added or not piece:
                return True
            return not piece.startswith(prefix) if prefix else piece[0] in _WORD_START_MARKS

        return tuple(starts(id_) for id_ in range(self.vocab_size))

    def ordinary_ids(self) -> list[int]:
        """The ids of every piece but the special and added tokens: what a random replacement is drawn from."""
        added = self._backend.get_added_tokens_decoder()
        return [id_ for id_ in range(self.vocab_size) if id_ not in added and self._backend.id_to_token(id_)]

    @property
    def vocab_size(self) -> int:
        """The model's embedding size, special tokens included: the largest id + 1, which is more than the number of
        tokens when the ids have gaps (a hand-edited or converted ``tokenizer.json``)."""
        ids = self._backend.get_vocab(with_added_tokens=True).values()
        return max(self._backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens (the collator adds ``<bos>``/``<eos>``)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once, in parallel in the Rust library."""
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of target texts: as :meth:`encode_batch` (Marian's tokenizer cuts targets with their own model)."""
        return self.encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, stopping at the first ``<eos>`` and dropping the other special tokens.

        Args:
            ids: Token ids, e.g. one row of generated output (a list or a 1-D tensor).
        """
        return self._backend.decode(until_eos(ids, self.eos_id), skip_special_tokens=True)

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        """Text of each row in ``batch``, as :meth:`decode`.

        Args:
            batch: Rows of token ids (a list of lists or a 2-D tensor).
        """
        return self._backend.decode_batch([until_eos(ids, self.eos_id) for ids in batch], skip_special_tokens=True)


def check_ids(json_str: str) -> None:
    """Refuses token ids past :data:`MAX_TOKEN_ID`: the Rust library sizes a table by the largest id, and one id of
    1.5e9 would abort the process allocating it. Gaps in the ids and repeated pieces are the library's to accept."""
    try:
        data = json.loads(json_str)
    except json.JSONDecodeError as err:
        raise DataError(f"not a tokenizer JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(data, dict):
        raise DataError(f"not a tokenizer JSON (a {type(data).__name__}, not an object)")
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = data.get("added_tokens")
    ids = list(vocab.items()) if isinstance(vocab, dict) else []  # a Unigram list's ids are its positions
    if isinstance(added, list):
        ids += [(token.get("content"), token.get("id")) for token in added if isinstance(token, dict)]
    for token, id_ in ids:
        if not isinstance(id_, int) or isinstance(id_, bool) or not 0 <= id_ <= MAX_TOKEN_ID:
            raise DataError(f"not a tokenizer JSON (token {token!r} has id {id_!r}, outside 0-{MAX_TOKEN_ID})")


def until_eos(ids: Sequence[int], eos_id: int) -> list[int]:
    """Plain ints up to (excluding) the first ``<eos>``; accepts tensors through ``tolist``."""
    values = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
    return values[: values.index(eos_id)] if eos_id in values else values


def read_tokenizer(folder: Path, specials: Specials) -> Tokenizer:
    """The folder's ``tokenizer.json``, with the model's special tokens and the prefix its post-processor adds; else
    Marian's sentencepiece files (:mod:`torch_handle.data.marian`)."""
    path = folder / "tokenizer.json"
    if not path.is_file() and (folder / "source.spm").is_file():
        from torch_handle.data.marian import read_marian

        return read_marian(folder, specials)
    if not path.is_file():
        raise DataError(
            f"{folder} has no tokenizer.json: save a fast tokenizer there "
            "(transformers.AutoTokenizer.from_pretrained(FOLDER).save_pretrained(FOLDER))"
        )
    try:
        json_str = path.read_text(encoding="utf-8")
        check_ids(json_str)
        backend = _HFTokenizer.from_str(json_str)
    except DataError as err:
        raise DataError(f"{path} is not a tokenizer: {err}") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not a tokenizer (not UTF-8 text: {err})") from None
    except Exception as err:  # the Rust binding raises a bare Exception
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{path} is not a tokenizer ({reason})") from None
    wrapped = backend.encode("", add_special_tokens=True).ids  # e.g. BART's [<s>, </s>], Marian's [</s>]
    prefix = tuple(wrapped[: wrapped.index(specials.eos_id)] if specials.eos_id in wrapped else wrapped)
    return Tokenizer(backend, Specials(specials.pad_id, specials.bos_id, specials.eos_id, prefix, prefix))


def pretrained_tokenizer(folder: Path) -> Tokenizer:
    """A Hugging Face model folder's tokenizer with its model's special tokens: ``config.json``'s pad token, and the
    decoder's start and end tokens (``generation_config.json`` before ``config.json``, as transformers reads them)."""
    settings = {}
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            try:
                settings |= json.loads((folder / name).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise DataError(f"{folder / name} is not JSON ({err}): pass a folder save_pretrained wrote") from None
    try:
        start = settings.get("decoder_start_token_id", settings["pad_token_id"])  # T5's folders omit it: padding
        specials = Specials(settings["pad_token_id"], start, settings["eos_token_id"])
    except KeyError as err:
        raise DataError(f"{folder}: config.json lacks {err}: pass a folder save_pretrained wrote") from None
    return read_tokenizer(folder, specials)
