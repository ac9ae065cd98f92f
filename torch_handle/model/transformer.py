"""The encoder-decoder Transformer of "Attention Is All You Need", with modern options."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from torch_handle.model.cache import DecoderCache
from torch_handle.model.config import TransformerConfig
from torch_handle.model.copy import CopyHead
from torch_handle.model.kernels import check_backend
from torch_handle.model.layers import DecoderLayer, EncoderLayer, make_norm
from torch_handle.model.masks import (
    DecoderContext,
    EncoderContext,
    MaskSpec,
    any_padding,
    prebuilt,
    target_padding,
    token_rows,
)
from torch_handle.model.positions import alibi_slopes, relative_bias, rope_angles, rope_inv_freq, sinusoidal_table


class Transformer(nn.Module):
    """Encoder-decoder Transformer; ``forward(src, tgt)`` returns next-token logits ``(B, T, V)`` (log-probabilities
    under ``copy_attention``, which the loss and the searches read alike).

    Sequences are right-padded with ``config.pad_id``; padding masks come from it.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        check_backend(config.attention_backend)
        self.config = config
        self.activation_checkpointing = config.activation_checkpointing
        d = config.d_model
        self.tgt_embed = nn.Embedding(config.tgt_vocab_size, d)
        share_src = config.shares_source_embedding
        self.src_embed = self.tgt_embed if share_src else nn.Embedding(config.src_vocab_size, d)
        self.lm_head = nn.Linear(d, config.tgt_vocab_size, bias=False)
        self.tie_weights()
        if config.final_logits_bias:  # a buffer, as in BART and Marian: fine-tuning leaves it as imported
            self.register_buffer("logits_bias", torch.zeros(config.tgt_vocab_size))
        if config.position == "learned":
            self.src_pos = nn.Embedding(config.position_offset + config.max_len, d)
            self.tgt_pos = nn.Embedding(config.position_offset + (config.target_length or config.max_len), d)
        self.init_buffers()
        if config.position == "relative":  # T5: a bias per head and distance bucket, one table per stack
            self.src_relative = nn.Embedding(config.relative_buckets, config.num_heads)
            self.tgt_relative = nn.Embedding(config.relative_buckets, config.num_heads)
        if config.layernorm_embedding:
            self.src_embed_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
            self.tgt_embed_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_decoder_layers))
        # Both stacks end in a LayerNorm, as in torch.nn.Transformer (pre-LN needs it; post-LN keeps parity), unless
        # ``final_norm`` is off (post-LN BART and Marian).
        self.encoder_norm = make_norm(config) if config.final_norm else nn.Identity()
        self.decoder_norm = make_norm(config) if config.final_norm else nn.Identity()
        if config.copy_attention:
            self.copy = CopyHead(d)
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Ties the output projection to the target embedding when the config says so (again after ``to_empty``,
        which unties)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight

    def init_buffers(self) -> None:
        """(Re)computes the tables that are functions of the config, not weights (also after ``to_empty``)."""
        c = self.config
        if c.position == "sinusoidal":
            self.register_buffer("pe", sinusoidal_table(c.max_len, c.d_model, c.sinusoid_layout), persistent=False)
        if c.position == "alibi":
            self.register_buffer("slopes", alibi_slopes(c.num_heads), persistent=False)

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices as torch.nn.Transformer; embeddings N(0, 1/d) since they are scaled by sqrt(d)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=self.config.d_model**-0.5)

    # --- pieces -------------------------------------------------------------------------------------------

    def _embed(
        self,
        tokens: Tensor,
        embed: nn.Embedding,
        table: nn.Embedding | None,
        offset: int | Tensor,
        norm: nn.LayerNorm | None,
        limit: tuple[str, int | None],
    ) -> Tensor:
        """``limit``: the config field that bounds this stack's positions, and its value (``max_len`` or
        ``max_target_len``)."""
        c = self.config
        x = embed(tokens)  # (B, T, C)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        if c.position in ("sinusoidal", "learned"):
            end = offset + tokens.shape[1] if isinstance(offset, int) else 0  # a static cache checked at creation
            name, most = limit
            if most is not None and end > most:
                raise ValueError(
                    f"a sequence of {end} tokens exceeds {name}={most} of position={c.position!r}: "
                    f"raise {name} or use position='rope' or 'alibi'"
                )
            positions = torch.arange(tokens.shape[1], device=tokens.device) + offset
            if table is not None:
                positions = positions + c.position_offset
            x = x + (self.pe[positions] if table is None else table(positions)).to(x.dtype)
        return self.dropout(x if norm is None else norm(x))

    def _rope(self, offset: int, length: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
        if self.config.position != "rope":
            return None
        c = self.config
        # Recomputed in fp32 on every call (head_dim / 2 numbers): a buffer would follow ``model.to(bfloat16)``,
        # and bf16 cannot even represent position 257.
        inv_freq = rope_inv_freq(c.head_dim, c.rope_base, c.rope_scaling, c.rope_scaling_factor).to(device)
        positions = torch.arange(offset, offset + length, device=device)
        return rope_angles(positions, inv_freq, c.rope_scaling, c.rope_scaling_factor)

    def _run(self, layer: nn.Module, *args: object, **kwargs: object) -> Tensor:
        if self.activation_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, use_reentrant=False, **kwargs)
        return layer(*args, **kwargs)

    @property
    def _slopes(self) -> Tensor | None:
        return self.slopes if self.config.position == "alibi" else None

    def _relative(self, encoder: bool, q_len: int, k_len: int, offset: int = 0) -> Tensor | None:
        """T5's position bias ``(1, H, q_len, k_len)`` of the encoder's or the decoder's self-attention."""
        c = self.config
        if c.position != "relative":
            return None
        table = self.src_relative if encoder else self.tgt_relative
        return relative_bias(table, q_len, k_len, offset, encoder, c.relative_max_distance)

    # --- public API ---------------------------------------------------------------------------------------

    def memory_padding(self, src: Tensor) -> Tensor:
        """``(B, S')`` padding mask of :meth:`encode`'s output: a pooled slot is padding if all of it is."""
        pad = src == self.config.pad_id
        r = self.config.cross_downsample
        if r == 1:
            return pad
        pad = F.pad(pad, (0, -pad.shape[1] % r), value=True)
        return pad.view(pad.shape[0], -1, r).all(dim=-1)

    def encode(self, src: Tensor, offset: int = 0, halo_padding: Tensor | None = None) -> Tensor:
        """Encode ``src (B, S)`` into ``memory (B, S', C)``; ``S' = ceil(S / cross_downsample)``.

        Args:
            src: Source tokens, right-padded with ``pad_id``.
            offset: Position of ``src``'s first token when it is a slice of a longer source (context parallelism):
                positions, RoPE angles and ALiBi distances are the longer source's.
            halo_padding: For such a slice under local attention, ``(B, window + S + window)``: True where a key of
                the slice or of the ``window`` positions on either side is padding (or lies outside the source).
                Those halo keys and values come from each self-attention's ``kv_hook``; see
                :mod:`torch_handle.parallel.context`.
        """
        x = self.embed_source(src, offset)
        x = self.run_encoder(x, self.encoder_context(src, offset, halo_padding))
        return self.finish_encoder(x, src)

    # The pieces of ``encode`` and of teacher-forced ``decode``, public so that a pipeline stage
    # (:mod:`torch_handle.parallel.pipeline`) runs a slice of the layers exactly as the whole model does.

    def embed_source(self, src: Tensor, offset: int = 0) -> Tensor:
        """Scaled source embeddings plus absolute positions, after dropout: the first encoder layer's input."""
        return self._embed(
            src,
            self.src_embed,
            getattr(self, "src_pos", None),
            offset,
            getattr(self, "src_embed_norm", None),
            ("max_len", self.config.max_len),
        )

    def embed_target(self, tgt: Tensor, offset: int | Tensor = 0) -> Tensor:
        """Scaled target embeddings plus absolute positions, after dropout: the first decoder layer's input."""
        return self._embed(
            tgt,
            self.tgt_embed,
            getattr(self, "tgt_pos", None),
            offset,
            getattr(self, "tgt_embed_norm", None),
            self._target_limit(),
        )

    def _target_limit(self) -> tuple[str, int | None]:
        """The config field that bounds the decoder's positions, and its value (None: unbounded)."""
        return ("max_target_len" if self.config.max_target_len else "max_len", self.config.target_length)

    def relative_biases(self, src_len: int, tgt_len: int) -> tuple[Tensor, ...]:
        """T5's position biases of a teacher-forced pass, the encoder's ``(1, H, S, S)`` and the decoder's
        ``(1, H, T, T)``; none for other positions. A pipeline's first stage computes them for the stages after it."""
        if self.config.position != "relative":
            return ()
        return self._relative(True, src_len, src_len), self._relative(False, tgt_len, tgt_len)

    def encoder_context(
        self, src: Tensor, offset: int = 0, halo_padding: Tensor | None = None, bias: Tensor | None = None
    ) -> EncoderContext:
        """What every encoder layer needs besides its input: the mask and the RoPE angles (see :meth:`encode`);
        ``bias``, T5's from :meth:`relative_biases`, when computed elsewhere."""
        c = self.config
        window = None if c.encoder_attention == "full" else c.window
        pad, rows = token_rows(src == c.pad_id)
        if halo_padding is None:
            spec = MaskSpec(
                key_padding=pad,
                window=window,
                alibi=self._slopes,
                bias=self._relative(True, src.shape[1], src.shape[1]) if bias is None else bias,
                global_keys=min(c.global_tokens, src.shape[1]) if c.encoder_attention == "longformer" else 0,
            )
            spec = prebuilt(spec, src.shape[1], src.shape[1])
        else:
            assert window is not None, "halos exist under local attention only"
            spec = MaskSpec(key_padding=halo_padding, window=window, alibi=self._slopes, q_offset=window)
        return EncoderContext(spec, self._rope(offset, src.shape[1], src.device), rows)

    def run_encoder(self, x: Tensor, context: EncoderContext, layers: range | None = None) -> Tensor:
        """Encoder layers ``layers`` (all by default) over ``x (B, S, C)``."""
        for i in range(len(self.encoder_layers)) if layers is None else layers:
            x = self._run(self.encoder_layers[i], x, context.spec, context.rope, rows=context.rows)
        return x

    def finish_encoder(self, x: Tensor, src: Tensor) -> Tensor:
        """The last encoder layer's output made ``memory``: the final norm, then pooling (``cross_downsample``)."""
        x = self.encoder_norm(x)
        if self.config.cross_downsample == 1:
            return x
        return self._pool(x, src == self.config.pad_id)

    def decoder_context(
        self, tgt: Tensor, memory_padding: Tensor, offset: int = 0, cached: bool = False, bias: Tensor | None = None
    ) -> DecoderContext:
        """What every decoder layer needs besides its input and ``memory``: masks, RoPE angles and, unless ``tgt``
        holds a cached decoding's new tokens (never padding), the rows that are not padding; ``bias``, T5's from
        :meth:`relative_biases`, when computed elsewhere."""
        length = tgt.shape[1]
        if bias is None:
            bias = self._relative(False, length, offset + length, offset)
        self_spec = MaskSpec(causal=True, alibi=self._slopes, bias=bias, q_offset=offset)
        return DecoderContext(
            prebuilt(self_spec, length, offset + length),
            MaskSpec(key_padding=any_padding(memory_padding)),
            self._rope(offset, tgt.shape[1], tgt.device),
            None if cached else token_rows(target_padding(tgt, self.config.pad_id))[1],
        )

    def run_decoder(self, x: Tensor, memory: Tensor, context: DecoderContext, layers: range | None = None) -> Tensor:
        """Decoder layers ``layers`` (all by default) over ``x (B, T, C)``, teacher-forced (no cache)."""
        c = context
        for i in range(len(self.decoder_layers)) if layers is None else layers:
            x = self._run(self.decoder_layers[i], x, memory, c.self_spec, c.cross_spec, c.rope, rows=c.rows)
        return x

    def logits(
        self, x: Tensor, targets: Tensor | None = None, copy_from: tuple[Tensor, Tensor, Tensor] | None = None
    ) -> Tensor:
        """Next-token logits ``(B, T, V)`` of the last decoder layer's output ``x (B, T, C)``; with ``targets``, a
        ``(B, T)`` mask, those positions' only, ``(N, V)``: a loss that skips padding needs no logits there. Under
        ``copy_attention``, the copy mixture's log-probabilities (``copy_from``: memory, its padding, source ids)."""
        if not self.config.copy_attention:
            return self._project(self.decoder_norm(x if targets is None else x[targets]))
        if copy_from is None:
            raise ValueError("copy_attention needs the source ids: pass decode(..., source=src) or a cache's")
        out = self.copy(h := self.decoder_norm(x), self._project(h), *copy_from)
        return out if targets is None else out[targets]

    def _project(self, x: Tensor) -> Tensor:
        logits = self.lm_head(x * self.config.d_model**-0.5 if self.config.scale_decoder_output else x)
        return self.add_logits_bias(logits)

    def add_logits_bias(self, logits: Tensor) -> Tensor:
        """``logits (..., V)`` plus ``final_logits_bias`` when the config has one. Tensor parallelism's output layer
        adds it to each process's share of the vocabulary instead (:mod:`torch_handle.parallel.tensor`)."""
        return logits + self.logits_bias.to(logits.dtype) if self.config.final_logits_bias else logits

    def _pool(self, x: Tensor, pad: Tensor) -> Tensor:
        """Mask-aware average pooling: padding never enters a slot's mean."""
        r = self.config.cross_downsample
        b, s, d = x.shape
        extra = -s % r
        keep = F.pad((~pad).to(x.dtype), (0, extra))  # (B, S + extra)
        x = F.pad(x, (0, 0, 0, extra)) * keep[..., None]
        sums = x.view(b, -1, r, d).sum(dim=2)  # (B, S', C)
        counts = keep.view(b, -1, r).sum(dim=2, keepdim=True).clamp(min=1)
        return sums / counts

    def new_cache(
        self, capacity: int, memory_padding: Tensor | None = None, source: Tensor | None = None
    ) -> DecoderCache:
        """An empty cache for decoding up to ``capacity`` target positions, one token per step; under
        ``copy_attention`` it holds the ``source`` ids, a row per source (its beams share it).

        With the source's ``memory_padding`` the cache is static: every step attends over the whole capacity (the
        positions not yet written masked) and reads its position from a tensor, with no host synchronisation (the
        one for the padding happens here); a CUDA graph can then capture a step and replay it, and ``torch.compile``
        compile it whole (:class:`torch_handle.model.steps.StaticDecoder`), attending over the positions
        written only (:meth:`DecoderCache.attend_written`).
        """
        if self.config.copy_attention and source is None:
            raise ValueError("copy_attention decodes with the source ids: pass new_cache(..., source=src)")
        if memory_padding is None:
            return DecoderCache(len(self.decoder_layers), capacity, source=source)
        c = self.config
        name, most = self._target_limit()
        if most is not None and capacity > most:
            raise ValueError(
                f"a cache of {capacity} positions exceeds {name}={most} of position={c.position!r}: "
                f"decode fewer tokens or raise {name}"
            )
        device = self.tgt_embed.weight.device
        position = torch.zeros(1, dtype=torch.long, device=device)
        cache = DecoderCache(len(self.decoder_layers), capacity, position, source)
        cache.rope = self._rope(0, capacity, device)
        # One spare key column, as the key buffers keep (see KVCache.append): a window never spans the whole table.
        cache.bias = self._relative(False, capacity, capacity + 1)
        cache.cross_spec = MaskSpec(key_padding=any_padding(memory_padding))
        return cache

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_padding: Tensor,
        cache: DecoderCache | None = None,
        targets: Tensor | None = None,
        source: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` for decoder inputs ``tgt (B, T)`` over ``memory``.

        ``memory`` holds a row for each row of ``tgt``, or for each group of consecutive rows (beam search: a source's
        beams share its row, and cross-attention reads it once). With a ``cache``, ``tgt`` holds only the new tokens;
        their positions continue the cached ones, and
        cross-attention keys and values are computed once and kept (a static cache holds the source's padding mask
        from :meth:`new_cache`, and only copy attention reads ``memory_padding``). Without one, ``targets`` (see
        :meth:`logits`) keeps the logits of those positions only, and ``source`` holds ``copy_attention``'s ids.
        """
        if cache is not None:
            source = cache.source
        copy_from = None if source is None else (memory, memory_padding, source)
        if cache is not None and cache.position is not None:
            return self._decode_static(tgt, memory, cache, copy_from)
        offset = 0 if cache is None else cache.length
        x = self.embed_target(tgt, offset)
        context = self.decoder_context(tgt, memory_padding, offset, cached=cache is not None)
        if cache is None:
            return self.logits(self.run_decoder(x, memory, context), targets, copy_from)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, context.self_spec, context.cross_spec, context.rope, cache.layers[i], cache.capacity)
        cache.length += tgt.shape[1]
        return self.logits(x, copy_from=copy_from)

    def _decode_static(
        self, tgt: Tensor, memory: Tensor, cache: DecoderCache, copy_from: tuple[Tensor, Tensor, Tensor] | None
    ) -> Tensor:
        """:meth:`decode` of one token over a static cache: the keys past the position are masked as padding."""
        if tgt.shape[1] != 1:
            raise ValueError(f"a static cache decodes one token per step, got {tgt.shape[1]}")
        position, cross_spec = cache.position, cache.cross_spec
        assert position is not None and cross_spec is not None
        keys = torch.arange(cache.capacity, device=tgt.device) if cache.window is None else cache.window
        future = (keys > position).expand(tgt.shape[0], -1)
        bias = (
            None if cache.bias is None else cache.bias.index_select(2, position)[..., : keys.shape[0]]
        )  # (1, H, 1, K)
        self_spec = MaskSpec(key_padding=future, alibi=self._slopes, bias=bias, q_offset=position.squeeze(0))
        self_spec = prebuilt(self_spec, 1, keys.shape[0])
        rope = None if cache.rope is None else (cache.rope[0][position], cache.rope[1][position])
        x = self.embed_target(tgt, position)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, memory, self_spec, cross_spec, rope, cache.layers[i], cache.capacity)
        position.add_(1)
        return self.logits(x, copy_from=copy_from)

    def forward(self, src: Tensor, tgt: Tensor, targets: Tensor | None = None) -> Tensor:
        """Teacher-forced logits ``(B, T, tgt_vocab_size)`` for ``src (B, S)`` and decoder input ``tgt (B, T)``, or
        ``(N, tgt_vocab_size)`` at the ``N`` positions of the mask ``targets (B, T)`` (see :meth:`logits`)."""
        return self.decode(tgt, self.encode(src), self.memory_padding(src), targets=targets, source=src)
