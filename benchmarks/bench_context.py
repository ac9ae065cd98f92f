"""Context parallelism of the long-document encoder: per-rank memory and step time, one process against two.

    python benchmarks/bench_context.py                            # 16384 32768 65536 tokens, writes RESULTS.md
    python benchmarks/bench_context.py --lengths 2048 --steps 1 --no-write   # a quick check of every path

The model is ``configs/summarization_cp.yaml``'s (the 32k model: local attention window 512, ALiBi,
cross_downsample 4, activation checkpointing); the source is real QMSum meetings concatenated to the length and the
target 256 tokens of their summaries, as in ``bench_long.py``. One step is forward, backward, the data-parallel
gradient all-reduce (``DistributedDataParallel`` over the ranks, as the shipped ``ddp`` strategy) and AdamW, batch 1.
With ``cp`` ranks each encodes ``length / cp`` positions with its halo and the decoder runs replicated.

Both settings use the same cores: one process with all of them as intra-op threads, or ``cp`` processes with
``cores / cp`` threads each. Per rank, the table gives the step's peak resident memory above what the process held
before it (model, gradients and optimizer state are allocated by then) and the peak bytes of tensors alive at once
during a step (activations, the gathered memory, gradients), the figure the 0.55x goal is judged on; the largest
over the ranks is reported. Each (length, processes) pair runs in a fresh process tree.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_long import tokenized_corpus, train_step_figures
from common import machine_line, markdown_table, run_child, write_section

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "summarization_cp.yaml"
SECTION = "bench_context"
MEMORY_GOAL = 0.55  # per-rank activation memory on 2 ranks, as a fraction of one process's
FLAT_GOAL = 1.15  # per-token step time may vary by at most 15% from the shortest length to the longest


def _rank(rank: int, ranks: int, length: int, steps: int, corpus: Path, threads: int, init: str, out: Any) -> None:
    """One rank of a measurement: puts its figures on the queue ``out``."""
    import torch
    import torch.distributed as dist
    import yaml

    from torch_handle.data import EOS_ID
    from torch_handle.model import Transformer, TransformerConfig
    from torch_handle.parallel import CONTEXT_PARALLEL, apply_context_parallel, build_mesh

    torch.set_num_threads(threads)
    data = json.loads(corpus.read_text())
    settings = yaml.safe_load(CONFIG.read_text())["model"]["transformer"]
    vocab = data["vocab_size"]
    torch.manual_seed(0)
    model: torch.nn.Module = Transformer(
        TransformerConfig(**{**settings, "max_len": length}, src_vocab_size=vocab, tgt_vocab_size=vocab)
    )
    if ranks > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
        mesh = build_mesh(ranks, ranks, "cpu")
        apply_context_parallel(model, mesh.get_group(CONTEXT_PARALLEL))
        model = torch.nn.parallel.DistributedDataParallel(model)
    src = torch.tensor(data["src"][: length - 1] + [EOS_ID])[None]  # (1, S): every rank holds the whole source
    assert src.shape[1] == length, f"the corpus has only {src.shape[1]} tokens"
    result = {"rank": rank, **train_step_figures(model, src, data["tgt"], steps)}
    if ranks > 1:
        dist.destroy_process_group()
    out.put(result)


def measure(length: int, ranks: int, steps: int, corpus: Path, threads: int) -> dict[str, Any]:
    """Runs in the child: starts ``ranks`` processes (gloo) and returns the largest per-rank figures."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        args = (ranks, length, steps, corpus, threads, init, out)
        processes = [context.Process(target=_rank, args=(rank, *args)) for rank in range(ranks)]
        for p in processes:
            p.start()
        results = [out.get(timeout=3600) for _ in processes]
        for p in processes:
            p.join()
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    worst = {key: max(r[key] for r in results) for key in ("seconds", "cpu_seconds", "step_bytes", "peak_bytes")}
    return {
        **worst,
        "live_bytes": max(r["live_bytes"] for r in results),
        "length": length,
        "ranks": ranks,
        "threads": results[0]["threads"],
        "torch": results[0]["torch"],
    }


