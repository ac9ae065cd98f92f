"""Hugging Face BART and Marian folders as our Transformer: logits and generate against transformers, offline."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

import torch_handle
from tests.test_hostile_files import SHAPES
from torch_handle.checkpoints import CheckpointError
from torch_handle.cli import main
from torch_handle.ctranslate2 import ExportError
from torch_handle.data.batching import Collator, Example
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.export import Decoding
from torch_handle.export.__main__ import main as export_main
from torch_handle.export.write import write_exported
from torch_handle.model import Transformer, TransformerConfig, generate
from torch_handle.module import Seq2SeqModule
from torch_handle.pretrained import load_pretrained, pretrained_tokenizer
from torch_handle.pretrained.writer import write_hf

WORDS = [f"w{i}" for i in range(120)]
TEXTS = ["w1 w2 w3", "w5", "w7 w8 w9 w10 w11 w12 w13", "w20 w21 w22 w23", "w40 w41"]
SIZE = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4}
SIZE |= {"decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64}


def _tokenizer(
    specials: list[str], template: str, pad: str, eos: str, bos: str | None, words: list[str] = WORDS
) -> object:
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    if pad not in vocab:  # Marian keeps padding last
        vocab[pad] = len(vocab)
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = {t: vocab[t] for t in (bos, eos) if t is not None}
    backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=list(named.items()))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, eos_token=eos, unk_token="<unk>", **({"bos_token": bos} if bos else {})
    )


def bart_tokenizer(words: list[str] = WORDS) -> object:
    """BART's tokenizer (``<s> text </s>``) over one token per word of ``words``."""
    return _tokenizer(["<s>", "<pad>", "</s>", "<unk>"], "<s> $A </s>", "<pad>", "</s>", "<s>", words)


def _bart() -> tuple[object, object]:
    tok = bart_tokenizer()
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(vocab_size=len(tok), **SIZE))
    model.generation_config.update(forced_bos_token_id=0)  # as bart-large-cnn's
    return model, tok


def _marian() -> tuple[object, object]:
    return marian_model(_tokenizer(["</s>", "<unk>"], "$A </s>", "<pad>", "</s>", None))


def marian_model(tok: object, positions: int = SIZE["max_position_embeddings"]) -> tuple[object, object]:
    """A random opus-mt-like model for the Marian tokenizer ``tok``: ``</s>`` 0, ``<pad>`` its decoder start."""
    pad = tok.pad_token_id
    sizes = {"vocab_size": len(tok)}
    if getattr(
        tok, "separate_vocabs", False
    ):  # two embeddings: the source's and the target's, which the output layer shares
        sizes = {"vocab_size": len(tok.encoder), "decoder_vocab_size": len(tok.target_encoder)}
        sizes["share_encoder_decoder_embeddings"] = False
    config = transformers.MarianConfig(
        **sizes, pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        activation_function="swish", scale_embedding=True, **(SIZE | {"max_position_embeddings": positions}),
    )  # fmt: skip
    model = transformers.MarianMTModel(config)
    model.generation_config.update(bad_words_ids=[[pad]])  # as opus-mt's
    return model, tok


def _mbart() -> tuple[object, object]:
    tok = bart_tokenizer()
    config = transformers.MBartConfig(vocab_size=len(tok), decoder_start_token_id=2, scale_embedding=True, **SIZE)
    return transformers.MBartForConditionalGeneration(config), tok


def _pegasus() -> tuple[object, object]:
    tok = _tokenizer(["<pad>", "</s>", "<unk>"], "$A </s>", "<pad>", "</s>", None)
    config = transformers.PegasusConfig(
        vocab_size=len(tok), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=1,
        activation_function="relu", scale_embedding=True, **SIZE,
    )  # fmt: skip
    return transformers.PegasusForConditionalGeneration(config), tok


FAMILIES = {"bart": _bart, "marian": _marian}  # every file format, fine-tuning and export too
MORE = {"mbart": _mbart, "pegasus": _pegasus}  # safetensors, logits and decoding
EOS_BONUS = {"bart": 2.0, "marian": 2.0, "mbart": 1.5, "pegasus": 2.0}  # a logit bias: outputs end apart


FORMATS = ("safetensors", "sharded", "bin")


