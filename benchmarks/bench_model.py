"""Training throughput of our Transformer against ``torch.nn.Transformer`` of the same shape and weights.

Both train on the same batches (fp32, AdamW, dropout 0.1, post-LN, sinusoidal positions), each in a
process of its own with the same number of intra-op threads. A training step is forward, loss, backward
and the optimiser step; warm-up steps are not timed; the figure is the median step. Peak RSS is the
child's own high-water mark (``VmHWM``). Each implementation runs ``--rounds`` times, alternating which
goes first, and the step times of all rounds are pooled.

Usage::

    python benchmarks/bench_model.py                 # every shape, writes the bench_model section of RESULTS.md
    python benchmarks/bench_model.py --impl ours --shape small   # one child run, prints JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import common

log = logging.getLogger("bench_model")

VOCAB = 8000
PAD, BOS, EOS = 0, 1, 2
SHAPES: dict[str, dict[str, int]] = {
    "small": {"d_model": 256, "num_heads": 4, "layers": 3, "d_ff": 1024, "batch": 32, "seq": 64},
    "long": {"d_model": 256, "num_heads": 4, "layers": 3, "d_ff": 1024, "batch": 8, "seq": 256},
}
NUM_BATCHES = 4  # distinct batches, cycled through


def _child(impl: str, shape_name: str, steps: int, warmup: int, threads: int) -> dict[str, object]:
    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

    from torch_handle.model import Transformer, TransformerConfig, sinusoidal_table

    torch.set_num_threads(threads)
    shape = SHAPES[shape_name]
    config = TransformerConfig(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        d_model=shape["d_model"],
        num_heads=shape["num_heads"],
        num_encoder_layers=shape["layers"],
        num_decoder_layers=shape["layers"],
        d_ff=shape["d_ff"],
        dropout=0.1,
        max_len=shape["seq"],
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
    )

    class TorchTransformer(nn.Module):
        """``nn.Transformer`` with the same embeddings, positions and output projection as ours."""

        def __init__(self) -> None:
            super().__init__()
            d = config.d_model
            self.core = nn.Transformer(
                d_model=d,
                nhead=config.num_heads,
                num_encoder_layers=config.num_encoder_layers,
                num_decoder_layers=config.num_decoder_layers,
                dim_feedforward=config.d_ff,
                dropout=config.dropout,
                batch_first=True,
            )
            self.src_embed = nn.Embedding(VOCAB, d)
            self.tgt_embed = nn.Embedding(VOCAB, d)
            self.lm_head = nn.Linear(d, VOCAB, bias=False)
            self.dropout = nn.Dropout(config.dropout)
            self.register_buffer("pe", sinusoidal_table(config.max_len, d), persistent=False)

        def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
            scale = math.sqrt(config.d_model)
            x = self.dropout(self.src_embed(src) * scale + self.pe[: src.shape[1]])
            y = self.dropout(self.tgt_embed(tgt) * scale + self.pe[: tgt.shape[1]])
            causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            pad = src == PAD
            out = self.core(
                x, y, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad, tgt_is_causal=True
            )
            return self.lm_head(out)

    torch.manual_seed(0)
    ours = Transformer(config)
    model: nn.Module = ours
    if impl == "torch":
        model = TorchTransformer()
        model.load_state_dict(_to_torch_names(ours.state_dict()))  # strict: every weight has its counterpart
        del ours

    generator = torch.Generator().manual_seed(1)
    batches = [_batch(torch, generator, shape["batch"], shape["seq"]) for _ in range(NUM_BATCHES)]
    real_tokens = statistics.mean(int((src != PAD).sum() + (labels != PAD).sum()) for src, _, labels in batches)

    def loss_of(batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        src, tgt, labels = batch
        return F.cross_entropy(model(src, tgt).flatten(0, 1), labels.flatten(), ignore_index=PAD)

    model.eval()
    with torch.no_grad():
        initial_loss = float(loss_of(batches[0]))  # equal for both implementations iff the weights are
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    samples, cpu_samples = [], []
    for step in range(warmup + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss_of(batches[step % NUM_BATCHES]).backward()
        optimizer.step()
        if step >= warmup:
            samples.append(time.perf_counter() - start)
            cpu_samples.append(time.process_time() - cpu_start)
    return {
        "impl": impl,
        "shape": shape_name,
        "samples": samples,
        "cpu_samples": cpu_samples,
        "real_tokens_per_step": real_tokens,
        "peak_rss": common.peak_rss_bytes(),
        "initial_loss": initial_loss,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _batch(torch, generator, batch: int, seq: int):  # noqa: ANN001, ANN202 - torch arrives lazily
    """Right-padded source, decoder input (BOS + target) and labels (target + EOS) of random lengths."""
    src = torch.randint(3, VOCAB, (batch, seq), generator=generator)
    tokens = torch.randint(3, VOCAB, (batch, seq), generator=generator)
    src_len = torch.randint(seq // 2, seq + 1, (batch,), generator=generator)
    tgt_len = torch.randint(seq // 2, seq, (batch,), generator=generator)  # + EOS <= seq
    position = torch.arange(seq)
    src[position >= src_len[:, None]] = PAD
    labels = tokens.clone()
    labels[position == tgt_len[:, None]] = EOS
    labels[position > tgt_len[:, None]] = PAD
    tgt = torch.cat([torch.full((batch, 1), BOS), labels[:, :-1]], dim=1).masked_fill(labels == PAD, PAD)
    return src, tgt, labels


_RENAMES = [
    (r"^encoder_layers\.(\d+)\.", r"core.encoder.layers.\1."),
    (r"^decoder_layers\.(\d+)\.", r"core.decoder.layers.\1."),
    (r"^encoder_norm\.", "core.encoder.norm."),
    (r"^decoder_norm\.", "core.decoder.norm."),
    (r"\.in_proj\.(weight|bias)$", r".in_proj_\1"),
    (r"\.cross_attn\.", ".multihead_attn."),
    (r"\.ff\.linear", ".linear"),
    (r"(encoder\.layers\.\d+)\.attn_block\.norm\.", r"\1.norm1."),
    (r"(encoder\.layers\.\d+)\.ff_block\.norm\.", r"\1.norm2."),
    (r"\.self_block\.norm\.", ".norm1."),
    (r"\.cross_block\.norm\.", ".norm2."),
    (r"(decoder\.layers\.\d+)\.ff_block\.norm\.", r"\1.norm3."),
]


def _to_torch_names(state: dict) -> dict:
    """Our parameter names -> ``TorchTransformer``'s (``nn.Transformer`` layout under ``core``)."""
    renamed = {}
    for name, value in state.items():
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        renamed[name] = value
    return renamed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["ours", "torch"], help="run one child measurement and print JSON")
    parser.add_argument("--shape", choices=list(SHAPES), action="append", help="default: every shape")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="runs per implementation, alternating the order")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="intra-op threads in every child")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    args = parser.parse_args()
    shapes = args.shape or list(SHAPES)

    if args.impl:
        for shape in shapes:
            print(json.dumps(_child(args.impl, shape, args.steps, args.warmup, args.threads)))
        return

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start_line = None
    rows, ratios = [], []
    for shape in shapes:
        runs: dict[str, list[dict]] = {"ours": [], "torch": []}
        for round_index in range(args.rounds):
            for impl in ("ours", "torch") if round_index % 2 == 0 else ("torch", "ours"):
                child_args = ["--impl", impl, "--shape", shape, "--steps", str(args.steps)]
                child_args += ["--warmup", str(args.warmup), "--threads", str(args.threads)]
                run = common.run_child(str(Path(__file__).resolve()), child_args)
                start_line = start_line or common.machine_line(run["threads"], run["torch"])
                log.info("%s %s: median step %.1f ms", shape, impl, 1e3 * statistics.median(run["samples"]))
                runs[impl].append(run)
        s = SHAPES[shape]
        wall, cpu = {}, {}
        for impl, impl_runs in runs.items():
            wall[impl] = statistics.median(t for run in impl_runs for t in run["samples"])
            cpu[impl] = statistics.median(t for run in impl_runs for t in run["cpu_samples"])
            rows.append(
                [
                    f"{shape}: d {s['d_model']}, {s['num_heads']} heads, {s['layers']}+{s['layers']} layers, "
                    f"d_ff {s['d_ff']}, {s['batch']}x{s['seq']} tokens",
                    impl,
                    f"{1e3 * wall[impl]:.0f}",
                    f"{1e3 * cpu[impl]:.0f}",
                    f"{impl_runs[0]['real_tokens_per_step'] / wall[impl]:,.0f}",
                    f"{max(run['peak_rss'] for run in impl_runs) / 2**20:,.0f}",
                    f"{impl_runs[0]['initial_loss']:.5f}",
                ]
            )
        ratios.append([shape, f"{wall['ours'] / wall['torch']:.3f}", f"{cpu['ours'] / cpu['torch']:.3f}"])

    header = ["shape", "impl", "median step, wall (ms)", "median step, CPU (ms)", "tokens/s (wall)"]
    body = "\n\n".join(
        [
            "## bench_model: training step, ours vs `torch.nn.Transformer`",
            f"Command: `python benchmarks/bench_model.py --steps {args.steps} --warmup {args.warmup} "
            f"--rounds {args.rounds} --threads {args.threads}`. {start_line}",
            "fp32, AdamW, dropout 0.1, vocabulary 8000, post-LN, sinusoidal positions; our model on "
            "`attention_backend='auto'` (SDPA on CPU). Each run is a separate process with the same weights "
            "(equal initial loss) and batches; the implementations alternate which goes first, and the "
            f"{args.steps} timed steps of all {args.rounds} rounds are pooled. Tokens/s counts real (non-padding) "
            "source and target tokens per median wall-clock step. The CPU time of a step (all threads of the "
            "process) does not count time lost to other processes, so its ratio is the steadier one on a "
            "shared machine. Peak RSS is the child's high-water mark, PyTorch runtime included.",
            common.markdown_table([*header, "peak RSS (MiB)", "initial loss"], rows),
            common.markdown_table(["shape", "step time ours / torch, wall", "step time ours / torch, CPU"], ratios),
            "A ratio <= 1.000 means ours is as fast as PyTorch's or faster.",
        ]
    )
    if args.no_write:
        print(body)
    else:
        common.write_section("bench_model", body)
        log.info("wrote the bench_model section of %s", common.RESULTS)


if __name__ == "__main__":
    sys.exit(main())