def report(results: list[dict[str, Any]], machine: str) -> str:
    """The RESULTS.md section: one row per (length, processes), ratios of 2 ranks to 1, the verdicts, and the
    ``machine`` line taken before the first case (its load average is the one the cases started with)."""
    by = {(r["length"], r["ranks"]): r for r in results}
    rows = []
    for r in results:
        one = by.get((r["length"], 1))
        ratio = (
            ""
            if one is None or r["ranks"] == 1
            else (
                f"x{r['live_bytes'] / one['live_bytes']:.2f} / x{r['step_bytes'] / one['step_bytes']:.2f} / "
                f"x{r['seconds'] / one['seconds']:.2f}"
            )
        )
        rows.append(
            [
                f"{r['length']:,}",
                f"{r['ranks']} x {r['threads']} thread(s)",
                f"{r['seconds']:.2f}",
                f"{r['cpu_seconds']:.2f}",
                f"{1e6 * r['seconds'] / r['length']:.0f}",
                f"{r['live_bytes'] / 2**20:,.0f}",
                f"{r['step_bytes'] / 2**20:,.0f}",
                f"{r['peak_bytes'] / 2**20:,.0f}",
                ratio,
            ]
        )
    verdicts = []
    for ranks in sorted({r["ranks"] for r in results}):
        mine = [r for r in results if r["ranks"] == ranks]
        per_token = [r["seconds"] / r["length"] for r in mine]
        spread = max(per_token) / min(per_token)
        verdicts.append(
            f"{ranks} process(es): per-token step time spread x{spread:.2f} from {mine[0]['length']:,} to "
            f"{mine[-1]['length']:,} tokens ({'flat' if spread <= FLAT_GOAL else 'NOT flat'}, goal <= x{FLAT_GOAL})"
        )
    ratios = [by[(n, r)]["live_bytes"] / by[(n, 1)]["live_bytes"] for n, r in by if r > 1 and (n, 1) in by]
    if ratios:
        worst = max(ratios)
        verdicts.append(
            f"per-rank live tensors on 2 ranks, worst length: x{worst:.2f} of one process "
            f"({'met' if worst <= MEMORY_GOAL else 'NOT met'}, goal <= x{MEMORY_GOAL})"
        )
    header = [
        "source tokens",
        "processes",
        "wall s / step",
        "CPU s / step (per rank)",
        "us / token",
        "live tensors MiB / rank",
        "step RSS MiB / rank",
        "peak RSS MiB / rank",
        "2 ranks / 1 process (tensors / RSS / time)",
    ]
    return "\n\n".join(
        [
            "## Context parallelism: per-rank memory and step time, 1 process against 2 "
            "(`benchmarks/bench_context.py`)",
            "Model of `configs/summarization_cp.yaml` (d_model 256, 4+2 layers, local attention window 512, ALiBi, "
            "cross_downsample 4, activation checkpointing), fp32, batch 1, real QMSum text, 256 target tokens. A step "
            "is forward + backward + DDP gradient all-reduce + AdamW; on 2 processes (gloo) each encodes one half "
            "of the source with a 512-position halo per layer and the decoder runs replicated. Both settings share the "
            "same cores. Live tensors: the peak of tensor bytes alive at once during a step (activations, the "
            "gathered memory, gradients); step RSS: the peak resident memory of the timed steps above what the "
            "process held before them; the largest rank is shown.",
            markdown_table(header, rows),
            "Verdicts: " + "; ".join(verdicts) + ".",
            machine,
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts to compare")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per case, after one untimed step")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="threads shared by a case's processes")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)  # length, ranks: in a fresh process
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        length, ranks = args.child
        threads = max(1, args.cores // ranks)
        print(json.dumps(measure(length, ranks, args.steps, args.corpus, threads)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch  # only for its version in the machine line: the cases run in child processes

    machine = machine_line(args.cores, torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.json"
        tokenized_corpus(max(args.lengths), corpus)
        results = []
        for length in args.lengths:
            for ranks in args.ranks:
                child = ["--child", str(length), str(ranks), "--steps", str(args.steps), "--corpus", str(corpus)]
                results.append(run_child(__file__, [*child, "--cores", str(args.cores)], timeout=3600))
                r = results[-1]
                log.info(
                    "%d tokens, %d process(es): %.1f s, %.0f MiB live",
                    length,
                    ranks,
                    r["seconds"],
                    r["live_bytes"] / 2**20,
                )
    section = report(results, machine)
    if args.no_write:
        sys.stdout.write(section + "\n")
    else:
        write_section(SECTION, section)
        log.info("wrote the %s section of benchmarks/RESULTS.md", SECTION)


if __name__ == "__main__":
    main()