def _save(
    family: str, fmt: str, path: Path, build: Callable[[], tuple[object, object]] | None = None
) -> tuple[Path, object, object]:
    """A random model of the family (or that ``build`` makes) saved with its tokenizer as ``fmt``: one safetensors
    file, shards of one, or the pickled ``pytorch_model.bin`` older ``transformers`` wrote (every tensor, tied ones
    too)."""
    torch.manual_seed(0)
    model, tok = (build or {**FAMILIES, **MORE}[family])()
    with torch.no_grad():  # weights larger than transformers' initialisation: outputs then follow their sources
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed_positions" not in name:  # Marian's sinusoid is a frozen parameter
                parameter.normal_(std=0.15)
        model.final_logits_bias.normal_(std=0.5)
        model.final_logits_bias[0, model.config.eos_token_id] += EOS_BONUS[family]
    model.generation_config.update(max_length=12, num_beams=4, early_stopping=True)
    model.save_pretrained(path, max_shard_size="40KB" if fmt == "sharded" else "1GB")
    tok.save_pretrained(path)
    if fmt == "sharded":
        assert len(list(path.glob("model-*.safetensors"))) > 1
    if fmt == "bin":
        (path / "model.safetensors").unlink()
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path, model.eval(), tok


@pytest.fixture(
    scope="module",
    params=[(f, fmt) for f in FAMILIES for fmt in FORMATS] + [(f, "safetensors") for f in MORE],
    ids="-".join,
)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    return _save(*request.param, tmp_path_factory.mktemp(request.param[0]))


@pytest.fixture(scope="module", params=[*FAMILIES, *MORE])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    return _save(request.param, "safetensors", tmp_path_factory.mktemp(request.param))


def test_encoder_output_and_logits_match_transformers(saved: tuple[Path, object, object]) -> None:
    assert_logits_match(*saved, length=6)


def _model_and_inputs(path: Path, hf: object, tok: object, length: int) -> tuple[Transformer, dict, torch.Tensor]:
    """Our model of the folder (eval mode), transformers' batch of ``TEXTS``, and ``length`` random decoder inputs
    after the decoder's start token."""
    ours, _, _ = load_pretrained(path)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    start = hf.config.decoder_start_token_id
    tgt = torch.cat(
        [
            torch.full((len(TEXTS), 1), start),
            torch.randint(4, min(100, ours.config.tgt_vocab_size), (len(TEXTS), length)),
        ],
        dim=1,
    )
    return ours.eval(), batch, tgt


