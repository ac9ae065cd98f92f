"""Properties the model must keep whatever its weights: padding, causality, pooling, checkpointing, refusals,
dropout. Decoding's properties are in ``test_generation.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from torch import Tensor

from torch_handle.model import BackendUnavailableError, ConfigError, Transformer, TransformerConfig
from torch_handle.model.kernels import xformers_available
from torch_handle.model.masks import MaskSpec

pytestmark = pytest.mark.usefixtures("single_thread")

PAD, BOS, EOS = 0, 1, 2
VOCAB = 29
POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "relative"]


def _config(**overrides: Any) -> TransformerConfig:
    values: dict[str, Any] = dict(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        window=3,
        max_len=64,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
    )
    return tiny_config(**(values | overrides))


def _model(**overrides: Any) -> Transformer:
    return Transformer(_config(**overrides)).eval()


def _like(model: Transformer, **overrides: Any) -> Transformer:
    """A model with ``model``'s weights and a changed configuration."""
    other = _model(**(model.config.to_dict() | overrides))
    other.load_state_dict(model.state_dict())
    return other


def _batch(src_len: int = 13, tgt_len: int = 9) -> tuple[Tensor, Tensor]:
    src = torch.randint(3, VOCAB, (3, src_len))
    src[1, 8:] = PAD
    src[2, 2:] = PAD
    tgt = torch.randint(3, VOCAB, (3, tgt_len))
    tgt[1, 6:] = PAD
    return src, tgt


# --- padding and causality -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attention", "position"),
    [(a, p) for a in ("full", "local") for p in POSITIONS if (a, p) != ("local", "relative")],  # refused together
    ids="-".join,
)
@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@torch.no_grad()
def test_appended_padding_changes_no_logits(backend: str, attention: str, position: str) -> None:
    model = _model(attention_backend=backend, encoder_attention=attention, position=position)
    src, tgt = _batch()
    logits = model(src, tgt)
    torch.testing.assert_close(model(F.pad(src, (0, 6), value=PAD), tgt), logits)
    torch.testing.assert_close(model(src, F.pad(tgt, (0, 5), value=PAD))[:, : tgt.shape[1]], logits)


@pytest.mark.parametrize("attention", ["full", "local"])
@torch.no_grad()
def test_a_batch_without_padding_attends_unmasked_with_the_same_logits(attention: str) -> None:
    """No padding anywhere: no mask reaches the kernel (on a GPU, SDPA's flash kernel takes no mask), and the logits
    are those of the same rows next to a padded one, which needs masks."""
    model = _model(attention_backend="sdpa", encoder_attention=attention)
    src, tgt = torch.randint(3, VOCAB, (2, 13)), torch.randint(3, VOCAB, (2, 9))
    assert model.encoder_context(src).spec.key_padding is None
    assert model.decoder_context(tgt, model.memory_padding(src)).cross_spec.key_padding is None
    padded_src, padded_tgt = torch.cat((src, F.pad(src[:1, :5], (0, 8), value=PAD))), torch.cat((tgt, tgt[:1]))
    assert model.encoder_context(padded_src).spec.key_padding is not None
    torch.testing.assert_close(model(src, tgt), model(padded_src, padded_tgt)[:2])


@pytest.mark.parametrize("norm_first", [True, False])
def test_feed_forward_skips_padding_and_a_padded_batch_has_its_sentences_gradients(norm_first: bool) -> None:
    """The feed-forward blocks run on the tokens that are not padding only, and the loss reads the logits of the
    targets only; a padded batch's loss and gradients are still the sums of its sentences' own, each run alone
    without padding."""
    model = _model(norm_first=norm_first).train()  # dropout 0: training and evaluation compute the same
    src, tgt = _batch()
    labels = torch.cat((tgt[:, 1:], torch.full((3, 1), PAD)), dim=1)
    seen: list[int] = []
    for layer in (*model.encoder_layers, *model.decoder_layers):
        layer.ff.register_forward_hook(lambda _module, args, _out: seen.append(args[0].shape[0]))

    def loss(src: Tensor, tgt: Tensor, labels: Tensor) -> Tensor:
        targets = labels != PAD
        return F.cross_entropy(model(src, tgt, targets), labels[targets], reduction="sum")

    model.zero_grad()
    loss(src, tgt, labels).backward()
    batched = {name: p.grad.clone() for name, p in model.named_parameters()}
    real_src, real_tgt = int((src != PAD).sum()), int((tgt != PAD).sum())
    assert seen == [real_src] * 2 + [real_tgt] * 2, seen  # (N, C) rows, not (B * T, C)
    model.zero_grad()
    for i in range(3):
        s, t = src[i : i + 1, : int((src[i] != PAD).sum())], tgt[i : i + 1, : int((tgt[i] != PAD).sum())]
        loss(s, t, labels[i : i + 1, : t.shape[1]]).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(batched[name], p.grad, msg=name)


