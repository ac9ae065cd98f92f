"""bench_peers' report: the pooled children's figures as the RESULTS.md section's tables, with the description of
what was measured and the configuration of every implementation."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import common

from peers.models import (
    DROPOUT,
    INT8,
    LABEL_SMOOTHING,
    NAMES,
    TRAIN_BATCHES,
    TRAINABLE,
    Sizes,
    decoding_impls,
    hf_config,
    our_config,
)


def versions(device: str) -> str:
    import transformers

    if device == "cuda":  # no CTranslate2 there
        return f"transformers {transformers.__version__}"
    import ctranslate2

    return f"transformers {transformers.__version__}, ctranslate2 {ctranslate2.__version__}"


def _pooled(runs: list[dict], *path: str) -> float:
    """Median over every run's sample(s) at ``run[path[0]][path[1]]...``."""
    values: list[float] = []
    for run in runs:
        for key in path:
            run = run[key]
        values.extend(run if isinstance(run, list) else [run])
    return statistics.median(values)


def results_table(runs: dict[str, dict[str, list[dict]]], s: Sizes, device: str) -> tuple[list[str], list[list[str]]]:
    """Rows = measurements; columns = implementations, then ours / each peer, then the issue's goal."""
    impls = decoding_impls(device)
    peers = [p for p in ("bart", "marian", "ct2-fp32") if p in impls]
    header = ["measurement", *(NAMES[i] for i in impls), *(f"ours / {NAMES[p]}" for p in peers), "goal"]
    memory = "peak RSS" if device == "cpu" else "peak GPU memory"

    def row(label: str, cells: dict[str, str], values: dict[str, float] | None = None, goal: str = "-") -> list[str]:
        ratios = [f"{values['ours'] / values[p]:.2f}" if values and p in values else "-" for p in peers]
        return [label, *(cells.get(i, "-") for i in impls), *ratios, goal]

    train, decode = runs["train"], runs["decode"]
    rows = []
    if any(train.values()):
        rows += _train_rows(train, s, device, row, memory)
    if not any(decode.values()):
        return header, rows
    for name, label in (("greedy", "greedy"), ("beam", f"beam {s.beams}")):
        speed = {i: s.sources / _pooled(decode[i], name, "wall") for i in impls}
        goal = _goal(speed["ours"] / speed["bart"], ">=", 1.5, "BART")
        if "ct2-fp32" in speed:
            goal += "; " + _goal(speed["ours"] / speed["ct2-fp32"], ">=", 0.8, "CT2 fp32")
        label = f"{label} decoding, sentences/s (wall), {s.sources} x {s.source_len} tokens in"
        rows.append(row(label, {i: f"{v:.1f}" for i, v in speed.items()}, speed, goal))
    if "greedy_compiled" in decode["ours"][0]:
        for name, label in (("greedy", "greedy"), ("beam", f"beam {s.beams}")):
            speed = {i: s.sources / _pooled(decode[i], name, "wall") for i in impls}
            speed["ours"] = s.sources / _pooled(decode["ours"], f"{name}_compiled", "wall")
            goal = _goal(speed["ours"] / speed["bart"], ">=", 1.5, "BART") + "; "
            goal += _goal(speed["ours"] / speed["ct2-fp32"], ">=", 0.8, "CT2 fp32")
            label = f"ours compiled (`load(..., compile=True)`): {label} decoding, sentences/s (wall); peers as above"
            rows.append(row(label, {"ours": f"{speed['ours']:.1f}"}, speed, goal))
        first = {name: max(run[f"{name}_compiled"]["first"] for run in decode["ours"]) for name in ("greedy", "beam")}
        rows.append(
            row(
                "ours compiled: its first call, compiling included, greedy / beam after it (s)",
                {"ours": f"{first['greedy']:.1f} / {first['beam']:.1f}"},
            )
        )
    lengths = {i: {f"{run['greedy']['length']} / {run['beam']['length']}" for run in decode[i]} for i in impls}
    rows.append(
        row("tokens generated per sentence, greedy / beam", {i: " or ".join(sorted(v)) for i, v in lengths.items()})
    )
    agreement = {i: f"{decode[i][0]['agreement']}/{s.sources}" for i in impls if decode[i][0]["agreement"] is not None}
    if agreement:
        rows.append(row("greedy sentences identical to ours", agreement))
    rows.append(row(f"decoding {memory} (MiB)", {i: f"{_peak(decode[i]):,.0f}" for i in impls}))
    return header, rows


