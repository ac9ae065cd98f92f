"""``torch_handle.load(..., quantize="int8")``: dynamic int8 linears for decoding on a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

import torch_handle
from torch_handle.model import generate
from torch_handle.quantize import Int8Attention

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
    ids = fp32.tokenizer.encode_batch(SENTENCES)
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for row in ids], batch_first=True, padding_value=0)
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


def test_quantize_on_a_device_other_than_the_cpu_or_compiled_is_one_line(tiny_demo_run: Path) -> None:
    with pytest.raises(ValueError, match=r"^quantize='int8' decodes on a CPU, but device='meta': pass device='cpu'$"):
        torch_handle.load(tiny_demo_run, device="meta", quantize="int8")
    with pytest.raises(ValueError, match=r"^quantize='int8' decodes eagerly, and compiled it is no faster: drop"):
        torch_handle.load(tiny_demo_run, compile=True, quantize="int8")
