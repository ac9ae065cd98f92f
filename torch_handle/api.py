"""Translate and summarize from Python: ``torch_handle.load(path).translate(["a sentence", ...])``.

:func:`load` takes any model a user has: an exported ``.safetensors`` file, a ``.ckpt`` file, a DeepSpeed or FSDP
checkpoint folder, or a run folder (its ``checkpoints/last.ckpt``). Nothing it reads can run code: exports are
safetensors and JSON, checkpoints are checked, then read with ``weights_only=True`` (:mod:`torch_handle.checkpoints`).
Decoding defaults (beams, lengths, the source length) come from the file, as ``cli.py predict`` takes them from the
checkpoint, so the outputs are those ``predict`` writes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_type_hints

import torch

from torch_handle.checkpoints import CheckpointError
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.errors import SetupError
from torch_handle.export import Decoding, empty_model, exported_decoding, is_exported, load_exported
from torch_handle.export.exported import has_type
from torch_handle.hierarchical import fitted_overlap, generate_summaries, summarize, window_tokens
from torch_handle.model import CompiledDecode, Transformer, generate
from torch_handle.model.logits import DecodingControls
from torch_handle.model.steps import cpu_decoding_layout
from torch_handle.pretrained import is_pretrained_folder, load_pretrained
from torch_handle.pretrained.hub import model_path
from torch_handle.pretrained.trained import KINDS, read_trained
from torch_handle.quantize import quantize as quantize_model

log = logging.getLogger(__name__)
_OPTION_TYPES = get_type_hints(Decoding) | get_type_hints(DecodingControls)  # each decoding option's type


class Model:
    """A trained Transformer with its tokenizer and decoding defaults; inputs are batched by length internally.

    Methods take a list of strings and return a list in the same order, or one string for one string.
    Options left as None take the file's defaults (:attr:`decoding`).

    Args:
        model: The Transformer, on the device to decode on.
        tokenizer: The tokenizer it was trained with.
        decoding: Its decoding defaults and source length.
        compile: Decoding on a CPU runs a compiled step with the weights frozen in
            (:class:`~torch_handle.model.CompiledDecode`), for models that no longer train: greedy decoding and beam
            search faster once compiled (see :func:`load`). Without it, on a CPU, the linear weights are stored
            column-major (:func:`~torch_handle.model.steps.cpu_decoding_layout`), faster at decoding's few rows.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, decoding: Decoding, compile: bool = False) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.decoding = decoding
        if compile and self.device.type != "cpu":
            raise SetupError(
                f"compile=True compiles decoding on a CPU, but device={str(self.device)!r}: leave compile off "
                "(on a GPU, decoding replays CUDA graphs already)"
            )
        self._decode = CompiledDecode(self.model) if compile else None
        if not compile and self.device.type == "cpu":  # compiled, Inductor packs the weights its own way
            cpu_decoding_layout(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def translate(
        self,
        texts: str | Sequence[str],
        num_beams: int | None = None,
        batch_size: int = 32,
        max_new_tokens: int | None = None,
        length_penalty: float | None = None,
        **controls: Any,
    ) -> str | list[str]:
        """Outputs for ``texts``; a text longer than the model's source length is cut, as ``predict`` does.

        Args:
            texts: Sentences, or one sentence.
            num_beams: Beam width (1 = greedy).
            batch_size: Texts decoded together, after sorting by length so that little padding is encoded.
            max_new_tokens: Longest output, in tokens.
            length_penalty: Beam-search length normalisation exponent.
            controls: Decoding controls by name, as ``transformers``' ``generate`` takes them:
                ``no_repeat_ngram_size``, ``repetition_penalty``, ``min_new_tokens``, ``do_sample``, ``temperature``,
                ``top_k``, ``top_p``, ``seed`` (:class:`~torch_handle.model.logits.DecodingControls`); the file's
                for those not given.

        Returns:
            One output per text in input order (a string for a string), stripped of surrounding whitespace;
            ``predict`` writes the same text, on one line.
        """
        single, texts = isinstance(texts, str), [texts] if isinstance(texts, str) else list(texts)
        limit = self._source_limit()
        ids = self.tokenizer.encode_batch(texts) if texts else []
        long = sum(len(row) > limit for row in ids)
        if long:
            log.warning("cut %d of %d texts to %d tokens, the model's max_source_tokens", long, len(ids), limit)
        options = self._options(num_beams, max_new_tokens, length_penalty, controls)
        out = self._generate([row[:limit] for row in ids], options, batch_size)
        return out[0] if single else out

    def summarize(
        self,
        documents: str | Sequence[str],
        num_beams: int | None = None,
        batch_size: int = 4,
        max_new_tokens: int | None = None,
        length_penalty: float | None = None,
        overlap: int | None = None,
        **controls: Any,
    ) -> str | list[str]:
        """Summaries of ``documents``; one longer than the model's source length is summarized hierarchically
        (:func:`torch_handle.summarize`: overlapping windows, then their summaries), as ``predict`` does.

        Args:
            documents: Documents, or one document.
            num_beams: Beam width (1 = greedy).
            batch_size: Documents (or windows of one long document) decoded together, sorted by length.
            max_new_tokens: Longest summary, in tokens (also of each window's summary).
            length_penalty: Beam-search length normalisation exponent.
            overlap: Tokens shared by neighbouring windows of a long document.
            controls: Decoding controls by name, as :meth:`translate` takes them; every window's summary uses them.

        Returns:
            One summary per document in input order (a string for a string), as :meth:`translate`.
        """
        single, documents = isinstance(documents, str), [documents] if isinstance(documents, str) else list(documents)
        if overlap is not None and not has_type(overlap, int):
            raise TypeError(f"overlap={overlap!r}: pass an integer number of tokens")
        limit = self._source_limit()
        ids = self.tokenizer.encode_batch(documents) if documents else []
        short = [i for i, row in enumerate(ids) if len(row) <= limit]
        out = [""] * len(ids)
        decoding = self._options(num_beams, max_new_tokens, length_penalty, controls)
        summaries = self._generate([ids[i] for i in short], decoding, batch_size)
        for i, text in zip(short, summaries, strict=True):
            out[i] = text
        options = {**self.decoding.summarize_options(), **decoding}
        window = window_tokens(options["max_source_tokens"], self.tokenizer)
        options["overlap"] = fitted_overlap(options["overlap"], window) if overlap is None else overlap
        for i in (i for i, row in enumerate(ids) if len(row) > limit):
            generate_fn = self._generate_fn(options, pad_to=batch_size)  # windows, then their summaries
            out[i] = summarize(
                self.model, self.tokenizer, documents[i], batch_size=batch_size, generate_fn=generate_fn, **options
            )
        return out[0] if single else out

    def _source_limit(self) -> int:
        """A source's own tokens that fit: the source ends in <eos>, after a pretrained tokenizer's prefix."""
        return self.decoding.max_source_tokens - 1 - len(self.tokenizer.specials.source_prefix)

    def _options(
        self,
        num_beams: int | None,
        max_new_tokens: int | None,
        length_penalty: float | None,
        controls: dict[str, Any],
    ) -> dict[str, Any]:
        """The decoding options, the file's defaults for those left as None or not given, checked against the model."""
        d = self.decoding
        names = {f.name for f in dataclasses.fields(DecodingControls)}
        unknown = sorted(set(controls) - names)
        if unknown:
            raise TypeError(f"unknown decoding options {unknown}: the controls are {sorted(names)}")
        given = {"num_beams": num_beams, "max_new_tokens": max_new_tokens, "length_penalty": length_penalty} | controls
        wrong = [f"{k}={v!r}" for k, v in given.items() if v is not None and not has_type(v, _OPTION_TYPES[k])]
        if wrong:
            raise TypeError(f"decoding options of the wrong type: {', '.join(wrong)}: pass numbers (num_beams=4)")
        options = {
            "num_beams": d.num_beams if num_beams is None else num_beams,
            "max_new_tokens": d.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "length_penalty": d.length_penalty if length_penalty is None else length_penalty,
            "controls": dataclasses.replace(d.controls(), **_sampling_off(controls)),
        }
        context = self.model.config.target_length  # the decoder's positions
        if context is not None and options["max_new_tokens"] + 1 > context:
            raise ValueError(
                f"max_new_tokens={options['max_new_tokens']} does not fit the model's max_len={context} "
                f"(<bos> takes a position): pass max_new_tokens <= {context - 1}"
            )
        return options

    def _generate(self, sources: list[list[int]], options: dict[str, Any], batch_size: int) -> list[str]:
        if not has_type(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if not sources:
            return []
        generate_fn = self._generate_fn(options, pad_to=batch_size if len(sources) > batch_size else None)
        return generate_summaries(
            self.model, self.tokenizer, sources, batch_size=batch_size, generate_fn=generate_fn, **options
        )

    def _generate_fn(
        self, options: dict[str, Any], pad_to: int | None
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``generate`` with the compiled step (``compile=True``); None: the default.

        A batch of fewer than ``pad_to`` rows (a job's last) is filled with copies of its last row, whose outputs are
        dropped: every batch size compiles a step of its own (seconds), and a job then meets one size only.
        """
        if self._decode is None:
            return None
        decode, max_new_tokens = self._decode, int(options["max_new_tokens"])
        num_beams, length_penalty = int(options["num_beams"]), float(options["length_penalty"])
        controls = options["controls"]

        def generate_fn(src: torch.Tensor) -> torch.Tensor:
            rows = src.shape[0]
            if pad_to is not None and rows < pad_to:
                src = torch.cat([src, src[-1:].expand(pad_to - rows, -1)])
            out = generate(self.model, src, max_new_tokens, num_beams, length_penalty, decode=decode, controls=controls)
            return out[:rows]

        return generate_fn


def _sampling_off(controls: dict[str, Any]) -> dict[str, Any]:
    """``do_sample=False`` also turns off the sampling knobs a file's defaults set (a folder's ``top_k`` 50), which
    act only when sampling; those passed beside it still reach the controls' own check."""
    if controls.get("do_sample") is False:
        return {"temperature": 1.0, "top_k": 0, "top_p": 1.0} | controls
    return controls


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    attention_backend: str = "auto",
    compile: bool = False,
    quantize: str | None = None,
) -> Model:
    """The model at ``path``, in evaluation mode on ``device``, ready to translate or summarize.

    Args:
        path: An exported ``.safetensors`` file, a ``.ckpt`` file, a DeepSpeed or FSDP checkpoint folder, a run
            folder (``--trainer.default_root_dir``: its ``checkpoints/last.ckpt`` is loaded), or a Hugging Face model
            folder (BART, mBART, Marian, PEGASUS, T5, mT5, LED: :mod:`torch_handle.pretrained`), with its tokenizer and
            generation config, or its hub id (``Helsinki-NLP/opus-mt-en-de``: fetched once into the Hugging Face cache).
        device: Where to decode: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ... On a GPU greedy decoding and beam search
            replay each step as a CUDA graph (see benchmarks/RESULTS.md, section "bench_peers on a GPU").
        attention_backend: The attention kernel on this machine (``auto`` picks one).
        compile: On a CPU, greedy and beam-search decoding run a step compiled ahead of time by AOTInductor with
            the weights frozen in, after a first call that compiles (seconds; again for a new batch size, not for new
            source lengths). What it gains and costs: see benchmarks/RESULTS.md, sections "Stop 54: the step
            compiled ahead of time by AOTInductor" and "Stop 55: one compiled step per batch size".
        quantize: ``"int8"``: on a CPU, every linear of the model becomes an int8 one (:mod:`torch_handle.quantize`),
            eagerly and, with ``compile``, in the compiled step (``torchao``'s). What it gains and costs: see
            benchmarks/RESULTS.md, section "int8 decoding".

    Raises:
        CheckpointError: ``path`` is missing, damaged, or not a model; the message names the file and the fix.
        SetupError: ``device`` is a CUDA device and this machine has none, ``compile`` with a CUDA device, or
            ``quantize`` with ``compile`` and no ``torchao``.
        ValueError: ``quantize`` is not ``"int8"``, or comes with a device other than the CPU.
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"device={str(device)!r}, but this machine has no CUDA device: pass device='cpu'")
    path = model_path(path, "torch_handle.load")
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: pass {KINDS}")
    if is_pretrained_folder(path):
        model, tokenizer, decoding = load_pretrained(path, attention_backend)
    else:
        model, tokenizer, decoding = _read(path, attention_backend)
    if quantize is not None:
        quantize_model(model.to(device), quantize, compile)
    return Model(model.to(device), tokenizer, decoding, compile)


def _read(path: Path, attention_backend: str) -> tuple[Transformer, Tokenizer, Decoding]:
    """The model, tokenizer and decoding defaults of an export, a checkpoint or a run folder."""
    if is_exported(path):  # filled one tensor at a time
        model, tokenizer = load_exported(path, attention_backend)
        return model, tokenizer, exported_decoding(path, model.config)
    weights, config, tokenizer, decoding = read_trained(path)
    model = empty_model(dataclasses.replace(config, attention_backend=attention_backend))
    model.load_state_dict(weights, strict=True)
    return model, tokenizer, decoding
