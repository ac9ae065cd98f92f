"""Two processes summarize documents of mixed lengths in lockstep, and write what one process writes.

A document longer than the context is summarized hierarchically, in a number of ``generate`` calls that
depends on its length and on what the model writes; a batch of short documents takes one. Every rank must
still issue the same collectives and forward passes (ZeRO-3 gathers parameters in each), or DDP fails with
a collective mismatch (which gloo reports under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``; without it, mismatched
collectives of equal sizes pass silently) and ZeRO-3 hangs: each run has a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from tests.helpers import STRATEGY_CONFIGS, TINY_MODEL, check, cli
from tests.one_process import in_this_process
from torch_handle.export import export, load_exported
from torch_handle.model import CompiledDecode, Transformer, TransformerConfig
from torch_handle.model.generation import generate
from torch_handle.model.logits import DecodingControls

WORDS = [f"{a}{b}{c}" for a in "bdgkmpst" for b in "aeiou" for c in "lnr"]
MODEL = [
    *TINY_MODEL,
    "--model.transformer.dropout", "0",
    "--model.transformer.max_len", "64",
]  # fmt: skip
COMMON = [
    "--trainer.accelerator", "cpu",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--trainer.logger", "false",
    "--model.task", "summarization",
    "--model.max_new_tokens", "8",
    "--data", "torch_handle.data.SummarizationDataModule",
    "--data.init_args.max_source_tokens", "24",  # the context: long documents take several windows and levels
    "--data.init_args.max_target_tokens", "16",
    "--data.init_args.max_tokens", "64",  # two long or four short documents per batch
]  # fmt: skip


def _documents(rng: random.Random, count: int, words: tuple[int, int]) -> list[dict[str, str]]:
    return [
        {"document": " ".join(rng.choices(WORDS, k=rng.randint(*words))), "summary": " ".join(rng.choices(WORDS, k=4))}
        for _ in range(count)
    ]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class OutputRecorder(Callback):
    """Writes ``{document: output}`` of the counted test batches to ``{default_root_dir}/outputs.rank{R}.json``.

    Args:
        plain: Also decode every batch a second time without decoding controls (their defaults change nothing),
            in the same lockstep, into ``plain.rank{R}.json``: one launch decodes as configured and plainly.
    """

    def __init__(self, plain: bool = False) -> None:
        self.plain = plain

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.outputs: dict[str, dict[str, Any]] = {
            "outputs": {"long": 0},
            **({"plain": {"long": 0}} if self.plain else {}),
        }
        decode = pl_module.decode_batch

        def record(name: str, batch: dict[str, Any], texts: list[str]) -> None:
            if not batch["repeat"]:
                self.outputs[name].update(zip(batch["src_text"], texts, strict=True))
                self.outputs[name]["long"] += sum(batch["src_truncated"])

        def recording(batch: dict[str, Any], memory: Tensor | None = None) -> list[str]:
            texts = decode(batch, memory)
            record("outputs", batch, texts)
            if self.plain:
                configured, pl_module._loop_controls = pl_module._loop_controls, DecodingControls()
                try:
                    record("plain", batch, decode(batch, memory))
                finally:
                    pl_module._loop_controls = configured
            return texts

        pl_module.decode_batch = recording

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        root = Path(trainer.default_root_dir)
        root.mkdir(parents=True, exist_ok=True)  # evaluation writes nothing else there
        for name, outputs in self.outputs.items():
            (root / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(outputs))


class EndsEarly(Callback):
    """Fault injection into ``test``'s decoding: every beam of a real call writes EOS from its third token on (the call
    ends early), and the dummy calls of ``_wait_for_other_ranks`` never write EOS, so the other processes stop a dummy
    beam search before it holds a finished hypothesis (one process's decoding is the same with or without peers)."""

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model, wait, eos = pl_module.model, pl_module._wait_for_other_ranks, pl_module.config.eos_id
        decode, dummy = model.decode, [False]

        def waiting() -> None:
            dummy[0] = True
            wait()
            dummy[0] = False

        def decode_ending_early(tgt: Tensor, memory: Tensor, padding: Tensor, cache: Any = None, **kw: Any) -> Tensor:
            logits = decode(tgt, memory, padding, cache, **kw)
            if cache is None:  # the loss
                return logits
            cache.steps = getattr(cache, "steps", 0) + 1
            if dummy[0]:
                logits[..., eos] = float("-inf")
            elif cache.steps > 2:
                logits[..., eos] = logits.max() + 1
            return logits

        pl_module._wait_for_other_ranks, model.decode = waiting, decode_ending_early


ONE_PROCESS = ("--trainer.devices", "1")  # such a run needs no launch: tests.one_process.in_this_process


@pytest.fixture(scope="module")
def summarizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny summarizer exported after one training step, and a test set of 4 short and 2 long documents: one
    batch of each, so one rank decodes only short documents and the other only long ones."""
    return _summarizer(tmp_path_factory.mktemp("lockstep"))


def _summarizer(root: Path, *options: str) -> tuple[Path, Path]:
    """:func:`summarizer`'s model, with ``options`` added to its ``fit``, in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train = _write_jsonl(root / "train.jsonl", _documents(rng, 12, (5, 60)))
    test = _write_jsonl(root / "test.jsonl", _documents(rng, 4, (2, 4)) + _documents(rng, 2, (40, 90)))
    args = [
        "fit", *MODEL, *COMMON,
        *ONE_PROCESS,
        "--trainer.max_steps", "1",
        "--trainer.limit_val_batches", "0",
        "--data.init_args.train_file", str(train),
        "--data.init_args.bpe_vocab_size", "300",
        *options,
    ]  # fmt: skip
    in_this_process(args, root / "fit")
    return export(root / "fit" / "checkpoints" / "last.ckpt", root / "model.safetensors"), test


Recorded = dict[str, tuple[dict[str, str], int]]  # outputs, plain -> ({document: output}, long documents)
RECORDER = "--trainer.callbacks+=tests.test_lockstep_decoding.OutputRecorder"
PLAIN_TOO = (
    '--trainer.callbacks+={"class_path": "tests.test_lockstep_decoding.OutputRecorder", "init_args": {"plain": true}}'
)


def _test_outputs(model: Path, test: Path, root: Path, *strategy: str, recorder: str = RECORDER) -> Recorded:
    """What :class:`OutputRecorder` recorded (``outputs``, and ``plain`` if asked) over the ranks of a ``test`` run,
    launched, or in this process if ``strategy`` starts with :data:`ONE_PROCESS`: ``{document: output}`` and the number
    of long documents."""
    args = [
        "test", *COMMON, *strategy,
        "--ckpt_path", str(model),
        "--trainer.default_root_dir", str(root),
        recorder,
        "--data.init_args.test_file", str(test),
        "--model.num_beams", "2",
        "--model.chunk_overlap", "4",
    ]  # fmt: skip
    if strategy[:2] == ONE_PROCESS:
        in_this_process(args, root)
    else:  # DETAIL checks that every rank issues the same collective with the same shapes, or fails naming both
        check(cli(args, TORCH_DISTRIBUTED_DEBUG="DETAIL"))
    recorded = {}
    for name in ("outputs", "plain"):
        outputs: dict[str, str] = {}
        long = 0
        for path in sorted(root.glob(f"{name}.rank*.json")):
            rank = json.loads(path.read_text())
            long += rank.pop("long")
            assert not rank.keys() & outputs.keys(), "no document is decoded by two ranks"
            outputs |= rank
        recorded[name] = outputs, long
    return recorded


@pytest.fixture(scope="module")
def decoded(summarizer: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Recorded]:
    """:func:`_test_outputs` of the summarizer with given options and recorder, each run once in the module: the
    one-process reference that several tests compare with, and a launch that records what several tests check."""
    runs: dict[tuple[str, ...], Recorded] = {}

    def run(*options: str, recorder: str = RECORDER) -> Recorded:
        key = (*options, recorder)
        if key not in runs:
            runs[key] = _test_outputs(*summarizer, tmp_path_factory.mktemp("decoded"), *options, recorder=recorder)
        return runs[key]

    return run


# Sampling with a seed, and the other controls: a document's sample depends on the seed and the document alone, not
# on the rank or the batch (the one process decodes batches of other sizes below).
SAMPLING = [
    "--model.do_sample", "true",
    "--model.seed", "5",
    "--model.top_k", "20",
    "--model.no_repeat_ngram_size", "2",
    "--model.min_new_tokens", "3",
    "--model.repetition_penalty", "1.2",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "controls"), [("ddp", []), ("zero3", []), ("ddp", SAMPLING)], ids=["ddp", "zero3", "ddp-sampling"]
)
def test_mixed_length_summaries_on_two_processes_equal_one_process(
    strategy: str, controls: list[str], decoded: Callable[..., Recorded]
) -> None:
    """The one-process reference without controls serves ``ddp`` and ``zero3``; one DDP launch decodes with the
    sampling controls and plainly (:class:`OutputRecorder`'s ``plain``), for ``ddp-sampling`` and ``ddp``."""
    batches = ["--data.init_args.max_tokens", "32"] if controls else []  # one long or two short documents a batch
    expected, long = decoded(*ONE_PROCESS, *controls, *batches)["outputs"]
    assert len(expected) == 6 and long == 2, "short and long documents, decoded"
    if strategy == "ddp":
        recorded = decoded("--config", STRATEGY_CONFIGS["ddp"], *SAMPLING, recorder=PLAIN_TOO)
        outputs, _ = recorded["outputs" if controls else "plain"]
    else:
        outputs, _ = decoded("--config", STRATEGY_CONFIGS[strategy], *controls)["outputs"]
    assert outputs == expected


