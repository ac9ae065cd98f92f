"""Our Transformer against what users would pick instead: Hugging Face BART and Marian, and CTranslate2.

Same size everywhere (d_model 256, 4 heads, 3+3 layers, d_ff 1024, vocabulary 8,000, ReLU, dropout 0.1 on
residuals, attention weights and feed-forward hidden units, one matrix shared by the source and target
embeddings and the output projection, fresh weights from seed 0), each measurement in a child process of its
own with the same number of intra-op threads, the implementations alternating which goes first:

- training step (forward, loss, backward, AdamW step) on 32 x 64 source + 32 x 64 target tokens: the median
  step and the child's peak RSS. Every implementation minimises the loss our LightningModule does
  (cross entropy with label smoothing 0.1 over non-padding targets, as the shipped configs), computed from its
  logits by the same function (``torch_handle.loss.token_sums``). Ours, as the LightningModule runs it, computes
  logits at those targets only and its feed-forward blocks on the tokens that are not padding only; the peers
  compute both at every position.
- decoding sentences/s: 16 sources of 24 tokens, exactly 48 generated tokens each, greedy and beam 5
  (length penalty 1, early stopping: a source is done once it holds ``num_beams`` finished hypotheses). The
  length is forced by each implementation's own "minimum length" mechanism, which rules EOS out until the
  length is reached: HF ``min_new_tokens``, CTranslate2 ``min_decoding_length``; ours has none, so its EOS logit
  is set to -inf after every ``decode`` (``_NoEos``, one in-place write per step, as HF's processor). Pad and
  BOS are never a next token in any of them (ours rules them out itself, HF by ``suppress_tokens``, the
  CTranslate2 export by a -inf output bias). Every child asserts that each sentence has exactly the forced number
  of tokens. Each source is 23 random tokens and EOS, as our collator builds it; CTranslate2 gets the 23 and
  appends EOS itself (the export's ``add_source_eos``).
- CTranslate2 fp32 and int8 decode our model's very weights, converted by ``torch_handle.ctranslate2``.

Usage::

    python benchmarks/bench_peers.py                       # about 3 minutes at 1 thread; writes RESULTS.md
    python benchmarks/bench_peers.py --dry-run --no-write  # every code path at a tiny size, about a minute
    python benchmarks/bench_peers.py --child ours --task decode   # one child measurement, prints JSON
    python benchmarks/bench_peers.py --device cuda --no-write     # on a GPU in bf16 autocast: ours, BART, Marian

The parts, in ``benchmarks/peers/``: ``models.py`` (the implementations and the size they share), ``children.py``
(one measurement per child process), ``report.py`` (the RESULTS.md section). This script runs the children and
writes the report.

On a GPU (``--device cuda``) every torch child runs its forward passes under bf16 autocast with fp32 weights, as
Lightning's ``bf16-mixed``, AdamW fused, the device synchronised around each timed step; memory is the device's
peak allocation. CTranslate2 is left out there (its goal is a CPU one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common
from peers.children import child
from peers.models import IMPLS, SIZES, TRAINABLE, decoding_impls
from peers.report import configurations, description, int8_section, int8_table, results_table, versions

log = logging.getLogger("bench_peers")


def _run_all(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[dict]]], str]:
    """Every (task, implementation) child ``args.rounds`` times, alternating the order; the machine line."""
    script = str(Path(__file__).resolve())
    common_args = ["--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    common_args += ["--repeats", str(args.repeats), "--device", args.device] + (["--dry-run"] if args.dry_run else [])
    common_args += ["--batch", str(args.batch)] if args.batch else []
    common_args += ["--compile-train"] if args.compile_train else []
    common_args += ["--quantize", args.quantize] if args.quantize else []
    decoders = decoding_impls(args.device, args.quantize)
    runs: dict[str, dict[str, list[dict]]] = {"train": {i: [] for i in TRAINABLE}, "decode": {i: [] for i in decoders}}
    machine = ""
    with tempfile.TemporaryDirectory() as folder:
        if "ct2-fp32" in decoders:
            common.run_child(script, ["--child", "ours", "--task", "export", "--export-dir", folder, *common_args])
        for task, impls in (("train", TRAINABLE), ("decode", decoders)):
            if task not in args.tasks:
                continue
            for round_index in range(args.rounds):
                for impl in impls if round_index % 2 == 0 else impls[::-1]:
                    child_args = ["--child", impl, "--task", task, "--export-dir", folder, *common_args]
                    run = common.run_child(script, child_args)
                    machine = machine or common.machine_line(run["threads"], run["torch"], run["gpu"])
                    if task == "train":
                        log.info("train %s: median step %.0f ms", impl, 1e3 * statistics.median(run["wall"]))
                        if "compiled" in run:
                            compiled = run["compiled"]
                            log.info(
                                "train %s compiled: median step %.0f ms, its untimed steps %.1f s", impl,
                                1e3 * statistics.median(compiled["wall"]), compiled["untimed"],
                            )  # fmt: skip
                    else:
                        compiled = ""
                        if "greedy_compiled" in run:
                            greedy, beam = run["greedy_compiled"]["wall"], run["beam_compiled"]["wall"]
                            compiled = f", compiled: greedy {greedy:.3f} s, beam {beam:.3f} s"
                        log.info(
                            "decode %s: greedy %.3f s, beam %.3f s%s", impl, run["greedy"]["wall"], run["beam"]["wall"],
                            compiled,
                        )  # fmt: skip
                    runs[task][impl].append(run)
    return runs, machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--child", choices=[*IMPLS, "ours-int8", "imported"], help="run one child measurement and print JSON"
    )
    parser.add_argument(
        "--quantize",
        choices=["int8"],
        help="decoding only: ours eager fp32 and int8 (load(..., quantize='int8')) against CTranslate2 fp32 and int8",
    )
    parser.add_argument("--task", choices=["train", "decode", "export"], default="decode", help="with --child")
    parser.add_argument("--export-dir", help="with --child: the folder that --task export writes, CT2 reads")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads in every child")
    parser.add_argument("--batch", type=int, help="training rows (default 32; a GPU is idle at 32)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bf16 autocast, no CTranslate2")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per run")
    parser.add_argument(
        "--compile-train",
        action="store_true",
        help="also time each training step compiled, after the eager ones in the same child: ours as "
        "--model.compile true, the peers as HF's torch_compile=True (torch.compile(model)), the loss compiled",
    )
    parser.add_argument(
        "--tasks", nargs="+", choices=["train", "decode"], default=["train", "decode"], help="what to measure"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed training steps first")
    parser.add_argument("--repeats", type=int, default=3, help="timed decoding calls per run (one untimed first)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per implementation, alternating the order")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes, one round, one step or call each: checks every path"
    )
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.warmup, args.repeats, args.rounds = 1, 1, 1, 1
    s = SIZES["dry" if args.dry_run else "full"]
    if args.batch:
        s = dataclasses.replace(s, batch=args.batch)

    if args.quantize:
        args.tasks = ["decode"]
    if args.child:
        print(json.dumps(child(args.child, args.task, s, args)))
        return

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    runs, machine = _run_all(args)
    minutes = (time.perf_counter() - start) / 60
    log.info("all children: %.1f min", minutes)
    header, rows = int8_table(runs, s) if args.quantize else results_table(runs, s, args.device)
    command = f"python benchmarks/bench_peers.py --device {args.device} --threads {args.threads}"
    if "train" in args.tasks:
        command += f" --steps {args.steps} --warmup {args.warmup}"
        command += f" --batch {args.batch}" if args.batch else ""
        command += " --compile-train" if args.compile_train else ""
    command += f" --repeats {args.repeats}" if "decode" in args.tasks else ""
    command += f" --tasks {' '.join(args.tasks)}" if args.tasks != ["train", "decode"] else ""
    command += f" --rounds {args.rounds}" + (" --dry-run" if args.dry_run else "")
    command += f" --quantize {args.quantize}" if args.quantize else ""
    if args.quantize:
        body = int8_section(command, minutes, machine, header, rows, args, s)
        print(body) if args.no_write else common.write_section("bench_peers_int8", body)
        return
    cpu = args.device == "cpu"
    body = "\n\n".join(
        [
            "## bench_peers: ours vs Hugging Face BART / Marian and CTranslate2"
            if cpu
            else "## bench_peers on a GPU: ours vs Hugging Face BART / Marian in bf16 autocast",
            f"Command: `{command}` ({minutes:.1f} min). {machine} {versions(args.device)}.",
            description(args, s),
            common.markdown_table(header, rows),
            "Ratios are ours / peer: for step time lower is better, for sentences/s higher is better. Goals from "
            "issue 12; the imported row's from issue 38 (no slower than ours against BART before imports).",
            "Configurations:\n\n" + configurations(s, cpu),
        ]
    )
    if args.no_write:
        print(body)
    else:
        common.write_section("bench_peers" if args.device == "cpu" else "bench_peers_gpu", body)
        log.info("wrote the bench_peers section of %s", common.RESULTS)


if __name__ == "__main__":
    sys.exit(main())