def int8_table(runs: dict[str, dict[str, list[dict]]], s: Sizes) -> tuple[list[str], list[list[str]]]:
    """``--quantize int8``: sentences/s of ours fp32 and int8 (eager) and CTranslate2 fp32 and int8; int8 / peers."""
    header = ["measurement", *(NAMES[i] for i in INT8), "ours int8 / ours", "ours int8 / CT2 int8", "goal"]
    decode, rows = runs["decode"], []
    for name, label in (("greedy", "greedy"), ("beam", f"beam {s.beams}")):
        speed = {i: s.sources / _pooled(decode[i], name, "wall") for i in INT8}
        ratio = speed["ours-int8"] / speed["ct2-int8"]
        cells = [f"{speed[i]:.1f}" for i in INT8] + [f"{speed['ours-int8'] / speed['ours']:.2f}", f"{ratio:.2f}"]
        rows.append([f"{label} decoding, sentences/s (wall)", *cells, _goal(ratio, ">=", 0.8, "CT2 int8")])
    int8 = decode["ours-int8"]
    if "greedy_compiled" in int8[0]:
        for name, label in (("greedy", "greedy"), ("beam", f"beam {s.beams}")):
            speed = {i: s.sources / _pooled(decode[i], name, "wall") for i in INT8}
            compiled = s.sources / _pooled(int8, f"{name}_compiled", "wall")
            ratio = compiled / speed["ct2-int8"]
            cells = ["-", f"{compiled:.1f}", "-", "-", "-", f"{ratio:.2f}"]
            label = f'ours int8 compiled (`load(..., quantize="int8", compile=True)`): {label}, sentences/s (wall)'
            rows.append([label, *cells, _goal(ratio, ">=", 0.8, "CT2 int8")])
        first = [max(run[f"{name}_compiled"]["first"] for run in int8) for name in ("greedy", "beam")]
        label = "ours int8 compiled: its first call, compiling included, greedy / beam (s)"
        rows.append([label, "-", f"{first[0]:.1f} / {first[1]:.1f}"])
    lengths = {i: {f"{run['greedy']['length']} / {run['beam']['length']}" for run in decode[i]} for i in INT8}
    rows.append(["tokens generated per sentence, greedy / beam", *(" or ".join(sorted(lengths[i])) for i in INT8)])
    agreement = [f"{decode[i][0]['agreement']}/{s.sources}" if i != "ours" else "-" for i in INT8]
    if "agreement_compiled" in int8[0]:
        agreement[1] += f" (compiled: {int8[0]['agreement_compiled']}/{s.sources})"
    rows.append(["greedy sentences identical to ours fp32", *agreement])
    rows.append(["decoding peak RSS (MiB)", *(f"{_peak(decode[i]):,.0f}" for i in INT8)])
    return header, [row + ["-"] * (len(header) - len(row)) for row in rows]


def int8_section(
    command: str,
    minutes: float,
    machine: str,
    header: list[str],
    rows: list[list[str]],
    args: argparse.Namespace,
    s: Sizes,
) -> str:
    return "\n\n".join(
        [
            '## int8 decoding: `load(..., quantize="int8")` against CTranslate2 int8 (`bench_peers.py`)',
            f"Command: `{command}` ({minutes:.1f} min). {machine} {versions('cpu')}.",
            f"bench_peers' model and sources (d_model {s.d_model}, {s.layers}+{s.layers} layers, vocabulary {s.vocab}, "
            f"fresh weights; {s.sources} sources of {s.source_len} tokens, exactly {s.new_tokens} tokens generated), "
            "decoding only, every implementation eager in a child of its own, alternating the order: ours fp32 "
            'with column-major weights as `load` lays them out, ours int8 as `load(..., quantize="int8", '
            "compile=True)` makes it (eagerly `torch.ao`'s dynamic int8 linears, one scale per weight row; compiled, "
            "`torchao`'s int8 weights in the step Inductor compiles; its eager rows are that model decoding eagerly), "
            "CTranslate2 `compute_type='float32' | "
            f"'int8'` on the same weights; median of {args.repeats} calls after one untimed call, pooled over "
            f"{args.rounds} rounds.",
            common.markdown_table(header, rows),
        ]
    )


