"""``torch_handle.load(path).translate(...)`` / ``.summarize(...)``: the outputs ``cli.py predict`` writes and
``torch_handle.summarize`` returns, from a checkpoint, a run folder or an export; bad files are one clear error."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL_ARGS, requires_cuda
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import torch_handle
from tests.helpers import RUN_TIMEOUT, SHARES_REFERENCE_RUNS, check, env, reference_run
from torch_handle.api import Model
from torch_handle.checkpoints import CheckpointError
from torch_handle.cli import main
from torch_handle.errors import SetupError
from torch_handle.export import Decoding, export
from torch_handle.hierarchical import generate_summaries, summarize
from torch_handle.model import CompiledDecode, ConfigError, Transformer, TransformerConfig
from torch_handle.model.logits import DecodingControls

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
QUIET = ["--trainer.enable_progress_bar=false"]
SENTENCES = [
    "the king sees the big red house near the old river",
    "a cat",
    "my two old birds helped the king",
    "",
    "the dog sees a cat",
    "birds",
    "the old man walks to the small house",
]
"""Lengths out of order, so that sorting by length reorders them, and a blank line as ``predict`` keeps one."""
# What the run below records: its own beams and lengths, not the Seq2SeqModule defaults.
RUN_DECODING = Decoding(max_source_tokens=64, num_beams=2, max_new_tokens=8, chunk_overlap=16)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny demo model trained through ``cli.py fit`` just long enough that different inputs get different
    outputs (the shared 8-step run writes the same text for every input, so order would go untested)."""
    root = tmp_path_factory.mktemp("api_run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    main(
        [
            "fit", f"--config={DEMO}", f"--trainer.default_root_dir={root}", "--trainer.max_steps=50",
            "--trainer.limit_val_batches=1", "--data.init_args.demo_size=2000", "--data.init_args.bpe_vocab_size=300",
            "--model.transformer.max_len=64", "--model.lr=0.01", "--model.warmup_steps=5", "--model.num_beams=2",
            "--model.max_new_tokens=8", "--model.chunk_overlap=16", "--model.generate_every_n_val_epochs=0",
            *TINY_MODEL_ARGS, *QUIET,
        ]
    )  # fmt: skip
    torch.set_num_threads(threads)
    return root


@pytest.fixture(scope="module")
def exported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(run / "checkpoints" / "last.ckpt", tmp_path_factory.mktemp("api_export") / "model.safetensors")


def _predict(run: Path, tmp_path: Path, *options: str) -> list[str]:
    inputs, output = tmp_path / "in.txt", tmp_path / "out.txt"
    inputs.write_text("".join(f"{s}\n" for s in SENTENCES), encoding="utf-8")
    args = [f"--data.init_args.predict_file={inputs}", f"--prediction_writer.output={output}", *options, *QUIET]
    main(["predict", f"--trainer.default_root_dir={run}", *args])  # no --config: its beams would override the run's
    return output.read_text(encoding="utf-8").splitlines()


def _as_written(texts: list[str]) -> list[str]:
    """As the prediction writer writes a text: on one line, whitespace collapsed."""
    return [" ".join(text.split()) for text in texts]


@pytest.mark.slow
def test_translate_writes_what_predict_writes_from_the_checkpoint_the_run_folder_and_the_export(
    run: Path, exported: Path, tmp_path: Path
) -> None:
    predicted = _predict(run, tmp_path)  # the checkpoint's beams and lengths
    assert len(set(predicted)) >= 3, "the model must tell inputs apart for this test to check anything"
    for path in (run / "checkpoints" / "last.ckpt", run, exported):
        model = torch_handle.load(path)
        assert model.decoding == RUN_DECODING, path
        assert _as_written(model.translate(SENTENCES, batch_size=3)) == predicted, path
    options = {"num_beams": 3, "max_new_tokens": 12, "length_penalty": 0.6}
    predicted = _predict(run, tmp_path, *(f"--model.{name}={value}" for name, value in options.items()))
    assert _as_written(torch_handle.load(exported).translate(SENTENCES, **options)) == predicted


