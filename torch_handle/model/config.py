"""The model's hyper-parameters: plain values that check themselves."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
Position = Literal["sinusoidal", "learned", "rope", "alibi", "relative"]
Norm = Literal["layer", "rms"]
RopeScaling = Literal["linear", "ntk"]
SinusoidLayout = Literal["interleaved", "halves"]
EncoderAttention = Literal["full", "local", "longformer"]
AttentionBackend = Literal["auto", "naive", "sdpa", "flex", "xformers"]


# The options T5 brought (torch_handle.pretrained.t5), as a model without them has them: what exports of other
# architectures require.
WITHOUT_T5: dict[str, Any] = {
    "norm": "layer",
    "bias": True,
    "gated_ff": False,
    "scale_attention": True,
    "attention_head_dim": None,
    "scale_decoder_output": False,
}


class ConfigError(ValueError):
    """A hyper-parameter that cannot work; the message names the field and the fix."""


_CHOICES: dict[str, tuple[Any, ...]] = {
    "activation": ("relu", "gelu", "gelu_tanh", "silu"),
    "sinusoid_layout": ("interleaved", "halves"),
    "position": ("sinusoidal", "learned", "rope", "alibi", "relative"),
    "norm": ("layer", "rms"),
    "rope_scaling": (None, "linear", "ntk"),
    "encoder_attention": ("full", "local", "longformer"),
    "attention_backend": ("auto", "naive", "sdpa", "flex", "xformers"),
}
_INTEGERS = (  # the sizes every model reads
    "src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff", "max_len", "num_encoder_layers",
    "num_decoder_layers",
)  # fmt: skip


@dataclass
class TransformerConfig:
    """Hyper-parameters of the encoder-decoder Transformer.

    Defaults are the paper's base model ("Attention Is All You Need", post-LN, sinusoidal positions).

    Args:
        src_vocab_size: Source vocabulary size.
        tgt_vocab_size: Target vocabulary size.
        d_model: Width of every residual stream.
        num_heads: Attention heads; must divide ``d_model``.
        num_encoder_layers: Encoder depth.
        num_decoder_layers: Decoder depth.
        d_ff: Hidden width of the feed-forward blocks.
        dropout: Dropout on the embeddings and residual branches, and by default on feed-forward hidden units and
            attention weights too.
        attention_dropout: Dropout on the attention weights; ``None`` takes ``dropout``. fairseq's and Hugging
            Face's seq2seq models default it to 0.
        activation_dropout: Dropout on the feed-forward hidden units; ``None`` takes ``dropout`` (fairseq: 0).
        activation: Feed-forward non-linearity (``silu`` is Marian's "swish", ``gelu_tanh`` the tanh approximation
            T5 v1.1 uses).
        gated_ff: A gated feed-forward block, ``linear2(act(linear1(x)) * gate(x))`` (T5 v1.1, Flan-T5, mT5).
        bias: Biases in the attention and feed-forward projections (T5 has none).
        norm: ``layer`` is LayerNorm; ``rms`` is T5's RMSNorm (no mean, no bias, its statistics in fp32).
        norm_first: ``False`` is post-LN as in the paper; ``True`` is pre-LN, which trains deep stacks
            without warmup tricks.
        position: How positions enter: additive ``sinusoidal`` or ``learned`` tables, ``rope`` rotations
            or ``alibi`` biases, or T5's ``relative`` bucketed biases learned per head (the last three extrapolate
            beyond ``max_len``).
        sinusoid_layout: Columns of the ``sinusoidal`` table: ``interleaved`` sines and cosines as in the paper,
            or sines then cosines in ``halves`` (Marian, PEGASUS).
        position_offset: Rows of the ``learned`` table before position 0 (BART and mBART keep 2).
        relative_buckets: Buckets of ``relative`` positions (T5's ``relative_attention_num_buckets``).
        relative_max_distance: Distance from which ``relative`` positions share the last bucket.
        attention_head_dim: Width of each attention head; ``None`` is ``d_model // num_heads`` (T5's ``d_kv`` may
            differ).
        scale_attention: Divide attention scores by sqrt(head width); T5 does not.
        rope_scaling: How RoPE stretches beyond its trained length: ``linear`` (position interpolation)
            or ``ntk`` (base rescaling); ``None`` leaves it unscaled.
        rope_scaling_factor: Stretch factor for ``rope_scaling`` (>= 1).
        rope_base: RoPE's frequency base.
        max_len: Longest sequence for the ``sinusoidal`` and ``learned`` tables; the trained length that
            RoPE scaling refers to.
        max_target_len: Longest decoder sequence for those tables, when the decoder's is shorter than the encoder's
            (LED); ``None`` is ``max_len``.
        encoder_attention: ``full`` or ``local`` (sliding-window) self-attention in the encoder, or ``longformer``
            (LED's): local, plus ``global_tokens`` that attend to every position through projections of their own,
            and that every position attends to.
        window: For local attention, how many positions on each side a token attends to.
        global_tokens: Under ``longformer`` attention, how many of a source's first positions are global (LED
            summarizes with its first, ``<s>``; 0 leaves the windows alone).
        attention_backend: Attention kernel; ``auto`` picks the fastest that supports the configuration on
            the current device.
        copy_attention: Mix a copy distribution over the source's tokens into the output (OpenNMT's copy
            generator); needs one vocabulary for source and target, and ``cross_downsample`` 1.
        cross_downsample: Average-pool the encoder output by this factor before cross-attention (1 = off).
        activation_checkpointing: Recompute each layer's activations in the backward pass.
        tie_embeddings: Share the target embedding with the output projection (and with the source
            embedding when both vocabularies have the same size), as in the paper.
        share_source_embedding: Whether the source and target embeddings are one table; ``None`` follows
            ``tie_embeddings`` as above. ``True`` needs equal vocabulary sizes.
        scale_embeddings: Multiply token embeddings by sqrt(d_model), as the paper and Marian; BART does not.
        layernorm_embedding: A LayerNorm over embeddings plus positions in each stack (BART, mBART).
        final_norm: End each stack in a LayerNorm; pre-LN needs it, post-LN BART and Marian have none.
        scale_decoder_output: Multiply the last decoder states by d_model**-0.5 before the output projection (T5
            v1.0, whose projection is the embedding).
        final_logits_bias: A bias added to the logits, kept as a buffer (BART, Marian: not trained).
        layer_norm_eps: Epsilon of every LayerNorm.
        pad_id: Padding token id; padding masks are derived from it.
        bos_id: Token that starts every decoder input (Hugging Face's ``decoder_start_token_id``, which is EOS for
            BART and padding for Marian).
        eos_id: Token that ends a sequence.
        suppress_ids: Tokens never generated; ``None`` rules out ``pad_id`` and ``bos_id``.
        forced_bos_id: Token forced as the first generated one (BART's ``forced_bos_token_id``).
        forced_eos_id: Token forced as the last one when an output reaches its length limit.
    """

    src_vocab_size: int = 8000
    tgt_vocab_size: int = 8000
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    activation: Activation = "relu"
    gated_ff: bool = False
    bias: bool = True
    norm: Norm = "layer"
    norm_first: bool = False
    position: Position = "sinusoidal"
    sinusoid_layout: SinusoidLayout = "interleaved"
    position_offset: int = 0
    relative_buckets: int = 32
    relative_max_distance: int = 128
    attention_head_dim: int | None = None
    scale_attention: bool = True
    rope_scaling: RopeScaling | None = None
    rope_scaling_factor: float = 1.0
    rope_base: float = 10000.0
    max_len: int = 1024
    max_target_len: int | None = None
    encoder_attention: EncoderAttention = "full"
    window: int = 512
    global_tokens: int = 1
    attention_backend: AttentionBackend = "auto"
    cross_downsample: int = 1
    copy_attention: bool = False
    activation_checkpointing: bool = False
    tie_embeddings: bool = False
    share_source_embedding: bool | None = None
    scale_embeddings: bool = True
    layernorm_embedding: bool = False
    final_norm: bool = True
    scale_decoder_output: bool = False
    final_logits_bias: bool = False
    layer_norm_eps: float = 1e-5
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    suppress_ids: list[int] | None = None
    forced_bos_id: int | None = None
    forced_eos_id: int | None = None

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {choices}")
        for name in _INTEGERS:  # a JSON string such as "64" would otherwise fail as a comparison, naming nothing
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_encoder_layers", "num_decoder_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.d_model % self.num_heads and self.attention_head_dim is None:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: "
                "choose num_heads that divides d_model"
            )
        if self.attention_head_dim is not None and self.attention_head_dim < 1:
            raise ConfigError(f"attention_head_dim must be >= 1, got {self.attention_head_dim}")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"position='rope' needs an even head dimension, got {self.head_dim}")
        # The first buckets//2 distances are exact (the decoder's); only farther ones share log-spaced buckets.
        if self.position == "relative" and (
            self.relative_buckets < 4 or self.relative_max_distance <= self.relative_buckets // 2
        ):
            raise ConfigError(
                f"position='relative' needs relative_buckets >= 4 and relative_max_distance > relative_buckets // 2, "
                f"got {self.relative_buckets} and {self.relative_max_distance}"
            )
        if self.position == "relative" and self.encoder_attention == "local":
            raise ConfigError(
                "position='relative' attends with a dense bias: set encoder_attention: full, or position: alibi"
            )
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value}")
        if self.window < 1:
            raise ConfigError(f"window must be >= 1, got {self.window}")
        if self.global_tokens < 0:
            raise ConfigError(f"global_tokens must be >= 0, got {self.global_tokens}")
        if self.max_target_len is not None and self.max_target_len < 1:
            raise ConfigError(f"max_target_len must be >= 1 or None, got {self.max_target_len}")
        if self.encoder_attention == "longformer" and self.position not in ("sinusoidal", "learned"):
            raise ConfigError(
                f"encoder_attention='longformer' (LED's) takes absolute positions: set position learned or "
                f"sinusoidal, got {self.position!r}"
            )
        if self.cross_downsample < 1:
            raise ConfigError(f"cross_downsample must be >= 1 (1 = off), got {self.cross_downsample}")
        if self.copy_attention and (self.cross_downsample != 1 or self.src_vocab_size != self.tgt_vocab_size):
            raise ConfigError("copy_attention copies source tokens into the output: it needs one vocabulary for both "
                              "and cross_downsample 1")  # fmt: skip
        if self.rope_scaling_factor < 1.0:
            raise ConfigError(f"rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}")
        if self.rope_scaling is not None and self.position != "rope":
            raise ConfigError(f"rope_scaling={self.rope_scaling!r} needs position='rope', got {self.position!r}")
        if self.position_offset < 0:
            raise ConfigError(f"position_offset must be >= 0, got {self.position_offset}")
        if self.share_source_embedding and self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError(
                f"share_source_embedding needs equal vocabularies, got {self.src_vocab_size} and {self.tgt_vocab_size}"
            )
        ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        for name, value in ids.items():
            if not 0 <= value < min(self.src_vocab_size, self.tgt_vocab_size):
                raise ConfigError(f"{name}={value} is outside the vocabulary")
        if self.pad_id == self.eos_id:
            raise ConfigError(f"pad_id and eos_id must differ, got {self.pad_id}")
        if self.bos_id in (self.pad_id, self.eos_id) and self.suppress_ids is None:
            raise ConfigError(
                f"bos_id={self.bos_id} is also padding or EOS: list the tokens never generated in suppress_ids"
            )
        for name, value in (("forced_bos_id", self.forced_bos_id), ("forced_eos_id", self.forced_eos_id)):
            if value is not None and not 0 <= value < self.tgt_vocab_size:
                raise ConfigError(f"{name}={value} is outside the target vocabulary")

    @property
    def context_length(self) -> int | None:
        """Longest sequence the position encoding supports: ``max_len`` for tables, None for the others."""
        return self.max_len if self.position in ("sinusoidal", "learned") else None

    @property
    def target_length(self) -> int | None:
        """Longest decoder sequence the position encoding supports: ``max_target_len`` or ``max_len`` for tables,
        None for the others."""
        return None if self.context_length is None else self.max_target_len or self.max_len

    @property
    def shares_source_embedding(self) -> bool:
        """Whether the source and target embeddings are one table (see ``share_source_embedding``)."""
        if self.share_source_embedding is not None:
            return self.share_source_embedding
        return self.tie_embeddings and self.src_vocab_size == self.tgt_vocab_size

    @property
    def suppressed(self) -> list[int]:
        """The tokens never generated: ``suppress_ids``, or padding and BOS."""
        return [self.pad_id, self.bos_id] if self.suppress_ids is None else list(self.suppress_ids)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.d_model // self.num_heads

    @property
    def attention_p(self) -> float:
        """The attention weights' dropout rate: ``attention_dropout``, or ``dropout`` when that is None."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def activation_p(self) -> float:
        """The feed-forward hidden units' dropout rate: ``activation_dropout``, or ``dropout`` when that is None."""
        return self.dropout if self.activation_dropout is None else self.activation_dropout

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# A module built in Python keeps its config as this dataclass in its checkpoint's hyper-parameters: plain data
# that ``torch.load(weights_only=True)`` may rebuild wherever the config class is importable.
torch.serialization.add_safe_globals([TransformerConfig])
