"""``torch_handle.load(..., quantize="int8")``: dynamic int8 linears for decoding on a CPU."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

import torch_handle
from tests.helpers import pretrained_folder
from torch_handle.errors import SetupError
from torch_handle.model import CompiledDecode, Transformer, generate
from torch_handle.model.steps import StaticDecoder
from torch_handle.quantize import STEP, Int8Attention, Int8Linear, quantize

pytestmark = pytest.mark.usefixtures("single_thread")

SENTENCES = ["the king sees the big red house near the old river", "a cat", "my two old birds helped the king"]


@pytest.fixture(scope="module")
def models(tiny_demo_run: Path) -> tuple[torch_handle.api.Model, torch_handle.api.Model]:
    return torch_handle.load(tiny_demo_run), torch_handle.load(tiny_demo_run, quantize="int8")


def test_int8_turns_every_linear_into_a_dynamic_int8_one(models: tuple) -> None:
    fp32, int8 = models
    assert not any(isinstance(m, torch.nn.Linear) for m in int8.model.modules())
    linears = [m for m in int8.model.modules() if isinstance(m, DynamicInt8Linear)]
    # Each attention's out_proj and packed projection (cross-attention: its query rows and key/value rows apart),
    # each layer's two feed-forward matrices, the output projection.
    attentions = [m for m in int8.model.modules() if isinstance(m, Int8Attention)]
    model = fp32.model
    assert len(attentions) == len(model.encoder_layers) + 2 * len(model.decoder_layers)
    assert {tuple(a.int8) for a in attentions} == {("qkv",), ("q", "kv")}
    layers = len(model.encoder_layers) + len(model.decoder_layers)
    assert len(linears) == sum(1 + len(a.int8) for a in attentions) + 2 * layers + 1
    assert {m.weight().qscheme() for m in linears} == {torch.per_channel_affine}
    assert all(m.weight().dtype == torch.qint8 for m in linears)


def test_int8_logits_are_within_a_percent_of_the_fp32_range_and_greedy_and_beam_outputs_agree(models: tuple) -> None:
    fp32, int8 = models
    src = _sources(fp32)
    tgt = generate(fp32.model, src, 8)  # (B, T): the fp32 greedy outputs, teacher-forced into both models
    with torch.no_grad():
        reference, quantized = fp32.model(src, tgt), int8.model(src, tgt)
    # int8 weights carry one 255th of each row's range as their step, activations one 255th of theirs: the error of
    # a logit is a small multiple of that, a percent of the logits' range, far below the margins greedy decides on.
    scale = reference.max() - reference.min()
    assert (quantized - reference).abs().max() <= 0.01 * scale
    assert (quantized.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95
    for beams in (1, 3):
        assert int8.translate(SENTENCES, num_beams=beams) == fp32.translate(SENTENCES, num_beams=beams)


def test_a_bad_quantize_value_is_one_line(tiny_demo_run: Path) -> None:
    with pytest.raises(ValueError, match=r"^quantize='int4' is not a scheme: pass quantize='int8' or leave it None$"):
        torch_handle.load(tiny_demo_run, quantize="int4")


def test_quantize_off_the_cpu_or_compiled_without_torchao_is_one_line(
    tiny_demo_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"^quantize='int8' decodes on a CPU, but device='meta': pass device='cpu'$"):
        torch_handle.load(tiny_demo_run, device="meta", quantize="int8")
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # what an environment without torchao imports
    with pytest.raises(
        SetupError, match=r"^quantize='int8' with compile=True needs torchao: pip install 'torch-handle\[int8\]'$"
    ):
        torch_handle.load(tiny_demo_run, compile=True, quantize="int8")


def test_int8_for_a_compiled_step_holds_the_step_linears_twice_and_decodes_eagerly_as_int8(
    tiny_demo_run: Path, models: tuple
) -> None:
    # compile=True: the linears of the decoder's step keep FBGEMM's int8 linear for eager decoding (the same as
    # without compile) beside torchao's int8 weights for the compiled step; the encoder's stay FBGEMM's alone.
    fp32, int8 = models
    model = torch_handle.load(tiny_demo_run).model
    quantize(model, "int8", compile=True)
    twice = {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    linears = {name for name, m in int8.model.named_modules() if isinstance(m, DynamicInt8Linear)}
    assert set(twice) == {name for name in linears if name.startswith(STEP)}
    assert any(name.startswith("decoder_layers.") for name in twice) and "lm_head" in twice
    assert all(isinstance(m.eager, DynamicInt8Linear) for m in twice.values())
    assert {type(m.compiled.weight).__name__ for m in twice.values()} == {"Int8Tensor"}
    encoder = [m for m in model.encoder_layers.modules() if isinstance(m, (DynamicInt8Linear, Int8Linear))]
    assert encoder and all(isinstance(m, DynamicInt8Linear) for m in encoder)
    src = _sources(fp32)
    for beams in (1, 3):
        assert torch.equal(generate(model, src, 8, beams), generate(int8.model, src, 8, beams))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["demo", "bart", "t5", "led", "copy"])
def test_int8_compiled_step_is_as_close_to_fp32_as_eager_int8(family: str, tiny_demo_run: Path) -> None:
    # quantize(..., compile=True) under CompiledDecode: the step compiled with torchao's int8 weights, activations
    # quantized per row, not FBGEMM's (its logits differ from the eager step's). Teacher-forced, they are as close to
    # fp32's as eager int8's, within 3% of their range (T5 v1.1's random weights the farthest). "copy": the demo model
    # with a fresh copy head (copy_attention), whose two linears are in the step too.
    path = tiny_demo_run if family in ("demo", "copy") else pretrained_folder(family)
    loaded = torch_handle.load(path)
    fp32 = loaded.model
    if family == "copy":
        fp32 = Transformer(dataclasses.replace(fp32.config, copy_attention=True)).eval()
        fp32.load_state_dict(loaded.model.state_dict(), strict=False)
    eager, compiled = copy.deepcopy(fp32), copy.deepcopy(fp32)
    quantize(eager, "int8")
    quantize(compiled, "int8", compile=True)
    src = _sources(loaded)
    c = fp32.config
    tgt = torch.cat([torch.full((3, 1), c.bos_id), torch.randint(3, c.tgt_vocab_size, (3, 7))], 1)  # decoder input
    memory, padding = fp32.encode(src), fp32.memory_padding(src)
    source = src if c.copy_attention else None
    steps = {}  # teacher-forced logits, a step at a time: FBGEMM quantizes each call's rows with one scale
    for name, model, decode in (
        ("eager", eager, None),
        ("held twice, eager", compiled, None),
        ("compiled", compiled, CompiledDecode(compiled)),
    ):
        static = StaticDecoder(model, model.encode(src), padding, 8, graph=False, decode=decode, source=source)
        with torch.no_grad():
            steps[name] = torch.cat([static(tgt[:, i : i + 1]) for i in range(tgt.shape[1])], 1)
    cache = fp32.new_cache(8, source=source)
    with torch.no_grad():
        reference = fp32(src, tgt)
        expected = torch.cat([fp32.decode(tgt[:, i : i + 1], memory, padding, cache) for i in range(8)], 1)
        torch.testing.assert_close(expected, reference, atol=1e-4, rtol=1e-4)  # the step's reference is fp32's
        scale = reference.max() - reference.min()
        eager_error = (steps["eager"] - reference).abs().max() / scale
        compiled_error = (steps["compiled"] - reference).abs().max() / scale
    assert torch.equal(steps["held twice, eager"], steps["eager"])  # eagerly: FBGEMM's linears
    assert not torch.allclose(steps["compiled"], steps["eager"], atol=1e-4)  # compiled: torchao's
    assert compiled_error <= min(eager_error + 0.005, 0.03), (compiled_error, eager_error)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_int8_compiled_translates_as_fp32_greedy_and_beam(tiny_demo_run: Path, models: tuple) -> None:
    fp32, _ = models
    compiled = torch_handle.load(tiny_demo_run, quantize="int8", compile=True)
    assert compiled._decode is not None
    for beams in (1, 3):
        assert compiled.translate(SENTENCES, num_beams=beams) == fp32.translate(SENTENCES, num_beams=beams)


def _sources(model: torch_handle.api.Model) -> torch.Tensor:
    ids = model.tokenizer.encode_batch(SENTENCES)
    rows = [torch.tensor(row) for row in ids]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=model.model.config.pad_id)