@pytest.mark.parametrize("norm_first", [True, False])
def test_a_padded_batch_trains_under_bf16_autocast_as_its_sentences_alone(norm_first: bool) -> None:
    """``bf16-mixed`` on padding: the feed-forward block's bf16 output goes back into the fp32 residual stream of the
    tokens that are not padding, and each sentence's logits are those it has alone, without padding."""
    model = _model(norm_first=norm_first).train()
    src, tgt = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
        logits.float().sum().backward()
        for i in range(3):
            s, t = src[i : i + 1, : int((src[i] != PAD).sum())], tgt[i : i + 1, : int((tgt[i] != PAD).sum())]
            torch.testing.assert_close(model(s, t), logits[i : i + 1, : t.shape[1]], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("position", POSITIONS)
@torch.no_grad()
def test_future_targets_never_change_earlier_logits(position: str) -> None:
    model = _model(position=position)
    src, tgt = _batch()
    changed = tgt.clone()
    changed[:, 4:] = torch.randint(3, VOCAB, (3, tgt.shape[1] - 4))
    logits, new = model(src, tgt), model(src, changed)
    torch.testing.assert_close(new[:, :4], logits[:, :4])  # position 3 reads tokens 0..3 only
    assert not torch.allclose(new[:, 4:], logits[:, 4:]), "the change should reach later positions"


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@torch.no_grad()
def test_local_attention_with_a_window_past_the_sequence_equals_full(backend: str) -> None:
    full = _model(attention_backend=backend, position="alibi")
    src, tgt = _batch()
    expected = full(src, tgt)
    for window in (src.shape[1] - 1, 4 * src.shape[1]):
        torch.testing.assert_close(_like(full, encoder_attention="local", window=window)(src, tgt), expected)
    narrow = _like(full, encoder_attention="local", window=2)(src, tgt)
    assert not torch.allclose(narrow, expected), "a narrow window should change the logits"


# --- cross-attention downsampling ----------------------------------------------------------------------


@torch.no_grad()
def test_pooled_slot_is_the_mean_of_its_real_tokens() -> None:
    r = 3
    model = _model(cross_downsample=r)
    src = torch.randint(3, VOCAB, (3, 11))  # slots [0, 3), [3, 6), [6, 9), [9, 11)
    src[1, 7:] = PAD  # slot 2 mixes real tokens and padding, slot 3 is padding only
    src[2, 2:] = PAD
    per_token = _like(model, cross_downsample=1).encode(src)  # (B, S, C)
    pooled = model.encode(src)  # (B, 4, C)
    assert pooled.shape == (3, 4, 32)
    expected_padding = torch.tensor([[False] * 4, [False, False, False, True], [False, True, True, True]])
    assert torch.equal(model.memory_padding(src), expected_padding)
    for row in range(3):
        for slot in range(4):
            real = [i for i in range(slot * r, min(slot * r + r, 11)) if src[row, i] != PAD]
            if real:
                torch.testing.assert_close(pooled[row, slot], per_token[row, real].mean(dim=0))


@torch.no_grad()
def test_padding_never_leaks_through_pooling() -> None:
    model = _model(cross_downsample=3)
    src, tgt = _batch(src_len=11)
    memory, logits = model.encode(src), model(src, tgt)
    per_token = _like(model, cross_downsample=1).encode(src)
    model.src_embed.weight[PAD].normal_(std=10.0)  # whatever the padding positions hold
    # The encoder's outputs at padding positions do change, yet no pooled slot or logit may.
    assert not torch.allclose(_like(model, cross_downsample=1).encode(src)[src == PAD], per_token[src == PAD])
    torch.testing.assert_close(model.encode(src), memory)
    torch.testing.assert_close(model(src, tgt), logits)


# --- training ------------------------------------------------------------------------------------------


def test_activation_checkpointing_changes_nothing_but_memory() -> None:
    plain = _model(activation_checkpointing=False).train()
    checkpointed = _like(plain, activation_checkpointing=True).train()
    calls: list[str] = []
    for name in ("encoder_layers", "decoder_layers"):
        getattr(checkpointed, name)[0].register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    src, tgt = _batch()
    labels = torch.randint(3, VOCAB, tgt.shape)
    losses = []
    for model in (plain, checkpointed):
        loss = F.cross_entropy(model(src, tgt)[tgt != PAD], labels[tgt != PAD])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for (name, mine), theirs in zip(checkpointed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, msg=lambda m, name=name: f"{name}: {m}")
    # Each checkpointed layer ran twice: once forward, once recomputed in the backward pass.
    assert calls.count("encoder_layers") == 2 and calls.count("decoder_layers") == 2


# --- configuration and inputs that must be refused -----------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"d_model": 30, "num_heads": 4}, "num_heads"),
        ({"activation": "swish"}, "activation"),
        ({"position": "absolute"}, "position"),
        ({"attention_backend": "triton"}, "attention_backend"),
        ({"window": 0}, "window"),
        ({"cross_downsample": 0}, "cross_downsample"),
    ],
)
def test_invalid_config_names_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _config(**overrides)


