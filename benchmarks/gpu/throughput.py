"""``throughput``: the ~400M encoder-decoder through Seq2SeqModule and ``lightning.Trainer``, against the same step in a
plain PyTorch loop (Lightning's overhead); tokens/s, MFU by the FLOPs formula (checked against ``FlopCounterMode``),
peak memory; each lever on and off in the same run. Its timed loops serve ``strategy_throughput`` as well."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from gpu.setting import THROUGHPUT_MODEL, TINY_MODEL, Setting, fmt, free_memory, mark, result_table, timed


def random_batches(vocab: int, rows: int, length: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``rows`` random sources and targets of ``length`` tokens (no padding)."""
    from torch_handle.data import BOS_ID, EOS_ID

    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        src = torch.randint(4, vocab, (rows, length), generator=generator)
        src[:, -1] = EOS_ID
        tgt = torch.randint(4, vocab, (rows, length + 1), generator=generator)
        tgt[:, 0] = BOS_ID
        batches.append({"src": src, "tgt": tgt})
    return batches


def throughput_sizes(setting: Setting) -> tuple[Any, int, int, int, int]:
    """The throughput steps' model config, rows, tokens per sequence, warm-up and timed steps."""
    from torch_handle.model import TransformerConfig

    dims = TINY_MODEL if setting.dry_run else THROUGHPUT_MODEL
    vocab, length, rows = (300, 32, 2) if setting.dry_run else (32000, 2048, 8)
    warmup, steps = (1, 2) if setting.dry_run else (3, 10)
    config = TransformerConfig(
        **dims, src_vocab_size=vocab, tgt_vocab_size=vocab, position="rope", norm_first=True, tie_embeddings=True
    )
    return config, rows, length, warmup, steps


