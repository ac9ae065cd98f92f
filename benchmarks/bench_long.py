"""Training-step cost at 4k-32k source tokens: time and memory must grow linearly with the length.

    python benchmarks/bench_long.py                       # 4096 8192 16384 32768, writes RESULTS.md
    python benchmarks/bench_long.py --lengths 4096 8192 --steps 1 --no-write

The model is ``configs/summarization_32k.yaml``'s (local attention, ALiBi, cross-attention pooling,
activation checkpointing); the source is real QMSum meetings, concatenated to reach the length, and the
target a fixed 256 tokens of their reference summaries, so only the source length changes. One step is
forward, backward and AdamW update on one document (batch 1). Each length runs in a fresh process; its
memory is the peak resident memory of the timed steps above what the process held before them (model,
gradients and optimizer state, all independent of the length); one more step counts the peak bytes of live
tensors, the model's own memory, which the C allocator's fragmentation and hand-backs to the OS (in resident
memory) do not blur. Besides wall time the process's CPU time is reported: on a machine shared with other
jobs it measures the work, where wall time also measures the neighbours; ``--threads 1`` makes it exact (no
spinning worker threads).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    machine_line,
    markdown_table,
    median_seconds,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_child,
    write_section,
)

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "summarization_32k.yaml"
QMSUM = ROOT.parent / "shared" / "data" / "qmsum" / "val.jsonl"
TARGET_TOKENS = 256
BPE_VOCAB = 8000
SECTION = "bench_long"
FLAT_GOAL = 1.15  # per-token time and memory may vary by at most 15% from the shortest to the longest length


def tokenized_corpus(max_tokens: int, path: Path) -> None:
    """Writes ``{"vocab_size", "src", "tgt"}`` token ids of QMSum to ``path``, longest meetings first.

    Args:
        max_tokens: Source tokens needed (the longest length measured).
        path: JSON file the child processes read.
    """
    from torch_handle.data import Tokenizer

    rows = [json.loads(line) for line in QMSUM.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows.sort(key=lambda r: -len(r["document"]))
    tokenizer = Tokenizer.train([r["document"] for r in rows[:8]] + [r["summary"] for r in rows], BPE_VOCAB)
    src: list[int] = []
    for row in rows:  # concatenated meetings only where one meeting is not long enough
        src += tokenizer.encode(row["document"] + "\n")
        if len(src) >= max_tokens:
            break
    tgt = [token for row in rows for token in tokenizer.encode(row["summary"] + "\n")][:TARGET_TOKENS]
    path.write_text(json.dumps({"vocab_size": tokenizer.vocab_size, "src": src[:max_tokens], "tgt": tgt}))


def live_tensor_peak(fn: Callable[[], None]) -> int:
    """Peak bytes of tensor storages alive at once while ``fn()`` runs (forward, backward and optimizer).

    Args:
        fn: The code to watch; every tensor an operator returns is counted until it is freed.
    """
    from torch import Tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveTensors(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: dict[int, int] = {}
            self.now = self.peak = 0

        def _free(self, key: int) -> None:
            self.now -= self.sizes.pop(key, 0)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                storage = t.untyped_storage() if isinstance(t, Tensor) else None
                if storage is not None and storage.data_ptr() and storage.data_ptr() not in self.sizes:
                    self.sizes[storage.data_ptr()] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, storage.data_ptr())
            return out

    with LiveTensors() as live:
        fn()
    return live.peak


def measure(length: int, steps: int, corpus: Path, threads: int | None) -> dict[str, float]:
    """Runs in the child: median step time and step memory for a ``length``-token source.

    Args:
        length: Source tokens, ``<eos>`` included.
        steps: Timed steps, after one untimed step that allocates the optimizer state.
        corpus: Token ids written by :func:`tokenized_corpus`.
        threads: Intra-op threads; None keeps torch's default.
    """
    import torch
    import yaml

    from torch_handle.data import EOS_ID
    from torch_handle.model import Transformer, TransformerConfig

    if threads is not None:
        torch.set_num_threads(threads)
    data = json.loads(corpus.read_text())
    settings = yaml.safe_load(CONFIG.read_text())["model"]["transformer"]
    vocab = data["vocab_size"]
    model = Transformer(TransformerConfig(**settings, src_vocab_size=vocab, tgt_vocab_size=vocab))
    src = torch.tensor(data["src"][: length - 1] + [EOS_ID])[None]  # (1, S)
    return {"length": length, **train_step_figures(model, src, data["tgt"], steps)}


def train_step_figures(model: Any, src: Any, target: list[int], steps: int) -> dict[str, Any]:
    """Time and memory of AdamW training steps on one source ``src (1, S)`` and ``target`` token ids.

    One untimed step allocates the gradients and the optimizer state; then the median wall time and the CPU time
    of ``steps`` steps, their peak resident memory above what the process held before them, the process's peak,
    and the peak of live tensor bytes in one more step.
    """
    import torch
    import torch.nn.functional as F

    from torch_handle.data import BOS_ID, EOS_ID

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tgt = torch.tensor([BOS_ID, *target, EOS_ID])[None]  # (1, T + 2)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(src, tgt[:, :-1])  # (1, T + 1, V)
        F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten()).backward()
        optimizer.step()

    model.train()
    step()
    before = rss_bytes()
    reset_peak_rss()
    cpu_start = time.process_time()
    seconds, samples = median_seconds(step, repeats=steps, warmup=0)
    cpu_seconds = (time.process_time() - cpu_start) / steps
    step_bytes = peak_rss_bytes() - before
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "samples": samples,
        "step_bytes": step_bytes,
        "peak_bytes": peak_rss_bytes(),
        "live_bytes": live_tensor_peak(step),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def report(results: list[dict[str, float]]) -> str:
    """The RESULTS.md section: a table with per-token figures and growth per doubling, and the verdict."""
    keys = ("seconds", "cpu_seconds", "step_bytes", "live_bytes")
    rows, previous = [], None
    for r in results:
        growth = "" if previous is None else " / ".join(f"x{r[k] / previous[k]:.2f}" for k in keys)
        rows.append(
            [
                f"{r['length']:,}",
                f"{r['seconds']:.2f}",
                f"{r['cpu_seconds']:.2f}",
                f"{1e6 * r['seconds'] / r['length']:.0f} / {1e6 * r['cpu_seconds'] / r['length']:.0f}",
                f"{r['step_bytes'] / 2**20:,.0f}",
                f"{r['step_bytes'] / 1024 / r['length']:.1f}",
                f"{r['live_bytes'] / 2**20:,.0f} / {r['live_bytes'] / 1024 / r['length']:.1f}",
                f"{r['peak_bytes'] / 2**20:,.0f}",
                growth,
            ]
        )
        previous = r
    spread = {k: max(r[k] / r["length"] for r in results) / min(r[k] / r["length"] for r in results) for k in keys}
    verdict = ", ".join(
        f"{name} x{spread[k]:.2f} ({'flat' if spread[k] <= FLAT_GOAL else 'NOT flat'})"
        for name, k in zip(("wall time", "CPU time", "resident memory", "live tensors"), keys)
    )
    header = [
        "source tokens",
        "wall s / step",
        "CPU s / step",
        "us / token (wall / CPU)",
        "step memory MiB",
        "KiB / token",
        "live tensors MiB / KiB per token",
        "peak RSS MiB",
        "growth per doubling (wall / CPU / RSS / tensors)",
    ]
    return "\n\n".join(
        [
            "## Long documents: training-step cost against source length (`benchmarks/bench_long.py`)",
            "Model of `configs/summarization_32k.yaml` (d_model 256, 4+2 layers, local attention window 512, "
            "ALiBi, cross_downsample 4, activation checkpointing), fp32, batch 1, 256 target tokens, real "
            "QMSum text. A step is forward + backward + AdamW. Step memory is the peak resident memory of the "
            "timed steps above what the process held before them (weights, gradients, optimizer state); live "
            "tensors is the peak of tensor bytes alive at once in one step, free of the C allocator's "
            "fragmentation.",
            markdown_table(header, rows),
            f"Per-token spread, largest over smallest (goal <= x{FLAT_GOAL}): {verdict}.",
            machine_line(int(results[0]["threads"]), str(results[0]["torch"])),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per length (median reported)")
    parser.add_argument("--threads", type=int, help="intra-op threads in each child (default: torch's)")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one length, in a fresh process
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child, args.steps, args.corpus, args.threads)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.json"
        tokenized_corpus(max(args.lengths), corpus)
        results = []
        for length in args.lengths:
            child_args = ["--child", str(length), "--steps", str(args.steps), "--corpus", str(corpus)]
            child_args += [] if args.threads is None else ["--threads", str(args.threads)]
            results.append(run_child(__file__, child_args, timeout=1800))
            log.info("%d tokens: %.2f s, %.0f MiB", length, results[-1]["seconds"], results[-1]["step_bytes"] / 2**20)
    section = report(results)
    if args.no_write:
        sys.stdout.write(section + "\n")
    else:
        write_section(SECTION, section)
        log.info("wrote the %s section of benchmarks/RESULTS.md", SECTION)


if __name__ == "__main__":
    main()