@pytest.mark.slow
@pytest.mark.distributed
def test_copy_attention_summaries_under_zero3_equal_one_process(tmp_path: Path) -> None:
    # The source ids travel with the cache through hierarchical decoding's calls and the dummy calls of the rank that
    # finished first, while ZeRO-3 gathers the copy head's parameters in every forward pass.
    model, test = _summarizer(tmp_path / "model", "--model.transformer.copy_attention", "true")
    assert load_exported(model)[0].config.copy_attention
    expected, long = _test_outputs(model, test, tmp_path / "one", *ONE_PROCESS)["outputs"]
    assert len(expected) == 6 and long == 2, "short and long documents, decoded"
    outputs, _ = _test_outputs(model, test, tmp_path / "zero3", "--config", STRATEGY_CONFIGS["zero3"])["outputs"]
    assert outputs == expected


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_beam_search_in_lockstep_survives_a_dummy_call_stopped_before_any_hypothesis(
    summarizer: tuple[Path, Path], tmp_path: Path
) -> None:
    """ZeRO-3, two beams, the short documents on one process and the long ones on the other: the process that runs
    out first makes dummy calls, which its peer's real calls (ended early, see :class:`EndsEarly`) stop before they
    finish a hypothesis. Beam search failed there (``max() arg is an empty sequence``) and the peer died with it."""
    model, test = summarizer
    injected = "--trainer.callbacks+=tests.test_lockstep_decoding.EndsEarly"
    expected, _ = _test_outputs(model, test, tmp_path / "single", *ONE_PROCESS, injected)["outputs"]
    outputs, _ = _test_outputs(model, test, tmp_path / "zero3", "--config", STRATEGY_CONFIGS["zero3"], injected)[
        "outputs"
    ]
    assert outputs == expected


