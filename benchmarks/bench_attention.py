"""Attention kernels: forward time and peak memory per backend, full vs local attention, 1k to 16k tokens.

One self-attention call of ``torch_handle.model.kernels.attend`` on ``(1, 4, S, 64)`` fp32 queries, keys
and values with the (empty) key-padding mask the encoder always passes. Every case runs in a fresh
process: one untimed call first (it compiles flex), then the median of ``--repeats`` timed calls under
``torch.no_grad()`` (compiled flex has no backward pass on CPU, so every backend is timed forward only).
Peak memory is the rise of the process's resident high-water mark over those calls, from the RSS just
before them. Cases whose score matrix alone would exceed ``--memory-cap-gib`` are skipped, not run.

Usage::

    python benchmarks/bench_attention.py          # writes the bench_attention section of RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import common

log = logging.getLogger("bench_attention")

BATCH, HEADS, HEAD_DIM = 1, 4, 64
WINDOW = 256
BACKENDS = ("naive", "sdpa", "flex")
ATTENTIONS = ("full", "local")
LENGTHS = (1024, 4096, 16384)
HEADER = [
    "backend",
    "attention",
    "tokens",
    "timed",
    "forward, wall (ms)",
    "forward, CPU (ms)",
    "peak extra memory (MiB)",
]


def _child(backend: str, attention: str, s: int, repeats: int, threads: int) -> dict[str, object]:
    import torch

    from torch_handle.model.kernels import attend
    from torch_handle.model.masks import MaskSpec

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, s, HEAD_DIM) for _ in range(3))
    padding = torch.zeros(BATCH, s, dtype=torch.bool)
    spec = MaskSpec(key_padding=padding, window=WINDOW if attention == "local" else None)
    with torch.no_grad():
        attend(q, k, v, spec, backend)  # untimed: compiles flex, warms the allocator
        common.reset_peak_rss()
        before = common.rss_bytes()
        wall, cpu = common.median_wall_and_cpu(lambda: attend(q, k, v, spec, backend), repeats, warmup=0)
        peak = common.peak_rss_bytes() - before
    return {
        "wall": wall,
        "cpu": cpu,
        "peak_bytes": peak,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _score_bytes(s: int) -> int:
    """Bytes of one fp32 ``(B, H, S, S)`` score matrix."""
    return BATCH * HEADS * s * s * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", nargs=3, metavar=("BACKEND", "ATTENTION", "S"), help="one child run, prints JSON")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="intra-op threads in every child")
    parser.add_argument(
        "--memory-cap-gib", type=float, default=2.0, help="skip naive full attention whose S x S scores exceed this"
    )
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    args = parser.parse_args()

    if args.case:
        backend, attention, s = args.case
        print(json.dumps(_child(backend, attention, int(s), args.repeats, args.threads)))
        return

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows, machine = [], None
    for attention in ATTENTIONS:
        for backend in BACKENDS:
            for s in LENGTHS:
                timed = "forward, no_grad" + (" (flex has no CPU backward)" if backend == "flex" else "")
                label = [backend, attention, f"{s:,}", timed]
                # Only naive writes the full score matrix out (SDPA and flex are fused); it would need ~3 of them.
                if backend == "naive" and attention == "full" and _score_bytes(s) > args.memory_cap_gib * 2**30:
                    skipped = f"skipped (S×S = {_score_bytes(s) / 2**30:.0f} GiB)"
                    rows.append([*label, skipped, skipped, skipped])
                    log.info("%s %s %d: %s", backend, attention, s, skipped)
                    continue
                child_args = ["--case", backend, attention, str(s), "--repeats", str(args.repeats)]
                run = common.run_child(str(Path(__file__).resolve()), [*child_args, "--threads", str(args.threads)])
                machine = machine or common.machine_line(run["threads"], run["torch"])
                ms, cpu_ms, mib = 1e3 * run["wall"], 1e3 * run["cpu"], run["peak_bytes"] / 2**20
                rows.append([*label, f"{ms:,.1f}", f"{cpu_ms:,.1f}", f"{mib:,.1f}"])
                log.info("%s %s %d: %.1f ms (CPU %.1f ms), %.1f MiB", backend, attention, s, ms, cpu_ms, mib)

    body = "\n\n".join(
        [
            "## bench_attention: attention kernels, forward time and peak memory",
            f"Command: `python benchmarks/bench_attention.py --repeats {args.repeats} --threads {args.threads} "
            f"--memory-cap-gib {args.memory_cap_gib:g}`. {machine}",
            f"One self-attention call on batch {BATCH}, {HEADS} heads, head dim {HEAD_DIM}, fp32, with the "
            f"encoder's key-padding mask; local attention sees {WINDOW} positions on each side. Every backend is "
            "timed forward only under `torch.no_grad()` (flex has no backward pass on CPU), median of the timed "
            "calls after one untimed call (flex compiles in it); each case runs in a fresh process. CPU time "
            "(all threads of the process) leaves out time taken by other processes. Peak memory is the rise of "
            "the process's resident high-water mark over the timed calls (inputs excluded).",
            common.markdown_table(HEADER, rows),
        ]
    )
    if args.no_write:
        print(body)
    else:
        common.write_section("bench_attention", body)
        log.info("wrote the bench_attention section of %s", common.RESULTS)


if __name__ == "__main__":
    sys.exit(main())
