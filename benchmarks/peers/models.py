"""What bench_peers compares: the implementations, the one size they share (:class:`Sizes`), our model and the
Hugging Face peers built at that size from fresh weights, and the training batches and decoding sources every child
uses alike."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0-3, the layout torch_handle.ctranslate2 expects
IMPLS = ["ours", "bart", "marian", "ct2-fp32", "ct2-int8"]
TRAINABLE = ["ours", "imported", "bart", "marian"]  # imported: HF BART's folder read into ours (--model.init_from)
INT8 = ["ours", "ours-int8", "ct2-fp32", "ct2-int8"]  # --quantize int8: ours eager fp32 and int8 against CTranslate2
NAMES = {"ours": "ours", "bart": "HF BART", "marian": "HF Marian", "ct2-fp32": "CT2 fp32", "ct2-int8": "CT2 int8"}
NAMES["ours-int8"] = "ours int8"
NAMES["imported"] = "ours from HF BART's folder"
LABEL_SMOOTHING = 0.1  # as every shipped config
DROPOUT = 0.1
TRAIN_BATCHES = 4  # distinct training batches, cycled


@dataclass(frozen=True)
class Sizes:
    d_model: int
    num_heads: int
    layers: int
    d_ff: int
    vocab: int
    batch: int  # training: batch x seq source tokens and as many target tokens
    seq: int
    sources: int  # decoding: sources x source_len tokens in, new_tokens out per source
    source_len: int
    new_tokens: int
    beams: int

    @property
    def max_len(self) -> int:
        return max(self.seq, self.source_len, self.new_tokens + 1)


SIZES = {
    "full": Sizes(256, 4, 3, 1024, 8000, batch=32, seq=64, sources=16, source_len=24, new_tokens=48, beams=5),
    "dry": Sizes(32, 2, 1, 64, 64, batch=4, seq=8, sources=3, source_len=5, new_tokens=6, beams=5),
}


def our_model(s: Sizes, no_eos: bool = True) -> Any:  # noqa: ANN401 - torch arrives lazily, in the child
    """Our Transformer as the shipped configs build it (pre-LN, sinusoidal, tied), fresh weights from seed 0.

    With ``no_eos`` (decoding), its ``decode`` rules EOS out, so that generation runs to exactly ``max_new_tokens``
    like the peers' minimum-length options; the weights are untouched, so the CTranslate2 export sees the same
    model. Training takes the plain model: an EOS label under a -inf logit would make the loss infinite.
    """
    import torch

    from torch_handle.model import Transformer, TransformerConfig

    class _NoEos(Transformer):
        def decode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            logits = super().decode(*args, **kwargs)
            logits[..., EOS] = float("-inf")
            return logits

    torch.manual_seed(0)
    return (_NoEos if no_eos else Transformer)(TransformerConfig(**our_config(s)))


def our_config(s: Sizes) -> dict[str, Any]:
    return {
        "src_vocab_size": s.vocab,
        "tgt_vocab_size": s.vocab,
        "d_model": s.d_model,
        "num_heads": s.num_heads,
        "num_encoder_layers": s.layers,
        "num_decoder_layers": s.layers,
        "d_ff": s.d_ff,
        "dropout": DROPOUT,
        "activation": "relu",
        "norm_first": True,
        "position": "sinusoidal",
        "max_len": s.max_len,
        "tie_embeddings": True,
        "pad_id": PAD,
        "bos_id": BOS,
        "eos_id": EOS,
    }


def hf_config(impl: str, s: Sizes) -> dict[str, Any]:
    """The same size for BART (learned positions, post-LN + embedding LayerNorm) and Marian (sinusoidal, post-LN)."""
    return {
        "vocab_size": s.vocab,
        "d_model": s.d_model,
        "encoder_layers": s.layers,
        "decoder_layers": s.layers,
        "encoder_attention_heads": s.num_heads,
        "decoder_attention_heads": s.num_heads,
        "encoder_ffn_dim": s.d_ff,
        "decoder_ffn_dim": s.d_ff,
        "activation_function": "relu",
        "dropout": DROPOUT,
        "attention_dropout": DROPOUT,
        "activation_dropout": DROPOUT,
        "max_position_embeddings": s.max_len,
        "scale_embedding": True,  # x sqrt(d_model), as ours
        "tie_word_embeddings": True,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "decoder_start_token_id": BOS,
        "forced_eos_token_id": None,  # BART's default forces EOS as the last token
        **({"share_encoder_decoder_embeddings": True} if impl == "marian" else {}),
    }


def hf_model(impl: str, s: Sizes) -> Any:  # noqa: ANN401
    import torch
    from transformers import AutoModelForSeq2SeqLM, BartConfig, MarianConfig

    config = (BartConfig if impl == "bart" else MarianConfig)(**hf_config(impl, s))
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def imported_bart(s: Sizes) -> Any:  # noqa: ANN401
    """:func:`hf_model`'s BART written by ``save_pretrained`` and read back as ``--model.init_from`` reads a folder:
    the same architecture and weights (post-LN, learned positions, embedding LayerNorm, output bias) in ours."""
    import tempfile
    from pathlib import Path

    from torch_handle.model import Transformer
    from torch_handle.pretrained.trained import init_config, init_weights

    with tempfile.TemporaryDirectory() as folder:
        hf_model("bart", s).save_pretrained(folder)
        model = Transformer(init_config(Path(folder)))
        init_weights(model, Path(folder))
    return model


def count_parameters(model: Any) -> int:  # noqa: ANN401
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def training_batch(torch: Any, generator: Any, s: Sizes) -> tuple[Any, Any, Any]:  # noqa: ANN401
    """Right-padded source, decoder input (BOS + target) and labels (target + EOS) of random lengths."""
    src = torch.randint(4, s.vocab, (s.batch, s.seq), generator=generator)
    tokens = torch.randint(4, s.vocab, (s.batch, s.seq), generator=generator)
    src_len = torch.randint(s.seq // 2, s.seq + 1, (s.batch,), generator=generator)
    tgt_len = torch.randint(s.seq // 2, s.seq, (s.batch,), generator=generator)  # + EOS <= seq
    position = torch.arange(s.seq)
    src[position >= src_len[:, None]] = PAD
    labels = tokens.clone()
    labels[position == tgt_len[:, None]] = EOS
    labels[position > tgt_len[:, None]] = PAD
    tgt = torch.cat([torch.full((s.batch, 1), BOS), labels[:, :-1]], dim=1).masked_fill(labels == PAD, PAD)
    return src, tgt, labels


def decoding_sources(s: Sizes) -> list[list[int]]:
    """The decoding inputs, the same in every child: ``source_len - 1`` random tokens and EOS, as our collator."""
    rng = random.Random(2)
    return [[rng.randrange(len(SPECIALS), s.vocab) for _ in range(s.source_len - 1)] + [EOS] for _ in range(s.sources)]


def vocabulary(s: Sizes) -> list[str]:
    """The vocabulary strings in id order that the CTranslate2 model folder holds."""
    return SPECIALS + [f"w{i}" for i in range(len(SPECIALS), s.vocab)]


def decoding_impls(device: str, quantize: str | None = None) -> list[str]:
    """The implementations that decode: CTranslate2 on the CPU only, where its goal is; int8 against CTranslate2."""
    return INT8 if quantize else IMPLS if device == "cpu" else IMPLS[:3]