def _train_rows(
    train: dict[str, list[dict]], s: Sizes, device: str, row: Callable[..., list[str]], memory: str
) -> list[list[str]]:
    """The training rows: eager, then compiled where the children measured it (``--compile-train``)."""
    wall = {i: _pooled(train[i], "wall") for i in TRAINABLE}
    cpu = {i: _pooled(train[i], "cpu") for i in TRAINABLE}
    shape = f"{s.batch}x{s.seq} + {s.batch}x{s.seq} tokens"
    rows = [
        row(
            f"training step, median wall (ms), {shape}",
            {i: f"{1e3 * v:.0f}" for i, v in wall.items()},
            wall,
            _goal(wall["ours"] / wall["bart"], "<=", 0.9, "BART"),
        ),
        row(
            "ours started from HF BART's folder (`--model.init_from`), training step, median wall (ms)",
            {"ours": f"{1e3 * wall['imported']:.0f}"},
            {"ours": wall["imported"], "bart": wall["bart"]},
            _goal(wall["imported"] / wall["bart"], "<=", 0.83, "BART (issue 38)"),
        ),
        row(
            "training step, median CPU (ms)",
            {i: f"{1e3 * v:.0f}" for i, v in cpu.items()},
            cpu,
            _goal(cpu["ours"] / cpu["bart"], "<=", 0.9, "BART") if device == "cpu" else "-",  # a GPU's: waiting
        ),
        row(
            "ours started from HF BART's folder, training step, median CPU (ms)",
            {"ours": f"{1e3 * cpu['imported']:.0f}"},
            {"ours": cpu["imported"], "bart": cpu["bart"]},
            _goal(cpu["imported"] / cpu["bart"], "<=", 0.83, "BART (issue 38)") if device == "cpu" else "-",
        ),
    ]
    if "compiled" in train["ours"][0]:
        compiled = {i: _pooled(train[i], "compiled", "wall") for i in TRAINABLE}
        goal = _goal(compiled["ours"] / compiled["bart"], "<=", 0.9, "BART compiled") + "; "
        eager = compiled["ours"] / wall["bart"]
        goal += f"{_goal(eager, '<=', 0.9, 'BART eager')} ({eager:.2f})"
        label = "training step compiled (ours `--model.compile true`, peers `torch.compile(model)`), median wall (ms)"
        rows.append(row(label, {i: f"{1e3 * v:.1f}" for i, v in compiled.items()}, compiled, goal))
        untimed = {i: max(run["compiled"]["untimed"] for run in train[i]) for i in TRAINABLE}
        label = "training compiled: its untimed first steps, compiling included (s)"
        rows.append(row(label, {i: f"{v:.1f}" for i, v in untimed.items()}))
    if "kernels" in train["ours"][0]:
        kernels = {i: f"{train[i][0]['kernels']:,}" for i in TRAINABLE}
        if "compiled" in train["ours"][0]:
            kernels = {i: f"{v} / {train[i][0]['compiled']['kernels']:,}" for i, v in kernels.items()}
        label = "CUDA kernels and copies a step" + (" (eager / compiled)" if "compiled" in train["ours"][0] else "")
        rows.append(row(label, kernels))
    rows.append(row(f"training {memory} (MiB)", {i: f"{_peak(train[i]):,.0f}" for i in TRAINABLE}))
    rows.append(row("parameters", {i: f"{train[i][0]['parameters']:,}" for i in TRAINABLE}))
    return rows


def _peak(runs: list[dict]) -> float:
    return max(run["peak"] for run in runs) / 2**20


def _goal(ratio: float, relation: str, target: float, peer: str) -> str:
    met = ratio <= target if relation == "<=" else ratio >= target
    return f"{relation} {target:g}x {peer}: {'met' if met else 'missed'}"


