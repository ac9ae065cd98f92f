"""One decoding step's time, by cache capacity: the compiled static step against the eager caches.

For the model at ``--checkpoint`` (anything ``torch_handle.load`` reads), ``--sources`` random sources of
``--source-tokens`` tokens, each with ``--beams`` decoder rows: the static-cache step compiled by ``CompiledDecode``
(what ``load(..., compile=True)`` runs), the same static step run eagerly, and the dynamic (eager) cache. Each step
runs ``--warmup`` untimed steps, then ``--steps`` timed ones from there; the figure is ms per step. The compiled
step attends over the positions written only, so its time should not grow with the capacity. Prints a table and
writes nothing.

    python benchmarks/bench_decode_step.py --checkpoint runs/multi30k
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table  # noqa: E402


def step_ms(step: Callable[[], object], warmup: int, steps: int) -> float:
    """Milliseconds per call of ``step`` over ``steps`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run folder, .ckpt or exported .safetensors")
    parser.add_argument("--capacity", type=int, nargs="+", default=[96, 16], help="cache capacities (positions)")
    parser.add_argument("--sources", type=int, default=32)
    parser.add_argument("--source-tokens", type=int, default=16)
    parser.add_argument("--beams", type=int, default=5, help="decoder rows per source")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if min(args.capacity) < args.warmup + args.steps:
        parser.error(f"--capacity must hold --warmup + --steps = {args.warmup + args.steps} positions")

    import torch

    import torch_handle
    from torch_handle.model import CompiledDecode
    from torch_handle.model.steps import StaticDecoder

    torch.set_num_threads(args.threads)
    model = torch_handle.load(args.checkpoint).model
    c = model.config
    rows = args.sources * args.beams
    src = torch.randint(
        3, c.src_vocab_size, (args.sources, args.source_tokens), generator=torch.Generator().manual_seed(0)
    )
    token = torch.full((rows, 1), c.bos_id)
    figures: dict[str, list[str]] = {"compiled, written positions only": [], "static cache, eager": []}
    figures["dynamic (eager) cache"] = []
    with torch.no_grad():
        memory, padding = model.encode(src), model.memory_padding(src)
        compiled = CompiledDecode(model)
        for capacity in args.capacity:
            for name, decode in (("compiled, written positions only", compiled), ("static cache, eager", None)):
                static = StaticDecoder(model, memory, padding, capacity, graph=False, decode=decode, rows=rows)
                figures[name].append(f"{step_ms(lambda s=static: s(token), args.warmup, args.steps):.2f}")
            cache = model.new_cache(capacity)
            dynamic = lambda cache=cache: model.decode(token, memory, padding, cache)  # noqa: E731
            figures["dynamic (eager) cache"].append(f"{step_ms(dynamic, args.warmup, args.steps):.2f}")
    print(machine_line(args.threads, torch.__version__))
    print(
        f"\nModel `{args.checkpoint}`; {args.sources} sources of {args.source_tokens} tokens x {args.beams} beams = "
        f"{rows} rows; ms per step over positions {args.warmup} to {args.warmup + args.steps - 1}.\n"
    )
    header = ["step", *(f"capacity {capacity}" for capacity in args.capacity)]
    print(markdown_table(header, [[name, *cells] for name, cells in figures.items()]))


if __name__ == "__main__":
    main()