def throughput(setting: Setting) -> dict[str, Any]:
    """The ~400M model through Seq2SeqModule and Trainer, against the same step in a plain loop; each lever on and
    off in the same run (``torch.compile`` of the layers, fused AdamW, attention without a padding mask)."""
    from torch_handle.data import EOS_ID, PAD_ID
    from torch_handle.flops import training_flops
    from torch_handle.model import Transformer

    config, rows, length, warmup, steps = throughput_sizes(setting)
    dims, vocab = TINY_MODEL if setting.dry_run else THROUGHPUT_MODEL, config.src_vocab_size
    batches = random_batches(vocab, rows, length, warmup + steps)
    padded = [{"src": b["src"].clone(), "tgt": b["tgt"]} for b in batches]
    for b in padded:  # one padding token per source: the attention needs a mask, and SDPA leaves the flash kernel
        b["src"][:, -2:] = torch.tensor([EOS_ID, PAD_ID])
    peak = setting.peak_flops()
    runs = [  # (loop, levers); "compile": the layers, "loss": the loss too, "foreach": AdamW not fused,
        # "padded": one padding token per source; "dropout0" and "double" (twice the rows): the references' setting;
        # "residual": dropout on the residual branches and embeddings only, as in the paper (and fairseq's defaults)
        ("Lightning", ()),
        ("Lightning", ("compile",)),
        ("plain", ()),
        ("plain", ("foreach",)),
        ("plain", ("padded",)),
        ("plain", ("compile", "loss")),
        ("Lightning", ("compile", "dropout0", "double")),
        ("Lightning", ("compile", "residual", "double")),
    ]
    if setting.dry_run:  # compiling needs a C++ toolchain on a CPU, and takes minutes: the GPU run measures it
        runs = [run for run in runs if "compile" not in run[1]]
    results, mfus, table = {}, {}, []
    names = {"compile": "compiled layers", "loss": "compiled loss", "foreach": "foreach AdamW",
             "padded": "one padding token per source (masked attention)",
             "dropout0": "dropout 0", "double": f"{2 * rows} rows",
             "residual": "attention and activation dropout 0 (the paper's dropout)"}  # fmt: skip
    for loop, levers in runs:
        model_config = dataclasses.replace(config, dropout=0.0) if "dropout0" in levers else config
        if "residual" in levers:
            model_config = dataclasses.replace(config, attention_dropout=0.0, activation_dropout=0.0)
        run_rows = 2 * rows if "double" in levers else rows
        inputs = padded if "padded" in levers else batches
        if run_rows != rows:
            inputs = random_batches(vocab, run_rows, length, warmup + steps)
        timing = Timing(model_config, setting, warmup, steps)
        if loop == "Lightning":  # built where it runs: a 400M model's host init took seconds a build
            step, memory = lightning_step(timing, inputs, levers, init_device=setting.device)
        else:
            step, memory = _plain_step(timing, inputs, levers)
        results[(loop, levers)] = step
        flops = training_flops(config, [length] * run_rows, [length] * run_rows)
        mfus[(loop, levers)] = flops / step / peak * 100 if peak else None
        lever = ", ".join(names[lever] for lever in levers) or "eager"
        tokens = f"{2 * run_rows * length / step:,.0f}"
        table.append([loop, lever, fmt(step, 3), tokens, fmt(mfus[(loop, levers)], 1), fmt(memory)])
        mark(" | ".join(map(str, table[-1])))  # the log keeps the rows of a step stopped at its limit
        free_memory(setting)
    # like for like: the module's `compile` compiles its layers and its loss
    pairs = {"eager": ((), ()), "compiled": (("compile",), ("compile", "loss"))}
    overhead = [
        f"{name} {(results[('Lightning', ours)] / results[('plain', theirs)] - 1) * 100:+.1f}%"
        for name, (ours, theirs) in pairs.items()
        if ("Lightning", ours) in results
    ]
    tables = []
    if not setting.dry_run:
        tables.append(_profile(config, batches, setting))
        mark("profiled step")
    with setting.device:  # initialised where it runs: a 400M model's host init took seconds a build
        model = Transformer(config).train()
    counted = _counted_flops(model, {k: v.to(setting.device) for k, v in batches[0].items()}, setting)
    mark("FLOPs counted")
    best = max((m for (_, levers), m in mfus.items() if not {"dropout0", "residual"} & set(levers) and m), default=None)
    referenced = mfus.get(("Lightning", ("compile", "dropout0", "double")))
    residual = mfus.get(("Lightning", ("compile", "residual", "double")))
    flops = training_flops(config, [length] * rows, [length] * rows)
    title = (
        f"{sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters ({dims}, dropout {config.dropout}), "
        f"vocabulary {vocab}, {rows} x ({length} + {length}) tokens a step, `{setting.precision}`, AdamW; median of "
        f"{steps} steps after {warmup}. Lightning's overhead against the plain loop: {', '.join(overhead)} (goal <= "
        f"2%). Best MFU {fmt(best, 1) or '-'}%; at dropout 0 and {2 * rows} rows, as the decoder-only references "
        f"train: {fmt(referenced, 1) or '-'}% (goal >= 45%); with dropout {config.dropout} on the residual branches "
        f"and embeddings alone, as in the paper: {fmt(residual, 1) or '-'}%. FLOPs by the formula {flops:.3e} a "
        f"step; FlopCounterMode counted {counted / flops:.3f} of them. MFU against {peak or 'no known'} FLOP/s."
    )
    header = ["loop", "levers", "step (s)", "tokens/s", "MFU (%)", "peak memory (GiB)"]
    return {"ok": True, "tables": [result_table(title, header, table), *tables]}


@dataclasses.dataclass
class Timing:
    """What every timed loop of the throughput step shares: the model's config, the device, and how many steps."""

    config: Any
    setting: Setting
    warmup: int
    steps: int


