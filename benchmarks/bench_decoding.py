"""Decoding speed on real sentences, this checkout against an earlier one, in the same run.

Decodes the first ``--limit`` lines of ``--source`` with the model at ``--checkpoint`` (anything
``torch_handle.load`` reads) in batches of ``--batch-size``, greedy and beam 5, the batches cut in file order
(how ``predict`` batched before) and longest first (how it batches now). Each (code, setting) runs in a child
process with ``PYTHONPATH`` pointing at one checkout, one intra-op thread by default, the checkouts alternating
over ``--rounds``; the figure is the median sentences/s of the rounds. Output lengths are the model's own, so
rows finish at different steps, as in real use (``bench_peers.py`` forces a fixed length instead). With
``--compile``, this checkout also decodes the longest-first batches through ``CompiledDecode`` (what
``torch_handle.load(..., compile=True)`` runs), each job's short last batch filled to the batch size as ``translate``
fills it; its first batch, which compiles, is timed apart.

    git worktree add /tmp/before <earlier commit>
    python benchmarks/bench_decoding.py --before /tmp/before --checkpoint runs/multi30k \\
        --source data/multi30k/test_2016_flickr.en
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "bench_decoding"
SETTINGS = [(beams, order) for beams in (1, 5) for order in ("file", "sorted")]
COMPILED = "this checkout, compiled"


def child(
    checkpoint: str, source: Path, limit: int, batch_size: int, beams: int, order: str, threads: int, compiled: bool
) -> dict:
    """Sentences/s of one setting, with whichever ``torch_handle`` the ``PYTHONPATH`` holds."""
    import torch

    import torch_handle
    from torch_handle.model import generate

    torch.set_num_threads(threads)
    model = torch_handle.load(checkpoint, compile=compiled)  # its weights laid out as load() lays them for each
    lines = source.read_text(encoding="utf-8").splitlines()[:limit]
    ids = [row[: model.decoding.max_source_tokens] for row in model.tokenizer.encode_batch(lines)]
    indices = list(range(len(ids)))
    if order == "sorted":
        indices.sort(key=lambda i: -len(ids[i]))
    pad, d = model.model.config.pad_id, model.decoding
    batches = []
    for start in range(0, len(indices), batch_size):
        rows = [ids[i] for i in indices[start : start + batch_size]]
        width = max(map(len, rows))
        batches.append(torch.tensor([row + [pad] * (width - len(row)) for row in rows]))
    decode, first = None, 0.0
    if compiled:
        from torch_handle.model import CompiledDecode

        decode = CompiledDecode(model.model)
        start = time.perf_counter()
        with torch.no_grad():  # compiles the step for this batch size: timed apart
            generate(model.model, batches[0], d.max_new_tokens, beams, d.length_penalty, decode=decode)
        first = time.perf_counter() - start
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    digest = hashlib.sha256()
    with torch.no_grad():
        for src in batches:
            rows = src.shape[0]
            if decode is not None and rows < batch_size:  # as translate(): one batch size, one compiled step
                src = torch.cat([src, src[-1:].expand(batch_size - rows, -1)])
            out = generate(model.model, src, d.max_new_tokens, beams, d.length_penalty, decode=decode)[:rows]
            for row in out.tolist():  # without the padding: outputs, not their layout, are compared
                digest.update(repr([t for t in row if t != pad]).encode())
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    return {
        "sentences_per_s": len(ids) / wall,
        "cpu_sentences_per_s": len(ids) / cpu,
        "outputs": digest.hexdigest(),
        "first_batch_s": first,
    }


def _run_child(tree: Path, args: argparse.Namespace, beams: int, order: str, compiled: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", "--checkpoint", str(args.checkpoint), "--source", str(args.source)]
    command += ["--limit", str(args.limit), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    command += ["--beams", str(beams), "--order", order] + (["--compile"] if compiled else [])
    env = os.environ | {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree, timeout=3600)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed in {tree}:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run folder, .ckpt or exported .safetensors")
    parser.add_argument("--source", type=Path, required=True, help="one source sentence per line")
    parser.add_argument("--before", type=Path, help="an earlier checkout to compare with (omit: this one alone)")
    parser.add_argument("--limit", type=int, default=1000, help="lines of --source decoded")
    parser.add_argument("--batch-size", type=int, default=32, help="sentences per batch (predict's default)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also decode through CompiledDecode (this checkout)")
    parser.add_argument("--no-write", action="store_true", help="print the table instead of writing RESULTS.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--beams", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--order", choices=("file", "sorted"), default="file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        setting = (args.batch_size, args.beams, args.order, args.threads, args.compile)
        result = child(args.checkpoint, args.source, args.limit, *setting)
        print(json.dumps(result))
        return

    import torch

    trees = {"this checkout": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    figures: dict[tuple[str, int, str], list[float]] = {}
    outputs: dict[tuple[str, int, str], str] = {}
    first: dict[int, list[float]] = {}
    for round_ in range(args.rounds):
        names = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for beams, order in SETTINGS:
            for name in names:
                result = _run_child(trees[name], args, beams, order)
                figures.setdefault((name, beams, order), []).append(result["sentences_per_s"])
                outputs[(name, beams, order)] = result["outputs"]
                print(f"round {round_}: {name} beam {beams} {order}: {result}", file=sys.stderr)
            if args.compile and order == "sorted":  # right after its eager pair, in the same round
                result = _run_child(ROOT, args, beams, order, compiled=True)
                figures.setdefault((COMPILED, beams, order), []).append(result["sentences_per_s"])
                outputs[(COMPILED, beams, order)] = result["outputs"]
                first.setdefault(beams, []).append(result["first_batch_s"])
                print(f"round {round_}: {COMPILED} beam {beams} {order}: {result}", file=sys.stderr)
    header = ["decoding", "batches", *(f"{name} (sentences/s)" for name in trees)]
    if args.before:
        header += ["ratio", "same outputs"]
    rows = []
    for beams, order in SETTINGS:
        speed = {name: statistics.median(figures[(name, beams, order)]) for name in trees}
        row: list[object] = ["greedy" if beams == 1 else f"beam {beams}", order, *(f"{v:.1f}" for v in speed.values())]
        if args.before:
            same = outputs[("this checkout", beams, order)] == outputs[("before", beams, order)]
            row += [f"{speed['this checkout'] / speed['before']:.2f}", "yes" if same else "no"]
        rows.append(row)
    compiled_rows = []
    for beams in sorted(first):
        speed = statistics.median(figures[(COMPILED, beams, "sorted")])
        eager = statistics.median(figures[("this checkout", beams, "sorted")])
        same = outputs[(COMPILED, beams, "sorted")] == outputs[("this checkout", beams, "sorted")]
        compiled_rows.append(
            ["greedy" if beams == 1 else f"beam {beams}", f"{speed:.1f}", f"{eager:.1f}", f"{speed / eager:.2f}"]
            + ["yes" if same else "no", f"{max(first[beams]):.1f}"]
        )
    compiled_table = (
        [
            "`--compile`: this checkout's longest-first batches through `CompiledDecode` (`load(..., compile=True)`), "
            "the last batch filled to the batch size; the first batch, which compiles, is timed apart and not counted.",
            markdown_table(
                ["decoding", "compiled (sentences/s)", "eager (sentences/s)", "ratio", "same outputs"]
                + ["first batch (s)"],
                compiled_rows,
            ),
        ]
        if compiled_rows
        else []
    )
    body = "\n\n".join(
        [
            "## Decoding on real sentences (`bench_decoding.py`)",
            machine_line(args.threads, torch.__version__),
            f"Model `{args.checkpoint}`; the first {args.limit} lines of `{args.source}`, batches of "
            f"{args.batch_size}; median of {args.rounds} rounds, wall time."
            + (f" `before` is the checkout at `{args.before}`." if args.before else ""),
            markdown_table(header, rows),
            *compiled_table,
        ]
    )
    if args.no_write:
        print(body)
    else:
        write_section(SECTION, body)
        print(f"wrote the {SECTION} section of benchmarks/RESULTS.md")


if __name__ == "__main__":
    main()
