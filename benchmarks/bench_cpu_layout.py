"""Eager CPU decoding with the linear weights column-major (what ``torch_handle.load`` sets, by
``cpu_decoding_layout``) against row-major, as trained.

One process, the two layouts alternating call by call (the order flipping every pair), so that the machine's drift,
which on a 2-core VM moves a child's figure between processes more than the layout does, falls on both alike. Each
pair's ratio is row-major time / column-major time; the table gives their median, how many pairs the layout won, and
whether the outputs were the same. Two workloads: ``bench_peers``' size (d 256, 3+3 layers, vocabulary 8,000, fresh
weights, 16 sources of 24 tokens, exactly 48 new tokens), and with ``--checkpoint`` and ``--source`` a trained model
translating real sentences through ``Model.translate``. Prints a table and writes nothing.

    python benchmarks/bench_cpu_layout.py --pairs 8
    python benchmarks/bench_cpu_layout.py --checkpoint runs/multi30k --source data/multi30k/test_2016_flickr.en
    python benchmarks/bench_cpu_layout.py --dry-run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table  # noqa: E402


def _set_layout(model: object, column_major: bool) -> None:
    import torch

    from torch_handle.model.steps import cpu_decoding_layout

    if column_major:
        cpu_decoding_layout(model)
        return
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.contiguous()


def pairs(model: object, decode: Callable[[], object], count: int) -> tuple[list[float], list[float], bool]:
    """Seconds of ``decode()`` row-major and column-major, alternating, after one untimed call of each; and whether
    every call gave the first call's output."""
    expected = None
    same = True
    times: dict[bool, list[float]] = {False: [], True: []}
    for index in range(count + 1):
        for column_major in (False, True) if index % 2 == 0 else (True, False):
            _set_layout(model, column_major)
            start = time.perf_counter()
            out = decode()
            if index:  # the first pair warms up
                times[column_major].append(time.perf_counter() - start)
            expected = out if expected is None else expected
            same = same and _equal(out, expected)
    return times[False], times[True], same


def _equal(a: object, b: object) -> bool:
    import torch

    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="timed calls of each layout")
    parser.add_argument("--checkpoint", help="also a trained model (anything torch_handle.load reads) ...")
    parser.add_argument("--source", type=Path, help="... translating these sentences, one per line")
    parser.add_argument("--limit", type=int, default=256, help="lines of --source")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, two pairs: checks the code paths")
    args = parser.parse_args()
    if bool(args.checkpoint) != bool(args.source):
        parser.error("--checkpoint and --source go together")

    import torch
    from peers.models import SIZES, decoding_sources, our_model

    import torch_handle
    from torch_handle.model import generate

    torch.set_num_threads(args.threads)
    count = 2 if args.dry_run else args.pairs
    s = SIZES["dry" if args.dry_run else "full"]
    model = our_model(s).eval()  # its EOS ruled out: every sentence runs to s.new_tokens
    src = torch.tensor(decoding_sources(s))
    workloads: list[tuple[str, object, Callable[[], object], int]] = []
    for beams in (1, s.beams):
        name = "greedy" if beams == 1 else f"beam {beams}"
        label = f"fresh d {s.d_model}, {s.sources} x {s.source_len} tokens in, {name}, {s.new_tokens} tokens out"
        decode = lambda b=beams: generate(model, src, s.new_tokens, b)  # noqa: E731
        workloads.append((label, model, decode, s.sources))
    if args.checkpoint:
        loaded = torch_handle.load(args.checkpoint)
        lines = args.source.read_text(encoding="utf-8").splitlines()[: args.limit]
        for beams in (1, 5):
            label = f"`{args.checkpoint}`, {len(lines)} sentences, {'greedy' if beams == 1 else f'beam {beams}'}"
            decode = lambda b=beams: loaded.translate(lines, num_beams=b)  # noqa: E731
            workloads.append((label, loaded.model, decode, len(lines)))

    rows = []
    with torch.no_grad():
        for label, owner, decode, sentences in workloads:
            row_major, column_major, same = pairs(owner, decode, count)
            ratios = [r / c for r, c in zip(row_major, column_major, strict=True)]
            rows.append(
                [
                    label,
                    f"{sentences / statistics.median(row_major):.1f}",
                    f"{sentences / statistics.median(column_major):.1f}",
                    f"{statistics.median(ratios):.3f}",
                    f"{sum(r > 1 for r in ratios)}/{len(ratios)}",
                    "yes" if same else "no",
                ]
            )
            print(f"{label}: pair ratios {[round(r, 3) for r in ratios]}", file=sys.stderr)
    header = ["decoding", "row-major (sentences/s)", "column-major (sentences/s)", "ratio", "pairs won", "same outputs"]
    print(machine_line(torch.get_num_threads(), torch.__version__))
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
