"""``decoding``: greedy with the key/value cache (eager and as a CUDA graph) against recomputing the prefix, beam-4,
and the cache on SDPA's own pick of kernel; each loop's first call too."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import yaml

from gpu.setting import ROOT, TINY_MODEL, Setting, fmt, mark, result_table, timed


def _sdpa_choices(config: Any, rows: int, length: int, setting: Setting) -> str:
    """Which kernel SDPA picks for each decoding attention (torch's own dispatcher, no kernel run): the log's clue
    to a warm-up that grows with the number of sequence lengths a loop meets (a kernel plan built per shape)."""
    from torch.nn.attention import SDPBackend

    d = config.d_model // config.num_heads
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=setting.device)  # the memory's padding mask

    def pick(queries: int, keys: int, **options: Any) -> str:
        q = torch.zeros(rows, config.num_heads, queries, d, device=setting.device, dtype=setting.dtype)
        k = torch.zeros(rows, config.num_heads, keys, d, device=setting.device, dtype=setting.dtype)
        try:
            return SDPBackend(torch._fused_sdp_choice(q, k, k, **options)).name
        except (RuntimeError, ValueError, AttributeError) as error:  # a private function: say so, do not fail the step
            return f"unknown ({type(error).__name__})"

    return (
        f"cached self-attention {pick(1, 100)}, cross-attention {pick(1, length, attn_mask=mask)}; recomputed: "
        f"causal self-attention {pick(100, 100, is_causal=True)}, cross-attention {pick(100, length, attn_mask=mask)}"
    )


@torch.no_grad()
def decoding(setting: Setting) -> dict[str, Any]:
    """Greedy with the key/value cache, eager and replayed as a CUDA graph, against recomputing the prefix; beam-4.
    The cached loop also runs on SDPA's own pick of kernel (cuDNN's on Hopper, a plan per new shape): each loop's
    first call is timed too, since that is what one ``generate`` call on a new batch meets."""
    import contextlib

    from torch_handle.model import Transformer, TransformerConfig, generate
    from torch_handle.model.kernels import decoding_kernels
    from torch_handle.model.steps import StaticDecoder

    settings = yaml.safe_load((ROOT / "configs" / "multi30k.yaml").read_text())["model"]["transformer"]
    settings = {**settings, **(TINY_MODEL if setting.dry_run else {}), "max_len": 512}
    model = Transformer(TransformerConfig(**settings)).to(setting.device).eval()
    rows, length, new = (4, 12, 16) if setting.dry_run else (64, 24, 256)
    src = torch.randint(4, model.config.src_vocab_size, (rows, length), device=setting.device)
    src[:, -1] = model.config.eos_id  # the model's ids: torch_handle.data would import Lightning (see _long_step)
    start = torch.full((rows, 1), model.config.bos_id, device=setting.device)
    mark("model built")
    mark(f"SDPA's kernel for the decoder's attention: {_sdpa_choices(model.config, rows, length, setting)}")

    def cached(kernels: Callable[[], contextlib.AbstractContextManager[None]] = decoding_kernels) -> None:
        with setting.autocast(), kernels():  # a fixed number of steps: a fresh model's EOS would end generate()
            memory, padding = model.encode(src), model.memory_padding(src)
            cache, token = model.new_cache(new), start
            for _ in range(new):
                token = model.decode(token, memory, padding, cache)[:, -1:].argmax(-1)

    def graphed() -> None:  # capture included: one graph per batch, as generate(cuda_graph=True) makes
        with setting.autocast(), decoding_kernels():
            memory, padding = model.encode(src), model.memory_padding(src)
            step, token = StaticDecoder(model, memory, padding, new, graph=True), start
            for _ in range(new):
                token = step(token)[:, -1:].argmax(-1)

    def recomputed() -> None:
        with setting.autocast(), decoding_kernels():
            memory, padding = model.encode(src), model.memory_padding(src)
            tokens = start
            for _ in range(new):
                tokens = torch.cat((tokens, model.decode(tokens, memory, padding)[:, -1:].argmax(-1)), dim=1)

    def beam() -> None:
        with setting.autocast():
            generate(model, src, 64 if not setting.dry_run else 8, num_beams=4)

    with setting.autocast():  # the process's one-time costs (cuBLAS, first kernels), before any first call is timed
        generate(model, src, 4)
    loops = {
        "cache": (cached, 3),
        "graph": (graphed, 3),
        "recomputed": (recomputed, 1),
        "beam": (beam, 3),
        "cache, SDPA's pick": (functools.partial(cached, contextlib.nullcontext), 3),  # last: its plans stay cached
    }
    seconds, first = {}, {}
    for name, (fn, repeats) in loops.items():
        setting.sync()
        begun = time.perf_counter()
        fn()
        setting.sync()
        first[name] = time.perf_counter() - begun
        seconds[name] = timed(fn, setting, repeats=repeats, warmup=0)
        mark(f"{name}: {seconds[name]:.3f} s, first call {first[name]:.1f} s")
    without = seconds["recomputed"]
    title = (
        f"The Multi30k recipe's model (`configs/multi30k.yaml`, fresh weights), {rows} sources of {length} tokens, "
        f"`{setting.precision}`, attention on SDPA's kernels other than cuDNN's (as `generate` runs) unless said. "
        f"Greedy at {new} new tokens with the cache: {without / seconds['cache']:.1f}x faster than recomputing "
        f"eagerly, {without / seconds['graph']:.1f}x replayed as a CUDA graph (goal >= 5x). First call: the same "
        "call on a process that has not yet met these shapes."
    )
    header = ["decoding", "seconds", "sentences/s", "first call (s)"]
    names = {
        "cache": f"greedy, {new} tokens, key/value cache",
        "graph": f"greedy, {new} tokens, static key/value cache, CUDA graph (capture included)",
        "recomputed": f"greedy, {new} tokens, prefix recomputed",
        "beam": "beam 4, up to 64 tokens (stops at EOS)",
        "cache, SDPA's pick": f"greedy, {new} tokens, key/value cache, SDPA's own pick of kernel (cuDNN's on Hopper)",
    }
    table = [[names[n], fmt(seconds[n], 3), fmt(rows / seconds[n], 1), fmt(first[n], 2)] for n in loops]
    return {"ok": True, "tables": [result_table(title, header, table)]}