def lightning_step(
    timing: Timing,
    batches: list[dict[str, torch.Tensor]],
    levers: tuple[str, ...],
    strategy: Any = "auto",
    profiled: list[dict[str, Any]] | None = None,
    before_fit: Callable[[], None] = lambda: None,
    init_device: torch.device | str = "cpu",
) -> tuple[float, float | None]:
    """Median step of Seq2SeqModule under ``lightning.Trainer`` (its AdamW is fused on a GPU), and peak memory.
    ``profiled``: the last step runs under cProfile and the torch profiler, whose results are appended to it.
    ``before_fit`` runs once the module and trainer are built, before anything reaches the device. ``init_device``:
    where the module is built and initialised (the strategies' processes build theirs on the host before their turn)."""
    config, setting, warmup, steps = timing.config, timing.setting, timing.warmup, timing.steps
    import lightning as L

    from torch_handle.module import Seq2SeqModule

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.profilers: tuple[Any, Any] | None = None

        def on_fit_start(self, *args: Any) -> None:
            mark("on_fit_start: the strategy is set up")

        def on_train_start(self, *args: Any) -> None:
            mark("on_train_start")

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            setting.sync()
            if profiled is not None and trainer.global_step == warmup + steps - 1:
                import cProfile

                from torch.profiler import ProfilerActivity, profile

                activity = ProfilerActivity.CUDA if setting.device.type == "cuda" else ProfilerActivity.CPU
                self.profilers = (profile(activities=[activity]), cProfile.Profile())
                self.profilers[0].__enter__()
                self.profilers[1].enable()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            setting.sync()
            self.seconds.append(time.perf_counter() - self.start)
            if self.profilers is not None:
                torch_profile, host = self.profilers
                host.disable()
                torch_profile.__exit__(None, None, None)
                gpu_us = sum(e.self_device_time_total for e in torch_profile.key_averages())
                assert profiled is not None
                profiled.append({"cprofile": host, "gpu_ms": gpu_us / 1e3, "wall_ms": self.seconds[-1] * 1e3})
                self.profilers = None

    torch.manual_seed(0)
    with torch.device(init_device):
        module = Seq2SeqModule(
            transformer=config, vocab_size=config.src_vocab_size, warmup_steps=2, generate_every_n_val_epochs=0,
            compile="compile" in levers, fp8="fp8" in levers,
        )  # fmt: skip
    mark("model built")
    timer = Timer()
    trainer = L.Trainer(
        accelerator=setting.accelerator, devices=1, strategy=strategy, precision=setting.precision,
        max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    before_fit()
    setting.reset_peak()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    mark(f"fit returned: {warmup} + {steps} steps")
    timed_steps = timer.seconds[warmup : warmup + steps - (profiled is not None)]  # not the profiled one
    return sorted(timed_steps)[len(timed_steps) // 2], setting.peak_gib()


def _plain_model(config: Any, setting: Setting, levers: tuple[str, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    """One training step of a fresh model (loss, backward, AdamW) in a hand-written loop, with ``levers``: the
    module's own loss function, so that the loop differs from the LightningModule's step only by Lightning."""
    from torch_handle.loss import token_sums
    from torch_handle.model import Transformer

    torch.manual_seed(0)
    with setting.device:  # initialised where it runs, not on the host first
        model = Transformer(config).train()
    if "compile" in levers:
        for layer in (*model.encoder_layers, *model.decoder_layers):
            layer.compile()
    fused = "foreach" not in levers
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None, foreach=None if fused else True)

    sums = torch.compile(token_sums) if "loss" in levers else token_sums

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # the module's loss, per target token
        loss_sum, _, tokens = sums(logits, labels, config.pad_id, 0.1)
        return loss_sum / tokens

    def step(batch: dict[str, torch.Tensor]) -> None:
        labels = batch["tgt"][:, 1:]
        targets = labels != config.pad_id  # as the module: logits at the targets only
        with setting.autocast():
            loss = loss_fn(model(batch["src"], batch["tgt"][:, :-1], targets), labels[targets])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _plain_step(
    timing: Timing, batches: list[dict[str, torch.Tensor]], levers: tuple[str, ...]
) -> tuple[float, float | None]:
    """Median step of the same model, loss and optimizer in a hand-written loop, and peak memory."""
    setting = timing.setting
    step = _plain_model(timing.config, setting, levers)
    on_device = [{k: v.to(setting.device) for k, v in b.items()} for b in batches]
    setting.reset_peak()
    it = iter(on_device)
    return timed(lambda: step(next(it)), setting, repeats=timing.steps, warmup=timing.warmup), setting.peak_gib()


def _profile(config: Any, batches: list[dict[str, torch.Tensor]], setting: Setting) -> dict[str, Any]:
    """Where a compiled step's GPU time goes: the kernels that take most of it, from one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    step = _plain_model(config, setting, ("compile",))
    on_device = [{k: v.to(setting.device) for k, v in b.items()} for b in batches[:3]]
    step(on_device[0])
    step(on_device[1])
    setting.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(on_device[2])
        setting.sync()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = max(sum(e.self_device_time_total for e in events), 1)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    rows = [
        [e.key[:90].replace("|", "/"), e.count, fmt(e.self_device_time_total / 1e3, 1),
         fmt(e.self_device_time_total / total * 100, 1)]
        for e in events[:14]
    ]  # fmt: skip
    title = f"One compiled step (plain loop) under the profiler: {total / 1e3:,.1f} ms of GPU kernels, the largest"
    return result_table(title, ["kernel", "calls", "GPU ms", "share (%)"], rows)


def _counted_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor], setting: Setting) -> float:
    """FLOPs of one forward and backward as ``FlopCounterMode`` counts them (matrix products and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        with setting.autocast():
            logits = model(batch["src"], batch["tgt"][:, :-1])
        logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())
