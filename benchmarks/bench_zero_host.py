"""DeepSpeed's host time per step against DDP, one process each: what our two settings of it save.

On one device ZeRO partitions nothing away, and what it adds to a step is Python, tensor by tensor or module by module:
- ZeRO-2 checks every gradient for inf/NaN (two reductions and a test per tensor, then a host sync), whether or not a
  loss scale exists; bf16 has none, and :class:`torch_handle.strategies.DeepSpeedStrategy` turns the check off in
  bf16 unless a DeepSpeed config asks for it.
- ZeRO-3 gathers and releases parameters in hooks around every submodule; the strategy makes each encoder and
  decoder layer one unit instead (:func:`torch_handle.parallel.set_zero3_units`).
Each setting is the module's Lightning step (``gpu.throughput.lightning_step``) in ``bf16-mixed`` of a model as
deep as the GPU suite's ~400M one (365 parameter tensors, 24 layers) but narrow, so the step is mostly host time;
each in its own process, the settings alternating for ``--rounds`` rounds; the median of each setting's per-process
medians.

Usage::

    python benchmarks/bench_zero_host.py               # CPU, writes the bench_zero_host section of RESULTS.md
    python benchmarks/bench_zero_host.py --dry-run     # tiny sizes, prints the table (the test runs this)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, run_child, write_section  # noqa: E402

SETTINGS = {
    "ddp": "DDP",
    "zero2": "ZeRO-2 as shipped: no overflow check in bf16",
    "zero2_checked": "ZeRO-2 with DeepSpeed's default check_grad_overflow: true",
    "zero3": "ZeRO-3 as shipped: each layer one unit",
    "zero3_submodules": "ZeRO-3 with DeepSpeed's default hooks on every submodule",
}
MODEL = {"d_model": 64, "num_heads": 2, "num_encoder_layers": 12, "num_decoder_layers": 12, "d_ff": 128}
TINY = {"d_model": 16, "num_heads": 2, "num_encoder_layers": 2, "num_decoder_layers": 2, "d_ff": 32}


def child(setting: str, dry_run: bool) -> None:
    """One setting in this process: prints ``{"seconds": median step, "tensors": parameter tensors}``."""
    import torch
    from gpu.setting import Setting
    from gpu.strategy_throughput import deepspeed_default_hooks
    from gpu.throughput import Timing, lightning_step, random_batches
    from typing_extensions import override

    from torch_handle.model import Transformer, TransformerConfig
    from torch_handle.strategies import DeepSpeedStrategy

    class Checked(DeepSpeedStrategy):
        @override
        def _format_config(self) -> None:
            super()._format_config()
            self.config["bf16"]["check_grad_overflow"] = True

    torch.set_num_threads(1)
    where = Setting(dry_run=True)  # the CPU
    where.precision = "bf16-mixed"
    dims = TINY if dry_run else MODEL
    config = TransformerConfig(
        **dims, src_vocab_size=1000, tgt_vocab_size=1000, position="rope", norm_first=True, tie_embeddings=True
    )
    strategy = {
        "ddp": lambda: "ddp",
        "zero2": lambda: DeepSpeedStrategy(stage=2),
        "zero2_checked": lambda: Checked(stage=2),
        "zero3": lambda: DeepSpeedStrategy(stage=3),
        "zero3_submodules": lambda: deepspeed_default_hooks(stage=3),
    }[setting]()
    warmup, steps = (1, 3) if dry_run else (5, 20)
    batches = random_batches(1000, 4, 16, warmup + steps)
    seconds, _ = lightning_step(Timing(config, where, warmup, steps), batches, (), strategy)
    with torch.device("meta"):  # counted without allocating a second model
        tensors = len(list(Transformer(config).parameters()))
    print(json.dumps({"seconds": seconds, "tensors": tensors}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes; prints the table, writes nothing")
    parser.add_argument("--rounds", type=int, default=3, help="processes per setting, the settings alternating")
    parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.dry_run)
        return
    import torch

    rounds = 1 if args.dry_run else args.rounds
    runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    tensors = 0
    for _ in range(rounds):
        for name in SETTINGS:
            result = run_child(__file__, ["--child", name, *(["--dry-run"] if args.dry_run else [])])
            runs[name].append(result["seconds"])
            tensors = result["tensors"]
    ddp = statistics.median(runs["ddp"])
    rows = []
    for name, label in SETTINGS.items():
        step = statistics.median(runs[name])
        rows.append([label, f"{step * 1e3:.1f}", " / ".join(f"{s * 1e3:.1f}" for s in runs[name]), f"{ddp / step:.2f}"])
    dims = TINY if args.dry_run else MODEL
    body = "\n\n".join(
        [
            "## bench_zero_host: DeepSpeed's host time against DDP, one CPU process",
            f"Command: `python benchmarks/bench_zero_host.py --rounds {rounds}`. {machine_line(1, torch.__version__)}",
            f"The module's Lightning step (forward, backward, AdamW) in `bf16-mixed`, model {dims} ({tensors} "
            "parameter tensors), 4 x (16 + 16) tokens a step; each setting in its own process, the settings "
            f"alternating; median step of {'3' if args.dry_run else '20'} after warm-up, then the median over the "
            "processes.",
            markdown_table(["setting", "step (ms)", "each process (ms)", "DDP / setting"], rows),
        ]
    )
    print(body)
    if not args.dry_run:
        write_section("bench_zero_host", body)


if __name__ == "__main__":
    main()