LIGHTNING_FREE = """
import json, sys
import torch_handle
outputs = [torch_handle.load(path).translate(json.loads(sys.argv[1])) for path in sys.argv[2:]]
lightning = sorted(name for name in sys.modules if name.split(".")[0] in ("lightning", "pytorch_lightning"))
print(json.dumps({"outputs": outputs, "lightning": lightning}))
"""


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT)
def test_load_and_translate_import_no_lightning(run: Path, exported: Path, tmp_path: Path) -> None:
    """Inference from a checkpoint, a run folder or an export runs where only torch, tokenizers and safetensors
    are (Lightning is for training)."""
    paths = [run / "checkpoints" / "last.ckpt", run, exported]
    command = [sys.executable, "-c", LIGHTNING_FREE, json.dumps(SENTENCES), *map(str, paths)]
    child = check(subprocess.run(command, cwd=tmp_path, env=env(PYTHONPATH=str(ROOT)), capture_output=True, text=True))
    result = json.loads(child.stdout.splitlines()[-1])
    assert result["lightning"] == []
    assert result["outputs"] == [torch_handle.load(path).translate(SENTENCES) for path in paths]


def test_translate_returns_outputs_in_input_order_when_it_batches_by_length(exported: Path) -> None:
    model = torch_handle.load(exported)
    lengths = [len(ids) for ids in model.tokenizer.encode_batch(SENTENCES)]
    assert lengths != sorted(lengths)  # batching by length reorders these
    alone = [model.translate(sentence) for sentence in SENTENCES]  # one string in, one string out
    assert len(set(alone)) >= 3
    assert model.translate(SENTENCES, batch_size=2) == alone
    assert model.translate([]) == []