# --- the dummy call itself, on every decoding path, in one process ----------------------------------------------

EOS = 2


def _stopped_by_peers(steps: int) -> Callable[[bool], bool]:
    """The ``all_done`` of a lockstep dummy call: every other process is done after ``steps`` more steps, whatever
    this process's own state (``_wait_for_other_ranks`` passes ``lambda _: all_done(True)``)."""
    calls = iter(range(10**6))
    return lambda _: next(calls) >= steps


def _decode_options(path: str, model: Transformer, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    if path == "static":
        return {"cuda_graph": True}  # off CUDA the static cache's step runs eagerly
    if path == "compiled":  # the compiled step's search logic, without Inductor's compile time: the step runs eagerly
        monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
        return {"decode": CompiledDecode(model)}
    return {}


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("num_beams", [1, 2, 4])
@pytest.mark.parametrize("path", ["dynamic", "static", "compiled"])
@torch.no_grad()
def test_a_lockstep_dummy_call_survives_on_every_decoding_path(
    path: str, num_beams: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dummy batch ``_wait_for_other_ranks`` decodes (one EOS source), stopped by the other processes at the
    first step, a few steps in, or never before ``max_new_tokens``: always some tokens, never an error (beam search
    stopped with no finished hypothesis failed on ``max()`` of nothing)."""
    torch.manual_seed(0)
    config = TransformerConfig(
        src_vocab_size=29, tgt_vocab_size=29, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
        d_ff=32, dropout=0.0, max_len=32, eos_id=EOS,
    )  # fmt: skip
    model = Transformer(config).eval()
    options = _decode_options(path, model, monkeypatch)
    dummy = torch.full((1, 1), EOS, dtype=torch.long)  # (1, 1), as _wait_for_other_ranks builds it
    for steps in (0, 1, 2, 5, 100):
        out = generate(model, dummy, 8, num_beams, 1.0, _stopped_by_peers(steps), **options)
        assert out.dtype == torch.long and out.shape[0] == 1 and 1 <= out.shape[1] <= 8, (steps, out.shape)