def assert_logits_match(path: Path, hf: object, tok: object, length: int) -> None:
    """Our encoder output and logits for ``TEXTS`` and ``length`` random decoder inputs equal transformers'."""
    ours, batch, tgt = _model_and_inputs(path, hf, tok, length)
    with torch.no_grad():
        hf_out = hf(**batch, decoder_input_ids=tgt)
        memory = ours.encode(batch["input_ids"])
        logits = ours(batch["input_ids"], tgt)
    keep = batch["attention_mask"].bool()  # our padding positions skip the feed-forward blocks: nothing reads them
    torch.testing.assert_close(memory[keep], hf_out.encoder_last_hidden_state[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, hf_out.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_generate_matches_transformers(folder: tuple[Path, object, object], num_beams: int) -> None:
    hf = folder[1]
    expected = assert_generate_matches_transformers(folder, num_beams)
    # Hypotheses finish at different steps, and others at the length limit (forced EOS); this tiny PEGASUS ends every
    # output at once or none before the limit, whatever the bias.
    if num_beams > 1 and hf.config.model_type != "pegasus":
        assert len({int((row != hf.config.pad_token_id).sum()) for row in expected}) > 1, "outputs of one length"


def assert_generate_matches_transformers(folder: tuple[Path, object, object], num_beams: int) -> torch.Tensor:
    """Our ``generate`` and ``translate`` of ``TEXTS`` write what transformers' ``generate`` writes; its output."""
    path, hf, tok = folder
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    expected = hf.generate(**batch, num_beams=num_beams)[:, 1:]  # without the decoder's start token
    assert_generate_matches(path, tok, expected, num_beams)
    return expected


def assert_generate_matches(
    path: Path, tok: object, expected: torch.Tensor, num_beams: int, texts: list[str] = TEXTS, task: str = "translate"
) -> None:
    """Our ``generate`` and ``translate`` (or ``summarize``, the ``task``) of ``texts`` write ``expected``,
    transformers' (without the start token)."""
    batch = tok(texts, return_tensors="pt", padding=True)
    ours, _, decoding = load_pretrained(path)
    out = generate(ours.eval(), batch["input_ids"], decoding.max_new_tokens, num_beams, decoding.length_penalty)
    width = max(out.shape[1], expected.shape[1])
    pad = ours.config.pad_id
    out, padded = (torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad) for t in (out, expected))
    assert torch.equal(out, padded)
    outputs = getattr(torch_handle.load(path), task)(texts, num_beams=num_beams)
    assert outputs == [t.strip() for t in tok.batch_decode(expected, skip_special_tokens=True)]


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_config_controls_match_transformers(family: str, num_beams: int, tmp_path: Path) -> None:
    """n-gram blocking, repetition penalty and a minimum length in ``generation_config.json`` become the model's
    decoding defaults, and decode as ``generate`` does with them."""
    path, hf, tok = _save(family, "safetensors", tmp_path)
    controls = {"no_repeat_ngram_size": 2, "repetition_penalty": 1.5, "min_length": 6}
    hf.generation_config.update(**controls)
    hf.generation_config.save_pretrained(path)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    expected = hf.generate(**batch, num_beams=num_beams)[:, 1:]
    plain = hf.generate(**batch, num_beams=num_beams, no_repeat_ngram_size=0, repetition_penalty=1.0, min_length=0)
    assert tok.batch_decode(expected, skip_special_tokens=True) != tok.batch_decode(plain, skip_special_tokens=True)
    model = torch_handle.load(path)
    assert (model.decoding.no_repeat_ngram_size, model.decoding.min_new_tokens) == (2, 5)
    texts = model.translate(TEXTS, num_beams=num_beams)
    assert texts == [t.strip() for t in tok.batch_decode(expected, skip_special_tokens=True)]


def test_decoding_defaults_fall_back_to_config_json(tmp_path: Path) -> None:
    """A folder without ``generation_config.json`` (bart-large-cnn's) keeps its decoding defaults in config.json."""
    _save("bart", "safetensors", tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"num_beams": 3, "max_length": 9, "length_penalty": 2.0, "no_repeat_ngram_size": 3, "min_length": 4}
    (tmp_path / "config.json").write_text(json.dumps(config | {"do_sample": True, "top_k": 7}))
    decoding = load_pretrained(tmp_path)[2]
    assert (decoding.num_beams, decoding.max_new_tokens, decoding.length_penalty) == (3, 8, 2.0)
    assert (decoding.no_repeat_ngram_size, decoding.min_new_tokens, decoding.do_sample, decoding.top_k) == (
        3,
        3,
        True,
        7,
    )


def test_unsupported_model_type_is_one_line(tmp_path: Path) -> None:
    _save("bart", "safetensors", tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"model_type": "bart"', '"model_type": "prophetnet"')
    (tmp_path / "config.json").write_text(config)
    expected = r"model_type 'prophetnet' is not supported; supported: bart, led, marian, mbart, mt5, pegasus, t5$"
    with pytest.raises(CheckpointError, match=expected):
        load_pretrained(tmp_path)


def test_wrong_shape_names_the_tensor(tmp_path: Path) -> None:
    _save("bart", "safetensors", tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"encoder_ffn_dim": 64', '"encoder_ffn_dim": 48')
    (tmp_path / "config.json").write_text(config.replace('"decoder_ffn_dim": 64', '"decoder_ffn_dim": 48'))
    with pytest.raises(CheckpointError, match=r"tensor model.decoder.layers.0.fc1.weight has shape \(64, 32\), conf"):
        load_pretrained(tmp_path)


def test_loading_writes_each_weight_once(folder: tuple[Path, object, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """The model is filled from the file without a random initialization first (which would make every page of a
    second copy resident), and still equals transformers' (the parity tests compare outputs)."""

    def no_init(self: Transformer) -> None:  # on the meta device (the shape check's shell) it writes nothing
        assert self.tgt_embed.weight.is_meta, "load_pretrained initialized weights it then overwrote"

    monkeypatch.setattr(Transformer, "reset_parameters", no_init)
    model, _, _ = load_pretrained(folder[0])
    assert (model.lm_head.weight is model.tgt_embed.weight) == model.config.tie_embeddings  # to_empty unties


@pytest.mark.parametrize("claim", [{"d_model": 65536}, {"encoder_layers": 10**9}], ids=["wide", "deep"])
def test_a_config_claiming_a_huge_model_is_refused_before_building_it(
    claim: dict[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged ``d_model`` (hundreds of GB of parameters) or layer count (hours to build even on the meta device)
    over tiny weights is refused before any Transformer of real memory is built."""
    _save("bart", "safetensors", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **claim}))

    def never(config: TransformerConfig) -> Transformer:
        raise AssertionError(f"a Transformer of d_model {config.d_model} was built")

    monkeypatch.setattr(torch_handle.pretrained, "Transformer", never)
    held = (tmp_path / "model.safetensors").stat().st_size
    with pytest.raises(CheckpointError) as error:
        load_pretrained(tmp_path)
    assert re.fullmatch(
        rf"{re.escape(str(tmp_path))}: config.json describes \d+ parameters, more than its weight files' {held} "
        "bytes hold: refused; pass the config.json save_pretrained wrote with these weights",
        str(error.value),
    ), str(error.value)


def test_a_bin_that_is_not_a_zip_archive_is_refused(tmp_path: Path) -> None:
    _save("bart", "bin", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02cos\nsystem\n.")  # an old-style pickle
    with pytest.raises(CheckpointError, match="pytorch_model.bin is not a torch.save zip archive"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("outside", ["../outside.safetensors", "ABSOLUTE"])
def test_an_index_pointing_outside_the_folder_is_refused(outside: str, tmp_path: Path) -> None:
    """A shard named ``../x`` or by an absolute path would read weights from outside the folder."""
    folder = tmp_path / "model"
    _save("bart", "safetensors", folder)
    shard = tmp_path / "outside.safetensors"
    (folder / "model.safetensors").rename(shard)
    outside = str(shard) if outside == "ABSOLUTE" else outside
    with safe_open(shard, framework="pt") as f:
        names = list(f.keys())
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, outside)}))
    with pytest.raises(CheckpointError) as error:
        load_pretrained(folder)
    assert str(error.value) == (
        f"{index} lists the shard {outside!r}, which is not a file of {folder}: refused; "
        "pass a folder written by save_pretrained"
    )


def test_shards_linked_from_elsewhere_load_as_in_the_hugging_face_cache(tmp_path: Path) -> None:
    """The hub cache's snapshot folder holds links into ``blobs/``: a shard named in the folder loads wherever its
    link points, with the weights the plain folder gives."""
    plain, folder = tmp_path / "plain", tmp_path / "snapshots" / "rev"
    _save("bart", "safetensors", plain)
    shutil.copytree(plain, folder)
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    (folder / "model.safetensors").rename(blob)
    with safe_open(blob, framework="pt") as f:
        names = list(f.keys())
    (folder / "model-00001-of-00001.safetensors").symlink_to(blob)
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    want, got = load_pretrained(plain)[0].state_dict(), load_pretrained(folder)[0].state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_hostile_bin_runs_nothing(shape: str, tmp_path: Path) -> None:
    """Every hostile shape of the checkpoint tests, as a folder's ``pytorch_model.bin``, is refused in one line."""
    folder, marker = tmp_path / "model", tmp_path / "marker"
    _save("bart", "bin", folder)
    weights = folder / "pytorch_model.bin"
    weights.write_bytes(SHAPES[shape](weights.read_bytes(), marker))
    with pytest.raises(CheckpointError) as error:
        torch_handle.load(folder)
    assert "\n" not in str(error.value) and "pytorch_model.bin" in str(error.value)
    assert not marker.exists()


def _torch_zip(data: bytes) -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": torch.zeros(len(data) // 4)}, buffer)
    return buffer.getvalue()


DAMAGED = {  # what a model.safetensors may hold that safetensors cannot read; as large as the weights it replaces
    "truncated": lambda data: data[: len(data) // 2],
    "torch-zip": _torch_zip,
    "pickle": lambda data: pickle.dumps(bytes(len(data))),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_safetensors_file_is_refused_in_one_line(damage: str, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    _save("bart", "safetensors", folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(DAMAGED[damage](weights.read_bytes()))
    with pytest.raises(CheckpointError) as error:
        torch_handle.load(folder)
    assert re.fullmatch(
        rf"{re.escape(str(weights))} is not a safetensors file \([^\n]+\): download the folder again", str(error.value)
    ), str(error.value)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(folder), str(tmp_path / "out.safetensors")])
    assert exit_.value.code == f"error: {error.value}"


MALFORMED = {  # a file of the folder, what is written over its values, the line after the folder's name
    "model_type": ("config.json", {"model_type": ["bart"]}, "model_type ['bart'] is not supported; supported: "),
    "d_model": ("config.json", {"d_model": "32"}, "d_model must be an integer, got '32'"),
    "num_beams": (
        "generation_config.json",
        {"num_beams": "4", "max_length": 12.5},
        "the decoding settings ['max_length', 'num_beams'] have the wrong type or value: pass a folder written by "
        "save_pretrained",
    ),
    "num_beams_0": (
        "generation_config.json",
        {"num_beams": 0, "max_length": 1},
        "the decoding settings ['max_length=1', 'num_beams=0'] have the wrong type or value: pass a folder written "
        "by save_pretrained",
    ),
}


@pytest.mark.parametrize("field", list(MALFORMED))
def test_a_value_of_the_wrong_type_is_named_in_one_line(field: str, tmp_path: Path) -> None:
    _save("bart", "safetensors", tmp_path)
    name, values, line = MALFORMED[field]
    (tmp_path / name).write_text(json.dumps(json.loads((tmp_path / name).read_text()) | values))
    with pytest.raises(CheckpointError) as error:
        torch_handle.load(tmp_path)
    assert str(error.value).startswith(f"{tmp_path}: {line}"), str(error.value)


def test_an_index_mapping_tensors_to_lists_is_refused_in_one_line(tmp_path: Path) -> None:
    _save("bart", "sharded", tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"] = {name: [shard] for name, shard in content["weight_map"].items()}
    index.write_text(json.dumps(content))
    with pytest.raises(CheckpointError) as error:
        torch_handle.load(tmp_path)
    assert str(error.value) == (
        f"{index} maps tensors to shards that are not file names: pass a save_pretrained folder"
    )


def test_a_folder_without_max_length_generates_as_many_tokens_as_transformers(tmp_path: Path) -> None:
    """transformers 5 then generates 20 new tokens (a max_length, when given, counts the start token)."""
    path, _, tok = _save("bart", "safetensors", tmp_path)
    generation = json.loads((path / "generation_config.json").read_text())
    del generation["max_length"]
    (path / "generation_config.json").write_text(json.dumps(generation))
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    expected = hf.generate(**tok(TEXTS, return_tensors="pt", padding=True), num_beams=1)[:, 1:]
    assert expected.shape[1] == 20, "no output reaches the length limit"
    assert load_pretrained(path)[2].max_new_tokens == 20
    assert_generate_matches(path, tok, expected, num_beams=1)
    (path / "generation_config.json").write_text(json.dumps(generation | {"max_length": 30, "max_new_tokens": 7}))
    assert load_pretrained(path)[2].max_new_tokens == 7  # transformers takes max_new_tokens first
    (path / "generation_config.json").write_text(json.dumps(generation | {"num_beams": None}))
    assert load_pretrained(path)[2].num_beams == 1  # null: unset


@pytest.mark.parametrize("form", ["safetensors", "hf"])
def test_export_writes_a_hugging_face_folder_as_load_reads_it(form: str, tmp_path: Path) -> None:
    """``torch-handle export FOLDER``: the export decodes as the folder does, with its decoding defaults; ``average``
    names the folder for what it is."""
    path, _, _ = _save("bart", "safetensors", tmp_path / "in")
    out = tmp_path / ("out.safetensors" if form == "safetensors" else "out")
    export_main([str(path), str(out), "--format", form])
    original, exported = torch_handle.load(path), torch_handle.load(out)
    assert exported.decoding == original.decoding
    assert exported.translate(TEXTS, num_beams=4) == original.translate(TEXTS, num_beams=4)
    with pytest.raises(SystemExit) as error:
        main(["average", str(path), str(path), "--out", str(tmp_path / "avg.ckpt")])
    assert error.value.code == (
        f"error: {path} is a Hugging Face model folder, not a training checkpoint: pass a .ckpt path, or start a run "
        "from it with --model.init_from"
    )


TARGETS = ["w3 w2 w1", "w6 w6", "w13 w12 w11", "w24", "w41 w40 w40 w41"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_init_from_trains_on_transformers_loss(family: str, tmp_path: Path) -> None:
    # --model.init_from: the module starts from the folder's weights, and the folder's tokenizer collates the rows
    # transformers' tokenizer makes (BART: <s> text </s>, the decoder starting at </s>; Marian: text </s>, from
    # <pad>), so the first step's loss is transformers' on the same batch.
    path, hf, tok = _save(family, "safetensors", tmp_path)
    tokenizer = assert_first_loss_matches(path, hf, tok)
    restored = Tokenizer.from_str(tokenizer.to_str())  # checkpoints keep the special tokens beside the vocabulary
    assert restored.specials == tokenizer.specials and restored.encode_batch(TEXTS) == tokenizer.encode_batch(TEXTS)


def assert_first_loss_matches(path: Path, hf: object, tok: object, **hf_inputs: torch.Tensor) -> Tokenizer:
    """A module started from ``path`` collates ``TEXTS`` and ``TARGETS`` as ``tok`` does, and its first loss is
    ``hf``'s on them (given ``hf_inputs`` too); returns the folder's tokenizer."""
    tokenizer = pretrained_tokenizer(path)
    rows = zip(tokenizer.encode_batch(TEXTS), tokenizer.encode_batch(TARGETS), strict=True)
    batch = Collator(64, 64, tokenizer.specials)([Example(s, "", t, "") for s, t in rows])
    reference = tok(TEXTS, text_target=TARGETS, return_tensors="pt", padding=True)
    assert torch.equal(batch["src"], reference["input_ids"])
    labels = reference["labels"]
    assert torch.equal(batch["tgt"][:, 1:], labels)
    module = Seq2SeqModule(vocab_size=tokenizer.vocab_size, label_smoothing=0.0, max_new_tokens=11, init_from=str(path))
    module.eval()
    assert module.hparams["init_from"] is None and module.hparams["transformer"] == module.config  # no folder needed
    with torch.no_grad():
        _, nll_sum, tokens = module._loss(batch)
        inputs = {"input_ids": reference["input_ids"], "attention_mask": reference["attention_mask"], **hf_inputs}
        expected = hf(**inputs, labels=labels.masked_fill(labels == tok.pad_token_id, -100)).loss
    torch.testing.assert_close(nll_sum / tokens, expected, atol=1e-5, rtol=0)
    return tokenizer


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_init_from_then_test_and_load(tmp_path: Path) -> None:
    # The CLI path: fit starts from the folder (its tokenizer too), test reads the run's checkpoint without it, and
    # the run loads for translation with the folder's special tokens.
    path, _, _ = _save("bart", "safetensors", tmp_path / "bart")
    run = tmp_path / "run"
    demo = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    common = [f"--config={demo}", f"--trainer.default_root_dir={run}", "--trainer.enable_progress_bar=false"]
    small = ["--data.init_args.demo_size=200", "--trainer.limit_val_batches=1", "--model.generate_every_n_val_epochs=0"]
    main(["fit", *common, *small, f"--model.init_from={path}", "--trainer.max_epochs=2", "--model.max_new_tokens=11"])
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["init_from"] is None
    assert checkpoint["hyper_parameters"]["transformer"]["position_offset"] == 2
    main(["test", *common, *small])
    model = torch_handle.load(run)
    assert model.tokenizer.specials == pretrained_tokenizer(path).specials
    texts = model.translate(TEXTS, num_beams=4, max_new_tokens=11)
    export_main([str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "hf"), "--format", "hf"])  # and back
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    out = back.generate(**back_tok(TEXTS, return_tensors="pt", padding=True), num_beams=4, max_length=12)
    assert texts == [text.strip() for text in back_tok.batch_decode(out, skip_special_tokens=True)]
    export_main([str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "ct2"), "--format", "ctranslate2"])
    assert {"model.bin", "shared_vocabulary.json", "tokenizer.json"} <= {p.name for p in (tmp_path / "ct2").iterdir()}


def test_ctranslate2_export_names_an_imported_option_no_family_expresses(tmp_path: Path) -> None:
    """Our own layout lacks an imported option, and the mix is no family's: one line, nothing written."""
    tokenizer = Tokenizer.train(["a b c"] * 3, 260)
    config = TransformerConfig(norm_first=True, layernorm_embedding=True, src_vocab_size=260, tgt_vocab_size=260)
    weights = {name: t.clone() for name, t in Transformer(config).state_dict().items()}
    exported = tmp_path / "model.safetensors"
    write_exported(weights, config, tokenizer.to_str(), Decoding(), exported)
    with pytest.raises(SystemExit) as error:
        export_main([str(exported), str(tmp_path / "ct2"), "--format", "ctranslate2"])
    assert error.value.code == (
        "error: layernorm_embedding=True: torch-handle's own CTranslate2 layout lacks it, and no Hugging Face family "
        "that CTranslate2 converts (BART, mBART, Marian, PEGASUS, T5) expresses it"
    )
    assert not (tmp_path / "ct2").exists()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_export_round_trips_through_transformers(family: str, tmp_path: Path) -> None:
    # --format hf: transformers loads what we write, its tokenizer encodes as ours, and its generate (with the
    # generation config written beside) equals the original's, so ours too (test_generate_matches_transformers).
    assert_round_trip(*_save(family, "safetensors", tmp_path / "in"), tmp_path / "out")


def assert_round_trip(path: Path, hf: object, tok: object, out: Path) -> None:
    """The folder ``path`` imported and written to ``out`` loads in transformers, tokenizes and generates as ``hf``."""
    write_hf(*load_pretrained(path), out)
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(out)
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    assert torch.equal(back_tok(TEXTS, return_tensors="pt", padding=True)["input_ids"], batch["input_ids"])
    for num_beams in (1, 4):
        assert torch.equal(back.generate(**batch, num_beams=num_beams), hf.generate(**batch, num_beams=num_beams))


@pytest.mark.parametrize(
    "controls",
    [
        {"no_repeat_ngram_size": 3, "repetition_penalty": 1.3, "min_new_tokens": 4},
        {"min_new_tokens": 2, "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9},
    ],
    ids=["beam-controls", "sampling"],
)
def test_hf_export_keeps_the_decoding_controls(controls: dict[str, object], tmp_path: Path) -> None:
    """import -> export --format hf -> import decodes with the same controls."""
    _save("bart", "safetensors", tmp_path / "in")
    model, tokenizer, decoding = load_pretrained(tmp_path / "in")
    decoding = dataclasses.replace(decoding, **controls)
    write_hf(model, tokenizer, decoding, tmp_path / "out")
    assert load_pretrained(tmp_path / "out")[2].controls() == decoding.controls()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_export_keeps_the_run_s_source_length(family: str, tmp_path: Path) -> None:
    """A run's ``max_source_tokens`` below the model's positions travels as the tokenizer's ``model_max_length``:
    transformers' tokenizer truncates there, and the import reads it back."""
    _save(family, "safetensors", tmp_path / "in")
    model, tokenizer, decoding = load_pretrained(tmp_path / "in")
    decoding = dataclasses.replace(decoding, max_source_tokens=decoding.max_source_tokens // 2)
    write_hf(model, tokenizer, decoding, tmp_path / "out")
    assert load_pretrained(tmp_path / "out")[2].max_source_tokens == decoding.max_source_tokens
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").model_max_length == decoding.max_source_tokens


def test_hf_export_names_the_obstacle(tmp_path: Path) -> None:
    sizes = {"d_model": 32, "num_heads": 4, "d_ff": 64, "num_encoder_layers": 1, "num_decoder_layers": 1}
    model = Transformer(TransformerConfig(**sizes, tie_embeddings=True))  # our own architecture
    expected = "sinusoid_layout='interleaved': no Hugging Face family expresses it (the nearest, marian, needs "
    with pytest.raises(ExportError, match=re.escape(expected + "sinusoid_layout='halves')")):
        write_hf(model, None, None, tmp_path)  # type: ignore[arg-type] - refused before either is read


def assert_bf16_as_close_as_transformers(path: Path, hf: object, tok: object, length: int = 6, **extra: object) -> None:
    """Under bf16 autocast our logits stay as close to the fp32 logits as transformers' own bf16 logits do (within
    twice their error): the same precision, no new loss of it. ``extra``: more inputs for transformers' model."""
    ours, batch, tgt = _model_and_inputs(path, hf, tok, length)
    with torch.no_grad():
        reference = hf(**batch, decoder_input_ids=tgt, **extra).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = hf(**batch, decoder_input_ids=tgt, **extra).logits.float()
            mine = ours(batch["input_ids"], tgt).float()
    their_error, my_error = ((x - reference).abs().max().item() for x in (theirs, mine))
    assert 0 < my_error <= 2 * their_error, f"bf16 logits off fp32 by {my_error}, transformers' by {their_error}"


def test_bf16_autocast_logits_are_as_close_as_transformers(folder: tuple[Path, object, object]) -> None:
    assert_bf16_as_close_as_transformers(*folder)