def test_summarize_goes_hierarchical_on_a_long_document_as_torch_handle_summarize(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = torch_handle.load(run)
    document = " ".join(SENTENCES * 8)
    assert len(model.tokenizer.encode(document)) > 3 * RUN_DECODING.max_source_tokens
    with caplog.at_level(logging.INFO, logger="torch_handle.hierarchical"):
        summaries = model.summarize([document, SENTENCES[0]], batch_size=2)
    assert any(record.getMessage().startswith("level 0:") for record in caplog.records), "not hierarchical"
    # The file holds every setting torch_handle.summarize needs.
    options = model.decoding.summarize_options()
    decoding = {"max_new_tokens": 8, "num_beams": 2, "length_penalty": 1, "controls": DecodingControls()}
    assert options == {"max_source_tokens": 64, "overlap": 16, **decoding}
    want = [summarize(model.model, model.tokenizer, text, **options) for text in (document, SENTENCES[0])]
    assert summaries == want
    assert model.summarize(document, batch_size=2) == want[0]
    # A stored overlap the windows cannot hold (a translation run's default 256 at 64 tokens): a quarter of the
    # 63-token window, with a warning, where it failed; one passed here is the caller's, and refused if it does not fit.
    model.decoding = dataclasses.replace(model.decoding, chunk_overlap=256)
    with caplog.at_level(logging.WARNING, logger="torch_handle.hierarchical"):
        fitted = model.summarize(document, batch_size=2)
    assert "chunk_overlap=256 does not fit the 63-token windows of a long document: using 15" in caplog.text
    assert fitted == summarize(model.model, model.tokenizer, document, **(options | {"overlap": 15}))
    with pytest.raises(ConfigError, match=r"^overlap=63 does not fit the 63-token windows "):
        model.summarize(document, overlap=63)


def test_translate_and_summarize_take_decoding_controls_by_name(exported: Path) -> None:
    model = torch_handle.load(exported)
    controls = {"no_repeat_ngram_size": 2, "min_new_tokens": 5}
    ids = model.tokenizer.encode_batch(SENTENCES)
    options = {"max_new_tokens": 8, "num_beams": 2, "length_penalty": 1.0, "batch_size": 32}
    want = generate_summaries(model.model, model.tokenizer, ids, **options, controls=DecodingControls(**controls))
    assert model.translate(SENTENCES, **controls) == want != model.translate(SENTENCES)
    assert model.translate(SENTENCES, num_beams=1, do_sample=True, top_k=1) == model.translate(SENTENCES, num_beams=1)
    document = " ".join(SENTENCES * 8)
    options = {**model.decoding.summarize_options(), "controls": DecodingControls(**controls), "batch_size": 2}
    assert model.summarize(document, batch_size=2, **controls) == summarize(
        model.model, model.tokenizer, document, **options
    )
    with pytest.raises(TypeError, match=r"^unknown decoding options \['top_q'\]: the controls are \['do_sample', "):
        model.translate("a cat", top_q=0.9)
    wrong = r"^decoding options of the wrong type: num_beams='2', top_p='0.9': pass numbers \(num_beams=4\)$"
    with pytest.raises(TypeError, match=wrong):  # one line naming each, not "'>' not supported between str and int"
        model.translate("a cat", num_beams="2", top_p="0.9")
    with pytest.raises(TypeError, match=r"^decoding options of the wrong type: max_new_tokens=5.5: "):
        model.summarize("a cat", max_new_tokens=5.5)
    with pytest.raises(TypeError, match=r"^overlap='16': pass an integer number of tokens$"):
        model.summarize("a cat", overlap="16")
    with pytest.raises(ValueError, match=r"^batch_size must be an integer >= 1, got '8'$"):
        model.translate("a cat", batch_size="8")
    assert model.translate(SENTENCES, num_beams=np.int64(2)) == model.translate(SENTENCES, num_beams=2)


def test_translate_cuts_a_text_longer_than_the_model_context_with_a_warning(
    exported: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = torch_handle.load(exported)
    long = " ".join(SENTENCES * 4)
    cut = model.tokenizer.decode(model.tokenizer.encode(long)[:63])
    with caplog.at_level(logging.WARNING, logger="torch_handle.api"):
        assert model.translate([long, "a cat"]) == model.translate([cut, "a cat"])
    assert [r.getMessage() for r in caplog.records] == ["cut 1 of 2 texts to 63 tokens, the model's max_source_tokens"]


@pytest.mark.slow
@pytest.mark.distributed
@SHARES_REFERENCE_RUNS
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_load_reads_a_run_folder_of_sharded_checkpoints(
    strategy: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The two-process reference runs that ``test_strategies`` trains (once per session) save folders."""
    run = reference_run(strategy, tmp_path_factory.getbasetemp())
    folder = run / "checkpoints" / "last.ckpt"
    assert folder.is_dir()
    model = torch_handle.load(run)
    assert model.decoding == Decoding(max_source_tokens=64, max_new_tokens=16)  # TINY's, the data's cut to max_len
    if strategy == "zero3":  # the weights DeepSpeed itself gathers from the shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        gathered = get_fp32_state_dict_from_zero_checkpoint(str(folder))
        for name, tensor in model.model.state_dict().items():
            if f"model.{name}" in gathered:  # DeepSpeed keeps a tied weight under one of its names
                torch.testing.assert_close(tensor, gathered[f"model.{name}"], atol=0, rtol=0)
    sentences = ["one two three", "four five six seven", "eight"]
    exported = torch_handle.load(export(folder, tmp_path / "model.safetensors"))
    assert model.translate(sentences, num_beams=2) == exported.translate(sentences, num_beams=2)


def _rewrite(exported: Path, output: Path, **metadata: str | None) -> Path:
    """A copy of an export with its metadata changed (None removes a key), e.g. as an older version wrote it."""
    with safe_open(exported, framework="pt") as f:
        kept = {**f.metadata(), **metadata}
    save_file(load_file(exported), output, metadata={k: v for k, v in kept.items() if v is not None})
    return output


def test_an_export_without_decoding_settings_loads_with_the_documented_defaults(exported: Path, tmp_path: Path) -> None:
    old = torch_handle.load(_rewrite(exported, tmp_path / "old.safetensors", decoding=None))
    # Seq2SeqModule's defaults; the source length and the outputs fit the model's max_len=64.
    assert old.decoding == Decoding(max_source_tokens=64, num_beams=4, max_new_tokens=63, chunk_overlap=256)
    options = {"num_beams": 2, "max_new_tokens": 8}
    assert old.translate(SENTENCES, **options) == torch_handle.load(exported).translate(SENTENCES, **options)


def test_decoding_defaults_are_the_modules_and_the_data_modules() -> None:
    from torch_handle.data import SummarizationDataModule, TranslationDataModule
    from torch_handle.export import DEFAULT_MAX_SOURCE_TOKENS
    from torch_handle.module import Seq2SeqModule

    module = inspect.signature(Seq2SeqModule).parameters
    for field in dataclasses.fields(Decoding):
        if field.name != "max_source_tokens":
            assert field.default == module[field.name].default, field.name
    for task, data in (("translation", TranslationDataModule), ("summarization", SummarizationDataModule)):
        assert DEFAULT_MAX_SOURCE_TOKENS[task] == inspect.signature(data).parameters["max_source_tokens"].default


KINDS = (
    "a .safetensors export, a .ckpt file, a DeepSpeed or FSDP checkpoint folder, a run folder, or a Hugging Face model "
    "folder (or its hub id, owner/name)"
)
EXPORT = "torch-handle export"  # from Python, messages name the installed command
FIT = "torch-handle fit --config ..."


@pytest.mark.parametrize("case", ["missing", "folder", "text_ckpt", "truncated_export", "bad_decoding", "empty_run"])
def test_a_bad_path_is_one_checkpoint_error_naming_the_file_and_the_fix(
    exported: Path, tmp_path: Path, case: str
) -> None:
    path = tmp_path / "model.safetensors"
    if case == "missing":
        expected = f"{path} does not exist: pass {KINDS}"
    elif case == "folder":
        path = tmp_path
        expected = f"{path} is a folder but not a checkpoint or a run folder: pass {KINDS}"
    elif case == "text_ckpt":
        path = tmp_path / "last.ckpt"
        path.write_text("not a checkpoint")
        expected = f"{path} is not a checkpoint (not a torch.save archive): pass a .ckpt file"
    elif case == "truncated_export":
        path.write_bytes(exported.read_bytes()[:-100])
        expected = f"{path} is not a safetensors file (.*): export the model again"
    elif case == "bad_decoding":
        _rewrite(exported, path, decoding=json.dumps({"num_beams": "four"}))
        expected = f"{path}: decoding settings ['num_beams'] have the wrong type: export it again with {EXPORT}"
    else:
        path = tmp_path
        (path / "checkpoints").mkdir()
        expected = f"no last checkpoint in {path / 'checkpoints'}: train first ({FIT}) or pass --ckpt_path"
    with pytest.raises(CheckpointError) as error:
        torch_handle.load(path)
    message = str(error.value)
    assert "\n" not in message
    assert re.fullmatch(expected if case == "truncated_export" else re.escape(expected), message), message


def test_an_output_longer_than_the_model_context_is_refused_in_one_line(exported: Path) -> None:
    with pytest.raises(ValueError, match=r"^max_new_tokens=64 does not fit the model's max_len=64 .*<= 63$"):
        torch_handle.load(exported).translate(SENTENCES, max_new_tokens=64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_asking_for_cuda_without_a_cuda_device_is_one_line(exported: Path) -> None:
    with pytest.raises(SetupError, match=r"^device='cuda', but this machine has no CUDA device: pass device='cpu'$"):
        torch_handle.load(exported, device="cuda")


@pytest.mark.slow
def test_compile_decodes_greedy_and_beam_search_as_eager_decoding_does(
    exported: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[tuple[object, int]] = []  # (the decoding call's cache, kept alive, its batch size) at every step
    step = CompiledDecode.__call__
    monkeypatch.setattr(
        CompiledDecode,
        "__call__",
        lambda self, token, *rest, **kw: steps.append((rest[-1], len(token))) or step(self, token, *rest, **kw),
    )
    eager, compiled = torch_handle.load(exported), torch_handle.load(exported, compile=True)
    # Batches of 3 sorted by length, the last of one sentence, filled to 3 rows: one batch size to compile for.
    greedy = eager.translate(SENTENCES, num_beams=1, batch_size=3)
    assert compiled.translate(SENTENCES, num_beams=1, batch_size=3) == greedy
    assert len({id(cache) for cache, _ in steps}) == 3 and {rows for _, rows in steps} == {3}, steps
    steps.clear()
    beams = compiled.decoding.num_beams
    assert beams > 1 and compiled.translate(SENTENCES, batch_size=3) == eager.translate(SENTENCES, batch_size=3)
    assert len({id(cache) for cache, _ in steps}) == 3 and {rows for _, rows in steps} == {3 * beams}, steps
    steps.clear()
    # A long document: windows in batches of 2, the last filled; then the summary of their summaries, one row.
    document = " ".join(SENTENCES * 8)
    assert compiled.summarize(document, num_beams=1, batch_size=2) == eager.summarize(
        document, num_beams=1, batch_size=2
    )
    assert {rows for _, rows in steps} == {2}, steps
    steps.clear()
    assert compiled.summarize(document, batch_size=2) == eager.summarize(document, batch_size=2)  # beam search
    assert {rows for _, rows in steps} == {2 * beams}, steps


def test_a_model_decoding_on_a_cpu_stores_its_linear_weights_column_major_unless_compiled(exported: Path) -> None:
    # Eager decoding multiplies by each weight's transpose, faster contiguous at a step's few rows; a compiled step
    # packs the weights itself, so compile=True leaves them as trained.
    def column_major(model: Model) -> set[bool]:
        return {m.weight.t().is_contiguous() for m in model.model.modules() if isinstance(m, torch.nn.Linear)}

    assert column_major(torch_handle.load(exported)) == {True}
    assert column_major(torch_handle.load(exported, compile=True)) == {False}


def test_compile_on_a_device_other_than_the_cpu_is_one_line(exported: Path) -> None:
    loaded = torch_handle.load(exported)
    with pytest.raises(SetupError, match=r"^compile=True compiles decoding on a CPU, but device='meta': leave compile"):
        Model(loaded.model.to("meta"), loaded.tokenizer, loaded.decoding, compile=True)


@pytest.mark.gpu
@requires_cuda
def test_translate_on_a_gpu_writes_what_the_cpu_writes(exported: Path) -> None:
    on_gpu = torch_handle.load(exported, device="cuda")
    assert on_gpu.device.type == "cuda"
    assert on_gpu.translate(SENTENCES) == torch_handle.load(exported).translate(SENTENCES)


def test_do_sample_false_turns_off_a_files_sampling_defaults() -> None:
    """A folder whose generation config samples (top_k 50): ``do_sample=False`` decodes greedily, with no
    "top_k=50 acts only when sampling" error; a knob passed beside it is still refused in one line."""
    sizes = {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_encoder_layers": 1, "num_decoder_layers": 1}
    model = Transformer(TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, **sizes))
    sampling = Decoding(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, no_repeat_ngram_size=3)
    loaded = Model(model, None, sampling)  # type: ignore[arg-type] - options are checked without the tokenizer
    options = loaded._options(None, None, None, {"do_sample": False})
    assert options["controls"] == DecodingControls(no_repeat_ngram_size=3)
    with pytest.raises(ValueError, match=r"^top_k=5 acts only when sampling: pass do_sample=True too$"):
        loaded._options(None, None, None, {"do_sample": False, "top_k": 5})
