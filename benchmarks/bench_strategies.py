"""DDP, ZeRO-1/2/3, FSDP, tensor and pipeline parallelism on two CPU processes: step time, peak memory, model state.

Each strategy trains the same ~30M-parameter model on the built-in demo data through ``python cli.py fit
--config configs/STRATEGY.yaml`` (two processes, gloo, one intra-op thread each), with ``strategy_probe.py``'s
:class:`StrategyProbe` added as a callback. In every rank the probe records

- the wall and CPU time of each training step (``on_train_batch_start`` to ``on_train_batch_end``: forward,
  backward, gradient communication and the optimizer step);
- the rank's model-state bytes just before the second optimizer step (``on_before_optimizer_step``), when
  the gradients of that step and the optimizer state of the first both exist: the bytes of the distinct
  storages of the parameters, their gradients, the optimizer's ``exp_avg``/``exp_avg_sq`` and every other
  tensor the strategy keeps for them (DeepSpeed's fp32 master partition and flat gradient partitions, FSDP's
  flat parameters), and, as a cross-check, of every tensor alive in the process;
- the rank's resident high-water mark (``VmHWM``) at the end of training,

and writes them to ``probe.rank{R}.json`` in the run folder. The parent collects the files and rewrites the
``bench_strategies`` section of ``RESULTS.md``.

Usage::

    python benchmarks/bench_strategies.py                    # every strategy, writes RESULTS.md
    python benchmarks/bench_strategies.py --case zero2 --no-write
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import common
import torch

log = logging.getLogger("bench_strategies")

ROOT = Path(__file__).resolve().parents[1]
# case -> (config, extra arguments). The shipped zero3.yaml sets reduce_bucket_size to 5e7 elements; the
# extra case shows Lightning's default of 2e8, a ZeRO-3 bucket larger in fp32 than this model's whole state.
CASES = {
    "ddp": ("ddp", []),
    "zero1": ("zero1", []),
    "zero2": ("zero2", []),
    "zero3": ("zero3", []),
    "zero3, bucket 2e8": ("zero3", ["--trainer.strategy.init_args.reduce_bucket_size", "200000000"]),
    "fsdp": ("fsdp", []),
    "fsdp2": (
        "tp",
        ["--trainer.strategy.init_args.tensor_parallel_size=1", "--trainer.strategy.init_args.data_parallel_size=2"],
    ),
    "tp": ("tp", []),
    "fsdp2_tp": ("fsdp2_tp", []),
    "pp": ("pp", []),
    # Two stages per process (encoder layers 0-1 and 2-3 on stages 0 and 1, the decoder's on 2 and 3): the
    # interleaved schedule's bubble is half 1F1B's, for twice the activations sent.
    "pp, interleaved": (
        "pp",
        [
            "--trainer.strategy.init_args.pipeline_schedule=interleaved_1f1b",
            "--trainer.strategy.init_args.stages_per_rank=2",
        ],
    ),
}
WORLD = 2
PROCESSES = {"fsdp2_tp": 4}  # the 2-D mesh, 2 x 2: two FSDP2 replicas of two tensor-parallel ranks
MODELS = {
    "31m": {"d_model": 512, "num_heads": 8, "num_encoder_layers": 4, "num_decoder_layers": 4, "d_ff": 2048},
    # issue 13's ~400M configuration (issue 15's sizes; the demo's 1000-token vocabulary, not 32k)
    "400m": {"d_model": 1024, "num_heads": 16, "num_encoder_layers": 12, "num_decoder_layers": 12, "d_ff": 4096},
}
SECTIONS = {"31m": "bench_strategies", "400m": "bench_strategies_400m"}  # RESULTS.md sections
# fp32 bytes per parameter held by one rank of N: 4 params + 4 grads + 8 Adam (m, v), each sharded or not.
# Tensor parallelism splits a fraction f of the parameters (the layers' matrices) and replicates the rest; a pipeline
# stage holds a share s of them (its layers, and the embeddings or output layer it runs).
FP32_FORMULA = {
    "ddp": ("16", lambda n, f: 16.0),
    "zero1": ("4 + 4 + 8/N", lambda n, f: 8 + 8 / n),
    "zero2": ("4 + 12/N", lambda n, f: 4 + 12 / n),
    "zero3": ("16/N", lambda n, f: 16 / n),
    "fsdp": ("16/N", lambda n, f: 16 / n),
    "fsdp2": ("16/N", lambda n, f: 16 / n),
    "tp": ("16 (f/N + 1 - f)", lambda n, f: 16 * (f / n + 1 - f)),
    "fsdp2_tp": ("16 (f/(dp tp) + (1 - f)/dp)", lambda n, f: 16 * (f / n + (1 - f) / 2)),  # dp = tp = 2
    "pp": ("16 s", lambda n, s: 16 * s),
}
FRACTION = {"tp": "f", "fsdp2_tp": "f", "pp": "s"}  # the symbol of the fraction a formula takes
# Batches one step trains: one per rank under data parallelism, one shared by the ranks under tensor and pipeline
# parallelism (each rank reads the same token budget per batch), so their time per batch is their step time.
BATCHES_PER_STEP = {"tp": 1, "fsdp2_tp": 2, "pp": 1}
# What DeepSpeed keeps: also an fp32 master partition, even when the parameters are fp32 already (the
# mixed-precision formula's 12 optimizer bytes with 4-byte parameters and gradients); and its stage 1, like
# stage 2, keeps only the rank's gradient partition once backward ends (it holds every gradient until then).
DEEPSPEED_FORMULA = {
    "zero1": ("4 + 16/N", lambda n: 4 + 16 / n),
    "zero2": ("4 + 16/N", lambda n: 4 + 16 / n),
    "zero3": ("20/N", lambda n: 20 / n),
}
MIXED_FORMULA = {
    "ddp": "16",
    "zero1": "4 + 12/N",
    "zero2": "2 + 14/N",
    "zero3": "16/N",
    "fsdp": "16/N",
    "fsdp2": "16/N",
    "tp": "16 (f/N + 1 - f)",
    "fsdp2_tp": "16 (f/(dp tp) + (1 - f)/dp)",
    "pp": "16 s",
}


def run_case(case: str, root: Path, steps: int, max_tokens: int, timeout: float, size: str) -> list[dict[str, Any]]:
    """Trains with the case's ``configs/STRATEGY.yaml`` on its CPU processes; returns each rank's probe record."""
    strategy, extra = CASES[case]
    model = [f"--model.transformer.{key}={value}" for key, value in MODELS[size].items()]
    command = [
        sys.executable, "cli.py", "fit",
        "--config", f"configs/{strategy}.yaml",
        "--trainer.accelerator", "cpu",
        "--trainer.devices", str(_world(case)),
        *model,
        "--model.transformer.dropout", "0.1",
        "--model.transformer.max_len", "128",
        "--model.max_new_tokens", "64",
        "--model.transformer.norm_first", "true",
        "--data.init_args.demo_size", "4000",
        "--data.init_args.bpe_vocab_size", "1000",
        "--data.init_args.max_tokens", str(max_tokens),
        "--trainer.max_steps", str(steps),
        "--trainer.limit_val_batches", "0",
        "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--checkpoint.save_top_k", "0",
        "--checkpoint.save_last", "false",
        "--trainer.default_root_dir", str(root),
        "--trainer.callbacks+=strategy_probe.StrategyProbe",
        *extra,
    ]  # fmt: skip
    path = os.pathsep.join([str(ROOT), str(Path(__file__).resolve().parent)])
    env = os.environ | {"OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port()), "PYTHONPATH": path}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode:
        raise RuntimeError(f"{case} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    return [json.loads((root / f"probe.rank{rank}.json").read_text()) for rank in range(_world(case))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(case: str) -> int:
    """The processes of a case: two, or four for the 2-D mesh."""
    return PROCESSES.get(case, WORLD)


def _kind(case: str) -> str:
    """The formulas' key of a case: its own name, or its config's (``zero3, bucket 2e8`` is ``zero3``'s)."""
    return case if case in FP32_FORMULA else CASES[case][0]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=list(CASES), action="append", help="default: every case")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per strategy")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 2)")
    parser.add_argument("--max-tokens", type=int, default=512, help="padded tokens per batch per rank")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for one strategy's run")
    parser.add_argument("--size", choices=list(MODELS), default="31m", help="the model (its own RESULTS.md section)")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    args = parser.parse_args()
    assert args.warmup >= 2, "the model state is measured at the second step"
    cases = args.case or list(CASES)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    start_line = common.machine_line(1, torch.__version__)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_strategies-") as tmp:
        for index, strategy in enumerate(cases):
            steps = args.warmup + args.steps
            ranks = run_case(strategy, Path(tmp) / str(index), steps, args.max_tokens, args.timeout, args.size)
            # A step ends when the slower rank ends it: take the slower rank's time per step.
            wall = [max(r["wall"][i] for r in ranks) for i in range(args.warmup, args.warmup + args.steps)]
            cpu = [max(r["cpu"][i] for r in ranks) for i in range(args.warmup, args.warmup + args.steps)]
            results[strategy] = {
                "wall": statistics.median(wall),
                "cpu": statistics.median(cpu),
                "peak_rss": [r["peak_rss"] for r in ranks],
                "state": [r["state"] for r in ranks],
                "parameters": ranks[0]["parameters"],
                "split_fraction": ranks[0]["split_fraction"],
                "held_fraction": [r["held_fraction"] for r in ranks],
                "activations": [r.get("activations") for r in ranks],
            }
            log.info("%s: median step %.2f s, peak RSS %s MiB", strategy, results[strategy]["wall"],
                     " / ".join(_mib(b) for b in results[strategy]["peak_rss"]))  # fmt: skip
            log.info("%s: model state per rank %s", strategy, results[strategy]["state"])

    parameters = next(iter(results.values()))["parameters"]
    base = results.get("ddp")
    base_memory = base["state"][0]["total"] + base["activations"][0] if base else 0
    timing_rows, state_rows = [], []
    for strategy, result in results.items():
        rss = result["peak_rss"]
        batches, world = BATCHES_PER_STEP.get(_kind(strategy), WORLD), _world(strategy)
        per_batch = result["wall"] / batches
        timing_rows.append(
            [
                strategy,
                str(batches),
                f"{result['wall']:.2f}",
                f"{result['cpu']:.2f}",
                f"{result['wall'] / base['wall']:.2f}" if base else "",
                f"{result['cpu'] / base['cpu']:.2f}" if base else "",
                f"{per_batch / (base['wall'] / WORLD):.2f}" if base else "",
                " / ".join(_mib(b) for b in rss),
                f"{max(rss) / max(base['peak_rss']):.2f}" if base else "",
            ]
        )
        held = max(range(world), key=lambda r: result["state"][r]["total"])  # the rank holding more (uneven shares)
        state = result["state"][held]
        config = _kind(strategy)
        fraction = result["held_fraction"][held] if config == "pp" else result["split_fraction"]
        activations = result["activations"][held]
        label, formula = FP32_FORMULA[config]
        ds_label, ds_formula = DEEPSPEED_FORMULA.get(config, ("", None))
        state_rows.append(
            [
                strategy,
                " / ".join(_mib(state[k]) for k in ("params", "grads", "master", "adam_moments", "other")),
                _mib(state["total"]),
                f"{state['total'] / parameters:.2f}",
                f"{label} = {formula(world, fraction):.2f}"
                + (f" ({FRACTION[config]} = {fraction:.3f})" if config in FRACTION else ""),
                f"{ds_label} = {ds_formula(WORLD):.1f}" if ds_formula else "",
                MIXED_FORMULA[config],
                f"{state['total'] / base['state'][0]['total']:.2f}" if base else "",
                _mib(activations) if activations is not None else "",
                f"{(state['total'] + activations) / base_memory:.2f}" if base and activations is not None else "",
                _mib(state["all_live_tensors"]),
            ]
        )

    command = f"python benchmarks/bench_strategies.py --steps {args.steps} --warmup {args.warmup}"
    command += f" --max-tokens {args.max_tokens}" + (f" --size {args.size}" if args.size != "31m" else "")
    command += "".join(f" --case '{case}'" for case in args.case or [])
    model = MODELS[args.size]
    body = "\n\n".join(
        [
            f"## bench_strategies: strategies on two CPU processes, {parameters / 1e6:.0f}M parameters",
            f"Command: `{command}`. {start_line}",
            f"`python cli.py fit --config configs/STRATEGY.yaml` with {WORLD} processes (gloo, one intra-op thread "
            f"each) on the built-in demo data, {args.max_tokens} padded tokens per batch per rank; model "
            f"d_model {model['d_model']}, {model['num_heads']} heads, {model['num_encoder_layers']}+"
            f"{model['num_decoder_layers']} layers, d_ff {model['d_ff']}, vocabulary 1000 (tied embeddings): "
            f"{parameters:,} parameters; fp32 (`32-true`), AdamW. Step time is the median over {args.steps} "
            f"steps after {args.warmup} untimed ones of the slower rank's step (forward, backward, gradient "
            "communication, optimizer step); CPU time leaves out time taken by other processes. A step of DDP, "
            "ZeRO or FSDP trains one batch per rank; a step of tensor or pipeline parallelism one batch shared by "
            "both ranks, so its time per batch (tokens per second) is its step time: `wall per batch / DDP` "
            "compares that. `fsdp2_tp` (`configs/fsdp2_tp.yaml`) runs 4 processes, two FSDP2 replicas of two "
            "tensor-parallel ranks, on the same cores: a step trains 2 batches, and its times are those of 4 "
            "processes sharing the cores. Peak RSS is each "
            "rank's resident high-water mark (`VmHWM`), PyTorch, Lightning and DeepSpeed runtime included.",
            common.markdown_table(
                [
                    "strategy",
                    "batches per step",
                    "step, wall (s)",
                    "step, CPU (s)",
                    "wall / DDP",
                    "CPU / DDP",
                    "wall per batch / DDP",
                    "peak RSS per rank (MiB)",
                    "peak RSS / DDP",
                ],
                timing_rows,
            ),  # fmt: skip
            "Model state is measured in each rank just before the second optimizer step, when that step's "
            "gradients and the first step's Adam moments both exist: the bytes of distinct tensor storages "
            "(views of one flat buffer count once) of the parameters as the rank holds them, their gradients, "
            "Adam's `exp_avg`/`exp_avg_sq`, and every other tensor reachable from the strategy's optimizer and "
            "wrapper (DeepSpeed's fp32 master partition, gradient partitions and reduce buckets, FSDP's flat "
            "parameters); `other` is mostly DeepSpeed's preallocated reduce bucket. DDP's gradient buckets live "
            "in its C++ reducer, out of Python's reach, and are not counted. The rank holding more is shown. In "
            "fp32 a rank of N needs 4 bytes/param of parameters, 4 of gradients and 8 of Adam moments, each "
            "sharded or not: DDP 16, ZeRO-1 4 + 4 + 8/N, ZeRO-2 4 + 12/N, ZeRO-3, FSDP (full shard) and FSDP2 "
            "(`fsdp2`: `configs/tp.yaml` with tensor_parallel_size 1, `fully_shard` per layer) 16/N. "
            "DeepSpeed also keeps an fp32 master copy of its partition when the parameters are fp32 already "
            "(+4/N), and its stage 1, like stage 2, keeps only this rank's gradient partition once backward "
            "has ended (stage 1 holds every full gradient until the end of backward, stage 2 reduces them "
            "bucket by bucket during it). ZeRO-3 preallocates a reduce bucket of `reduce_bucket_size` elements: "
            "`configs/zero3.yaml` sets 5e7 (191 MiB in fp32); the `zero3, bucket 2e8` row shows Lightning's "
            "default, 763 MiB, more than this model's whole state. Tensor parallelism (`tp`) splits every layer's "
            "matrices, a fraction f of the parameters, over the N ranks and replicates the rest (embeddings, "
            "norms, output-projection biases): 16 (f/N + 1 - f); FSDP2 over tensor parallelism (`fsdp2_tp`) shards "
            "a rank's share once more over the dp replicas: 16 (f/(dp tp) + (1 - f)/dp). A pipeline stage (`pp`: "
            "the encoder on rank 0, the "
            "decoder on rank 1, 4 micro-batches by 1F1B; `pp, interleaved`: 4 stages of 2 layers by interleaved "
            "1F1B, rank 0 holding stages 0 and 2, rank 1 stages 1 and 3) holds a share s of the parameters, its "
            "layers and the embeddings or output layer it runs (the tied embedding on both): 16 s. The "
            "mixed-precision column is "
            "the ZeRO paper's (2-byte parameters and gradients, 12 bytes of fp32 master, m and v), for "
            "comparison only: it does not apply to these runs. Activations are the bytes of the distinct storages "
            "autograd keeps for the backward pass of the measured step, parameters left out (also as FSDP gathers or "
            "tensor parallelism splits them); not measured in a pipeline, whose micro-batches' tensors come and go "
            "inside its schedule. `all live tensors` counts every tensor alive in the rank's Python heap (the batch "
            "and activations of the step included), a cross-check on the total.",
            common.markdown_table(
                [
                    "strategy",
                    "params / grads / fp32 master / Adam m,v / other (MiB)",
                    "model state (MiB)",
                    "bytes/param measured",
                    f"fp32 formula (N={WORLD}; fsdp2_tp: dp = tp = 2)",
                    f"what DeepSpeed keeps in fp32 (N={WORLD})",
                    "mixed-precision formula",
                    "state / DDP",
                    "activations kept for backward (MiB)",
                    "state + activations / DDP",
                    "all live tensors (MiB)",
                ],
                state_rows,
            ),  # fmt: skip
        ]
    )
    if args.no_write:
        print(body)
    else:
        common.write_section(SECTIONS[args.size], body)
        log.info("wrote the bench_strategies section of %s", common.RESULTS)


if __name__ == "__main__":
    sys.exit(main())