def description(args: argparse.Namespace, s: Sizes) -> str:
    """The paragraph under the command line: sizes, what each measurement times, and how."""
    cpu = args.device == "cpu"
    optimizer = "fp32 AdamW" if cpu else "fp32 weights, bf16 autocast, fused AdamW"
    ct2 = ", CTranslate2 appending the EOS itself" if cpu else ""
    lengths = "HF `min_new_tokens = max_new_tokens`, " + (
        "CTranslate2 `min_decoding_length = max_decoding_length`, " if cpu else ""
    )
    memory = (
        'CTranslate2 decodes our model\'s weights (the "identical" row compares its greedy sentences with ours). '
        "Peak RSS is the child's high-water mark with what it imported: torch for ours, torch and transformers for "
        "HF; the CTranslate2 children import no torch (the export was written by a child of its own beforehand). "
        "Ours is read before its compiled runs, whose compiling holds memory of its own."
        if cpu
        else "Peak GPU memory is `torch.cuda.max_memory_allocated` in each child; the device is synchronised "
        "around each timed training step, and decoding's `tolist` waits for it."
    )
    return (
        f"Size: d_model {s.d_model}, {s.num_heads} heads, {s.layers}+{s.layers} layers, d_ff {s.d_ff}, "
        f"vocabulary {s.vocab} (pad 0, BOS 1 = decoder start, EOS 2), ReLU, dropout {DROPOUT} on residuals, "
        "attention weights and feed-forward hidden units, embeddings tied to the output projection, fresh weights "
        f"(seed 0). Training: {optimizer} (lr 1e-4), cross entropy with label smoothing {LABEL_SMOOTHING} over "
        "non-padding targets from each model's logits (our LightningModule's loss, `torch_handle.loss.token_sums`); "
        f"sources and targets of {s.seq // 2} to {s.seq} tokens, so about a quarter of each batch is padding, on "
        "which ours, as the LightningModule, runs no feed-forward block and computes no logits, while the peers "
        f"compute every position; median of {args.steps} timed steps after {args.warmup} untimed ones, pooled over "
        f"{args.rounds} rounds.{_compiled_training(args)}"
        + (
            f" Decoding: {s.sources} sources of {s.source_len} tokens ({s.source_len - 1} random and EOS{ct2}), "
            f"exactly {s.new_tokens} tokens generated per sentence ({lengths}ours with the EOS logit set to -inf "
            "after each decoder step; every child asserts the lengths), encoder included, median of "
            f"{args.repeats} calls after one untimed call, pooled over the rounds."
            if "decode" in args.tasks
            else ""
        )
        + f" {memory}"
    )


def _compiled_training(args: argparse.Namespace) -> str:
    if not args.compile_train:
        return ""
    return (
        " Compiled training (`--compile-train`): in the same child after the eager steps, the same optimizer going on, "
        "ours as `--model.compile true` compiles it (`torch.compile` of each encoder and decoder layer, and of the "
        "loss), the peers as HF `TrainingArguments(torch_compile=True)` does (`torch.compile(model)`, the loss "
        f"compiled too); {max(args.warmup, TRAIN_BATCHES)} untimed steps first (every batch once), in which it "
        "compiles."
    )


def configurations(s: Sizes, cpu: bool) -> str:
    ours = {k: v for k, v in our_config(s).items() if k not in ("pad_id", "bos_id", "eos_id")}
    hf = {k: v for k, v in hf_config("bart", s).items() if not k.endswith("token_id")}
    lines = [
        f"- ours: `TransformerConfig({', '.join(f'{k}={v!r}' for k, v in ours.items())})`, SDPA; pre-LN "
        "with a final LayerNorm after each stack, sinusoidal positions (interleaved sin/cos), no embedding "
        "LayerNorm."
        + (
            " Eager decoding on the CPU with every linear weight stored column-major, as `torch_handle.load` lays "
            "out a model that is not compiled (`cpu_decoding_layout`); compiled, the weights as trained."
            if cpu
            else ""
        ),
        f"- HF BART: `BartConfig({', '.join(f'{k}={v!r}' for k, v in hf.items())}, forced_eos_token_id=None)`, "
        "`attn_implementation='sdpa'`; post-LN plus a LayerNorm on the embeddings (`layernorm_embedding`), "
        "learned positions (offset 2), an output bias (`final_logits_bias`).",
        "- ours from HF BART's folder: HF BART below, written by `save_pretrained` and read back as "
        "`--model.init_from` reads a folder (`init_config`, `init_weights`): the same weights in our Transformer, "
        "post-LN with the embedding LayerNorm, learned positions (offset 2) and the output bias, trained as ours "
        "(training rows only).",
        "- HF Marian: `MarianConfig` with the same values and `share_encoder_decoder_embeddings=True`, "
        "`attn_implementation='sdpa'`; post-LN, no embedding LayerNorm, sinusoidal positions (static, sin and cos "
        "halves), an output bias.",
    ]
    if cpu:
        lines.append(
            "- CT2 fp32 / int8: ours exported by `torch_handle.ctranslate2.write_model` (pre-norm `TransformerSpec`, "
            "-inf output bias on pad and BOS, `add_source_eos`), "
            "`ctranslate2.Translator(device='cpu', compute_type='float32' | 'int8', intra_threads=THREADS, "
            "inter_threads=1)`, `translate_batch(beam_size=1 | 5, min_decoding_length=max_decoding_length="
            f"{s.new_tokens}, length_penalty=1.0)`."
        )
    return "\n".join(lines)