@pytest.mark.skipif(xformers_available(), reason="xformers is installed")
def test_missing_xformers_raises_with_an_install_hint() -> None:
    config = _config(attention_backend="xformers")  # the config is fine; building the model is not
    with pytest.raises(BackendUnavailableError, match=r"pip install"):
        Transformer(config)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_sequences_past_max_len_are_refused(position: str) -> None:
    model = _model(position=position, max_len=16)
    short = torch.randint(3, VOCAB, (2, 16))
    model(short, short)  # max_len itself is fine
    long = torch.randint(3, VOCAB, (2, 17))
    with pytest.raises(ValueError, match="max_len=16"):
        model(long, short)
    with pytest.raises(ValueError, match="max_len=16"):
        model(short, long)


def test_rope_runs_past_max_len() -> None:
    model = _model(position="rope", max_len=16)
    long = torch.randint(3, VOCAB, (2, 40))
    assert model(long, long).shape == (2, 40, VOCAB)


def test_rope_stays_exact_when_the_model_is_cast_to_bf16() -> None:
    # bf16 cannot hold 257: positions (or inverse frequencies) that follow ``model.to(bfloat16)`` would merge
    # neighbouring positions at long context.
    model = _model(position="rope").to(torch.bfloat16)
    cos, sin = model._rope(256, 2, torch.device("cpu"))
    assert cos.dtype == torch.float32
    assert not torch.equal(cos[0], cos[1]) and not torch.equal(sin[0], sin[1])


# --- dropout -------------------------------------------------------------------------------------------------


def test_attention_and_activation_dropout_default_to_dropout() -> None:
    """Left unset, both rates take ``dropout``: the same masks and logits as a model given all three, as every
    configuration and checkpoint written before the two fields existed expects."""
    src, tgt = _batch()
    logits = []
    for rates in ({}, {"attention_dropout": 0.3, "activation_dropout": 0.3}):
        torch.manual_seed(0)
        logits.append(Transformer(_config(dropout=0.3, **rates)).train()(src, tgt))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rates", "attention_drops", "activation_drops"),
    [
        ({"dropout": 0.5, "attention_dropout": 0.0, "activation_dropout": 0.0}, False, False),
        ({"attention_dropout": 0.5}, True, False),
        ({"activation_dropout": 0.5}, False, True),
    ],
)
def test_each_dropout_rate_drops_only_its_own_units(
    rates: dict[str, float], attention_drops: bool, activation_drops: bool
) -> None:
    """In training, self-attention and the feed-forward block differ from evaluation exactly when their own rate
    is set: ``dropout`` alone leaves both untouched (fairseq's ``--dropout`` with its 0 defaults for the others)."""
    layer = Transformer(_config(**rates)).encoder_layers[0]
    x = torch.randn(3, 7, 32)

    def outputs() -> tuple[Tensor, Tensor]:
        return layer.self_attn(x, MaskSpec()), layer.ff(x)

    layer.eval()
    evaluated = outputs()
    layer.train()
    trained = outputs()
    changed = [not torch.equal(t, e) for t, e in zip(trained, evaluated, strict=True)]
    assert changed == [attention_drops, activation_drops]


@pytest.mark.parametrize("name", ["dropout", "attention_dropout", "activation_dropout"])
def test_a_dropout_rate_of_one_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name} must be in \[0, 1\), got 1.0$"):
        _config(**{name: 1.0})
