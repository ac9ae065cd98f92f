"""``long``: ``summarization_32k``'s model, one training step at 32,768 source tokens, flex against the blocked SDPA
kernel; then the same tokens as 8 sources, then the longest source that fits, doubling."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from gpu.setting import ROOT, Setting, fmt, free_memory, mark, result_table, timed


def long(setting: Setting) -> dict[str, Any]:
    """``summarization_32k``'s model: one training step at 32,768 source tokens per kernel, then the longest source."""
    from torch_handle.model import Transformer, TransformerConfig

    settings = yaml.safe_load((ROOT / "configs" / "summarization_32k.yaml").read_text())["model"]["transformer"]
    settings = {**settings, "dropout": 0.0}  # flex has no attention dropout: both kernels without it
    length, target = (512, 16) if setting.dry_run else (32768, 256)
    if setting.dry_run:
        settings = {**settings, "window": 32}
    rows, seconds = [], {}
    for backend in ("sdpa",) if setting.dry_run else ("flex", "sdpa"):  # flex has no backward pass on a CPU
        model = Transformer(TransformerConfig(**{**settings, "attention_backend": backend})).to(setting.device)
        step, peak = _long_step(model, length, target, setting)
        seconds[backend] = step
        rows.append([backend, f"{length:,}", fmt(step, 3), f"{length / step:,.0f}", fmt(peak)])
        mark(" | ".join(rows[-1]))
        del model
        free_memory(setting)
    fastest = min(seconds, key=seconds.get)
    model = Transformer(TransformerConfig(**{**settings, "attention_backend": fastest})).to(setting.device)
    shorter = length // 8  # 8 sources of 4k against 1 of 32k: the same source and target tokens
    step, peak = _long_step(model, shorter, target // 8, setting, rows=8)
    rows.append([f"{fastest}, 8 sources", f"{shorter:,}", fmt(step, 3), f"{8 * shorter / step:,.0f}", fmt(peak)])
    flat = seconds[fastest] / step
    mark(" | ".join(rows[-1]))
    longest, deadline = length, time.monotonic() + (20 if setting.dry_run else 25)
    while time.monotonic() < deadline and longest < (2048 if setting.dry_run else 2**22):
        try:
            _long_step(model, 2 * longest, target, setting, repeats=1)
        except torch.OutOfMemoryError:
            break
        longest *= 2
    mark(f"longest source: {longest:,} tokens")
    title = (
        f"`configs/summarization_32k.yaml`'s model (dropout 0: flex has none), one source and {target} target tokens, "
        f"`{setting.precision}`, a training step (forward, backward, AdamW), median of 10. Time per source token at "
        f"{length:,} over {shorter:,} (8 sources of {target // 8} target tokens: the same tokens) with `{fastest}`: "
        f"{flat:.2f} "
        f"(goal: within 15% of 1). Longest source that trained with `{fastest}` in the time left, doubling: "
        f"{longest:,} tokens."
    )
    header = ["kernel", "source tokens", "step (s)", "source tokens/s", "peak memory (GiB)"]
    return {"ok": True, "tables": [result_table(title, header, rows)]}


def _long_step(
    model: Any, length: int, target: int, setting: Setting, repeats: int = 10, rows: int = 1
) -> tuple[float, float | None]:
    # the model's own ids, not torch_handle.data's: that package imports Lightning, slow on the GPU host
    vocab, c = model.config.src_vocab_size, model.config
    src = torch.randint(4, vocab, (rows, length), device=setting.device)
    src[:, -1] = c.eos_id
    tgt = torch.randint(4, vocab, (rows, target + 1), device=setting.device)
    tgt[:, 0] = c.bos_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with setting.autocast():
            logits = model(src, tgt[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    setting.reset_peak()
    return timed(step, setting, repeats=repeats), setting.peak_gib()
