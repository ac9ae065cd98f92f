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

On a GPU (``--device cuda``) every torch child runs its forward passes under bf16 autocast with fp32 weights, as
Lightning's ``bf16-mixed``, AdamW fused, the device synchronised around each timed step; memory is the device's
peak allocation. CTranslate2 is left out there (its goal is a CPU one).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common

log = logging.getLogger("bench_peers")

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0-3, the layout torch_handle.ctranslate2 expects
IMPLS = ["ours", "bart", "marian", "ct2-fp32", "ct2-int8"]
TRAINABLE = ["ours", "bart", "marian"]
INT8 = ["ours", "ours-int8", "ct2-fp32", "ct2-int8"]  # --quantize int8: ours eager fp32 and int8 against CTranslate2
NAMES = {"ours": "ours", "bart": "HF BART", "marian": "HF Marian", "ct2-fp32": "CT2 fp32", "ct2-int8": "CT2 int8"}
NAMES["ours-int8"] = "ours int8"
LABEL_SMOOTHING = 0.1  # as every shipped config
DROPOUT = 0.1
TRAIN_BATCHES = 4  # distinct training batches, cycled


@dataclass(frozen=True)
class Sizes:
    d_model: int
    num_heads: int
    layers: int
    d_ff: int
    vocab: int
    batch: int  # training: batch x seq source tokens and as many target tokens
    seq: int
    sources: int  # decoding: sources x source_len tokens in, new_tokens out per source
    source_len: int
    new_tokens: int
    beams: int

    @property
    def max_len(self) -> int:
        return max(self.seq, self.source_len, self.new_tokens + 1)


SIZES = {
    "full": Sizes(256, 4, 3, 1024, 8000, batch=32, seq=64, sources=16, source_len=24, new_tokens=48, beams=5),
    "dry": Sizes(32, 2, 1, 64, 64, batch=4, seq=8, sources=3, source_len=5, new_tokens=6, beams=5),
}


# --- models -------------------------------------------------------------------------------------------------


def _our_model(s: Sizes, no_eos: bool = True) -> Any:  # noqa: ANN401 - torch arrives lazily, in the child
    """Our Transformer as the shipped configs build it (pre-LN, sinusoidal, tied), fresh weights from seed 0.

    With ``no_eos`` (decoding), its ``decode`` rules EOS out, so that generation runs to exactly ``max_new_tokens``
    like the peers' minimum-length options; the weights are untouched, so the CTranslate2 export sees the same
    model. Training takes the plain model: an EOS label under a -inf logit would make the loss infinite.
    """
    import torch

    from torch_handle.model import Transformer, TransformerConfig

    class _NoEos(Transformer):
        def decode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            logits = super().decode(*args, **kwargs)
            logits[..., EOS] = float("-inf")
            return logits

    torch.manual_seed(0)
    return (_NoEos if no_eos else Transformer)(TransformerConfig(**_our_config(s)))


def _our_config(s: Sizes) -> dict[str, Any]:
    return {
        "src_vocab_size": s.vocab,
        "tgt_vocab_size": s.vocab,
        "d_model": s.d_model,
        "num_heads": s.num_heads,
        "num_encoder_layers": s.layers,
        "num_decoder_layers": s.layers,
        "d_ff": s.d_ff,
        "dropout": DROPOUT,
        "activation": "relu",
        "norm_first": True,
        "position": "sinusoidal",
        "max_len": s.max_len,
        "tie_embeddings": True,
        "pad_id": PAD,
        "bos_id": BOS,
        "eos_id": EOS,
    }


def _hf_config(impl: str, s: Sizes) -> dict[str, Any]:
    """The same size for BART (learned positions, post-LN + embedding LayerNorm) and Marian (sinusoidal, post-LN)."""
    return {
        "vocab_size": s.vocab,
        "d_model": s.d_model,
        "encoder_layers": s.layers,
        "decoder_layers": s.layers,
        "encoder_attention_heads": s.num_heads,
        "decoder_attention_heads": s.num_heads,
        "encoder_ffn_dim": s.d_ff,
        "decoder_ffn_dim": s.d_ff,
        "activation_function": "relu",
        "dropout": DROPOUT,
        "attention_dropout": DROPOUT,
        "activation_dropout": DROPOUT,
        "max_position_embeddings": s.max_len,
        "scale_embedding": True,  # x sqrt(d_model), as ours
        "tie_word_embeddings": True,
        "pad_token_id": PAD,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "decoder_start_token_id": BOS,
        "forced_eos_token_id": None,  # BART's default forces EOS as the last token
        **({"share_encoder_decoder_embeddings": True} if impl == "marian" else {}),
    }


def _hf_model(impl: str, s: Sizes) -> Any:  # noqa: ANN401
    import torch
    from transformers import AutoModelForSeq2SeqLM, BartConfig, MarianConfig

    config = (BartConfig if impl == "bart" else MarianConfig)(**_hf_config(impl, s))
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def _parameters(model: Any) -> int:  # noqa: ANN401
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --- children -----------------------------------------------------------------------------------------------


def _train_child(impl: str, s: Sizes, steps: int, warmup: int, device: str, compile: bool) -> dict[str, Any]:
    """Median step of ``impl`` eagerly and, with ``compile``, then compiled as its users would compile it: ours as
    ``--model.compile true`` does (each layer and the loss), the peers as HF ``TrainingArguments(torch_compile=True)``
    does (``torch.compile(model)``), with the loss compiled too. The compiled steps continue the same optimizer."""
    import torch

    from torch_handle.loss import compiled_token_sums, token_sums

    model = (_our_model(s, no_eos=False) if impl == "ours" else _hf_model(impl, s)).to(device)
    generator = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in _batch(torch, generator, s)) for _ in range(TRAIN_BATCHES)]
    cuda = device == "cuda"
    forward, sums = model, token_sums

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        src, tgt, labels = batch
        if impl == "ours":  # as the LightningModule: logits at the positions the loss reads only
            targets = labels != PAD
            logits, labels = forward(src, tgt, targets), labels[targets]
        else:  # no decoder mask: right padding is invisible to earlier positions, and the loss skips it
            logits = forward(input_ids=src, attention_mask=src != PAD, decoder_input_ids=tgt).logits
        loss, _, tokens = sums(logits, labels, PAD, LABEL_SMOOTHING)
        return loss / tokens

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)

    def timed_step(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        _sync(device)
        return loss

    def timed(warmup: int) -> dict[str, Any]:
        wall, cpu, untimed = [], [], 0.0
        for step in range(warmup + steps):
            _sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = timed_step(batches[step % len(batches)])
            assert torch.isfinite(loss), loss
            if step >= warmup:
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - cpu_start)
            else:
                untimed += time.perf_counter() - start
        return {"wall": wall, "cpu": cpu, "untimed": untimed}

    def kernels() -> int:
        """CUDA kernels one step launches: what a host-bound step's time follows."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            timed_step(batches[0])
        return sum(event.device_type == torch.autograd.DeviceType.CUDA for event in profile.events())

    result = timed(warmup) | {"peak": _peak_bytes(device), "parameters": _parameters(model)}
    result |= {"kernels": kernels()} if cuda else {}
    if compile:
        if impl == "ours":
            for layer in (*model.encoder_layers, *model.decoder_layers):
                layer.compile()
        else:
            forward = torch.compile(model)
        sums = compiled_token_sums()
        # Every batch once before the timed steps: a second shape of the packed tokens recompiles, dynamic.
        result["compiled"] = timed(max(warmup, len(batches))) | ({"kernels": kernels()} if cuda else {})
    return result


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _autocast(device: str) -> Any:  # noqa: ANN401
    """bf16 autocast on a GPU (Lightning's ``bf16-mixed``); fp32 on the CPU."""
    import torch

    return torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")


def _peak_bytes(device: str) -> int:
    """The device's peak allocation on a GPU, the child's peak RSS on the CPU."""
    import torch

    return torch.cuda.max_memory_allocated() if device == "cuda" else common.peak_rss_bytes()


def _batch(torch: Any, generator: Any, s: Sizes) -> tuple[Any, Any, Any]:  # noqa: ANN401
    """Right-padded source, decoder input (BOS + target) and labels (target + EOS) of random lengths."""
    src = torch.randint(4, s.vocab, (s.batch, s.seq), generator=generator)
    tokens = torch.randint(4, s.vocab, (s.batch, s.seq), generator=generator)
    src_len = torch.randint(s.seq // 2, s.seq + 1, (s.batch,), generator=generator)
    tgt_len = torch.randint(s.seq // 2, s.seq, (s.batch,), generator=generator)  # + EOS <= seq
    position = torch.arange(s.seq)
    src[position >= src_len[:, None]] = PAD
    labels = tokens.clone()
    labels[position == tgt_len[:, None]] = EOS
    labels[position > tgt_len[:, None]] = PAD
    tgt = torch.cat([torch.full((s.batch, 1), BOS), labels[:, :-1]], dim=1).masked_fill(labels == PAD, PAD)
    return src, tgt, labels


def _sources(s: Sizes) -> list[list[int]]:
    """The decoding inputs, the same in every child: ``source_len - 1`` random tokens and EOS, as our collator."""
    rng = random.Random(2)
    return [[rng.randrange(len(SPECIALS), s.vocab) for _ in range(s.source_len - 1)] + [EOS] for _ in range(s.sources)]


def _tokens(s: Sizes) -> list[str]:
    """The vocabulary strings in id order that the CTranslate2 model folder holds."""
    return SPECIALS + [f"w{i}" for i in range(len(SPECIALS), s.vocab)]


def _export_child(s: Sizes, folder: Path) -> dict[str, Any]:
    """Writes our model as a CTranslate2 folder ``folder/model`` and our greedy sentences to compare with."""
    import torch

    from torch_handle.ctranslate2 import write_model
    from torch_handle.model import generate

    model = _our_model(s).eval()
    write_model(model, _tokens(s), folder / "model")
    reference = generate(model, torch.tensor(_sources(s)), s.new_tokens).tolist()
    (folder / "reference.json").write_text(json.dumps(reference))
    return {}


def _decode_child(
    impl: str, s: Sizes, repeats: int, threads: int, folder: Path | None, device: str, compiled: bool = True
) -> dict[str, Any]:
    """Times greedy and beam decoding of the same sources; asserts every sentence has ``new_tokens`` tokens.
    Ours also compiled on the CPU, with ``compiled``; ours int8 counts its greedy sentences equal to fp32's.

    The CTranslate2 children import no torch: their peak RSS is what a CTranslate2 deployment holds.
    """
    agreement = None
    if impl in ("ct2-fp32", "ct2-int8"):
        import ctranslate2

        assert folder is not None, "CTranslate2 decodes the folder that --task export wrote"
        model_dir = folder / "model"
        translator = ctranslate2.Translator(
            str(model_dir),
            device="cpu",
            compute_type={"ct2-fp32": "float32", "ct2-int8": "int8"}[impl],
            intra_threads=threads,
            inter_threads=1,
        )
        tokens = _tokens(s)
        index = {token: i for i, token in enumerate(tokens)}
        appends_eos = json.loads((model_dir / "config.json").read_text())["add_source_eos"]
        batch = [[tokens[i] for i in row[: -1 if appends_eos else None]] for row in _sources(s)]

        def decode(beams: int) -> list[list[int]]:
            results = translator.translate_batch(
                batch,
                beam_size=beams,
                max_decoding_length=s.new_tokens,
                min_decoding_length=s.new_tokens,
                length_penalty=1.0,
            )
            return [[index[t] for t in result.hypotheses[0]] for result in results]

        reference = json.loads((folder / "reference.json").read_text())
        agreement = sum(row == ref for row, ref in zip(decode(1), reference, strict=True))
    else:
        import torch

        src = torch.tensor(_sources(s), device=device)
        decode = _torch_decoder(impl, s, src, device)
        if impl == "ours-int8":
            reference = json.loads((folder / "reference.json").read_text())  # type: ignore[operator]
            agreement = sum(row == ref for row, ref in zip(decode(1), reference, strict=True))

    figures: dict[str, Any] = {"agreement": agreement}
    modes = [("greedy", 1, {}), ("beam", s.beams, {})]
    if impl == "ours" and device == "cpu" and compiled:  # torch_handle.load(..., compile=True): CPU only
        modes += [("greedy_compiled", 1, {"compiled": True}), ("beam_compiled", s.beams, {"compiled": True})]
    for name, beams, options in modes:
        if options and "peak" not in figures:  # the peak of eager decoding, before compiling's own memory
            figures["peak"] = common.peak_rss_bytes()
        start = time.perf_counter()
        sentences = decode(beams, **options)
        first = time.perf_counter() - start  # the compiled step's compiling included
        lengths = sorted({len(row) for row in sentences})
        assert len(sentences) == s.sources and lengths == [s.new_tokens], f"{impl} {name}: lengths {lengths}"
        assert all(EOS not in row for row in sentences), f"{impl} {name}: EOS before the forced length"
        if options:
            assert sentences == decode(beams), f"{impl} {name}: not the eager sentences"
        wall, cpu = common.median_wall_and_cpu(lambda b=beams, o=options: decode(b, **o), repeats, warmup=1)
        figures[name] = {"wall": wall, "cpu": cpu, "length": lengths[0], "first": first}
    return {"peak": common.peak_rss_bytes() if impl.startswith("ct2") else _peak_bytes(device)} | figures


def _torch_decoder(impl: str, s: Sizes, src: Any, device: str) -> Callable[..., list[list[int]]]:  # noqa: ANN401
    """``decode(num_beams)`` -> the generated ids of each sentence, for ours or a Hugging Face model (its
    ``tolist`` waits for the device); ours also takes ``compiled=True`` (over a :class:`CompiledDecode`)."""
    import torch

    if impl in ("ours", "ours-int8"):
        from torch_handle.model import CompiledDecode, generate
        from torch_handle.model.generation import cpu_decoding_layout
        from torch_handle.quantize import quantize

        model = _our_model(s).to(device).eval()
        eager = model
        if device == "cpu":  # as load() lays out a model that decodes eagerly on a CPU; compiled, it keeps the trained
            eager = copy.deepcopy(model)
            quantize(eager, "int8") if impl == "ours-int8" else cpu_decoding_layout(eager)
        compiled_step: list[CompiledDecode] = []  # made at the first compiled call

        def decode(beams: int, compiled: bool = False) -> list[list[int]]:
            if compiled and not compiled_step:
                compiled_step.append(CompiledDecode(model))
            step = compiled_step[0] if compiled else None
            with _autocast(device):
                out = generate(  # (B, L), PAD after EOS; on a GPU steps replay CUDA graphs, as load() decodes
                    model if compiled else eager, src, s.new_tokens, beams, cuda_graph=device == "cuda", decode=step
                )
            return [[t for t in row if t != PAD] for row in out.tolist()]

        return decode

    from transformers import GenerationConfig

    model = _hf_model(impl, s).to(device).eval()

    def hf_decode(beams: int) -> list[list[int]]:
        generation = GenerationConfig(
            max_new_tokens=s.new_tokens,
            min_new_tokens=s.new_tokens,
            do_sample=False,
            num_beams=beams,
            **({"early_stopping": True, "length_penalty": 1.0} if beams > 1 else {}),
            decoder_start_token_id=BOS,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
            suppress_tokens=[PAD, BOS],  # as ours: neither is ever a next token
        )
        with torch.no_grad(), _autocast(device):
            out = model.generate(input_ids=src, attention_mask=torch.ones_like(src), generation_config=generation)
        assert (out[:, 0] == BOS).all(), out[:, 0]  # the decoder start, then the generated tokens
        return [row[1 : 1 + row[1:].index(EOS)] if EOS in row[1:] else row[1:] for row in out.tolist()]

    return hf_decode


def _child(impl: str, task: str, s: Sizes, args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(args.export_dir) if args.export_dir else None
    if impl.startswith("ct2"):
        result = _decode_child(impl, s, args.repeats, args.threads, folder, "cpu")
        return result | {"impl": impl, "task": task, "threads": args.threads, "torch": None, "gpu": None}
    import torch

    torch.set_num_threads(args.threads)
    if task == "train":
        result = _train_child(impl, s, args.steps, args.warmup, args.device, args.compile_train)
    elif task == "export":
        assert folder is not None, "--task export needs --export-dir"
        result = _export_child(s, folder)
    else:
        result = _decode_child(impl, s, args.repeats, args.threads, folder, args.device, not args.quantize)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    return result | {
        "impl": impl,
        "task": task,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": gpu,
    }


# --- parent -------------------------------------------------------------------------------------------------


def _versions(device: str) -> str:
    import transformers

    if device == "cuda":  # no CTranslate2 there
        return f"transformers {transformers.__version__}"
    import ctranslate2

    return f"transformers {transformers.__version__}, ctranslate2 {ctranslate2.__version__}"


def _decoders(device: str, quantize: str | None = None) -> list[str]:
    """The implementations that decode: CTranslate2 on the CPU only, where its goal is; int8 against CTranslate2."""
    return INT8 if quantize else IMPLS if device == "cpu" else TRAINABLE


def _run_all(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[dict]]], str]:
    """Every (task, implementation) child ``args.rounds`` times, alternating the order; the machine line."""
    script = str(Path(__file__).resolve())
    common_args = ["--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    common_args += ["--repeats", str(args.repeats), "--device", args.device] + (["--dry-run"] if args.dry_run else [])
    common_args += ["--batch", str(args.batch)] if args.batch else []
    common_args += ["--compile-train"] if args.compile_train else []
    common_args += ["--quantize", args.quantize] if args.quantize else []
    decoders = _decoders(args.device, args.quantize)
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


def _pooled(runs: list[dict], *path: str) -> float:
    """Median over every run's sample(s) at ``run[path[0]][path[1]]...``."""
    values: list[float] = []
    for run in runs:
        for key in path:
            run = run[key]
        values.extend(run if isinstance(run, list) else [run])
    return statistics.median(values)


def _table(runs: dict[str, dict[str, list[dict]]], s: Sizes, device: str) -> tuple[list[str], list[list[str]]]:
    """Rows = measurements; columns = implementations, then ours / each peer, then the issue's goal."""
    impls = _decoders(device)
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


def _int8_table(runs: dict[str, dict[str, list[dict]]], s: Sizes) -> tuple[list[str], list[list[str]]]:
    """``--quantize int8``: sentences/s of ours fp32 and int8 (eager) and CTranslate2 fp32 and int8; int8 / peers."""
    header = ["measurement", *(NAMES[i] for i in INT8), "ours int8 / ours", "ours int8 / CT2 int8", "goal"]
    decode, rows = runs["decode"], []
    for name, label in (("greedy", "greedy"), ("beam", f"beam {s.beams}")):
        speed = {i: s.sources / _pooled(decode[i], name, "wall") for i in INT8}
        ratio = speed["ours-int8"] / speed["ct2-int8"]
        cells = [f"{speed[i]:.1f}" for i in INT8] + [f"{speed['ours-int8'] / speed['ours']:.2f}", f"{ratio:.2f}"]
        rows.append([f"{label} decoding, sentences/s (wall)", *cells, _goal(ratio, ">=", 0.8, "CT2 int8")])
    lengths = {i: {f"{run['greedy']['length']} / {run['beam']['length']}" for run in decode[i]} for i in INT8}
    rows.append(["tokens generated per sentence, greedy / beam", *(" or ".join(sorted(lengths[i])) for i in INT8)])
    agreement = [f"{decode[i][0]['agreement']}/{s.sources}" if i != "ours" else "-" for i in INT8]
    rows.append(["greedy sentences identical to ours fp32", *agreement])
    rows.append(["decoding peak RSS (MiB)", *(f"{_peak(decode[i]):,.0f}" for i in INT8)])
    return header, [row + ["-"] * (len(header) - len(row)) for row in rows]


def _int8_section(
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
            f"Command: `{command}` ({minutes:.1f} min). {machine} {_versions('cpu')}.",
            f"bench_peers' model and sources (d_model {s.d_model}, {s.layers}+{s.layers} layers, vocabulary {s.vocab}, "
            f"fresh weights; {s.sources} sources of {s.source_len} tokens, exactly {s.new_tokens} tokens generated), "
            "decoding only, every implementation eager in a child of its own, alternating the order: ours fp32 "
            'with column-major weights as `load` lays them out, ours int8 as `load(..., quantize="int8")` makes it '
            "(`torch.ao` dynamic int8 linears, one scale per weight row), CTranslate2 `compute_type='float32' | "
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
            "training step, median CPU (ms)",
            {i: f"{1e3 * v:.0f}" for i, v in cpu.items()},
            cpu,
            _goal(cpu["ours"] / cpu["bart"], "<=", 0.9, "BART") if device == "cpu" else "-",  # a GPU's: waiting
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
    return f"{relation} {target:.1f}x {peer}: {'met' if met else 'missed'}"


def _description(args: argparse.Namespace, s: Sizes) -> str:
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


def _configs(s: Sizes, cpu: bool) -> str:
    ours = {k: v for k, v in _our_config(s).items() if k not in ("pad_id", "bos_id", "eos_id")}
    hf = {k: v for k, v in _hf_config("bart", s).items() if not k.endswith("token_id")}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=[*IMPLS, "ours-int8"], help="run one child measurement and print JSON")
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
        print(json.dumps(_child(args.child, args.task, s, args)))
        return

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    runs, machine = _run_all(args)
    minutes = (time.perf_counter() - start) / 60
    log.info("all children: %.1f min", minutes)
    header, rows = _int8_table(runs, s) if args.quantize else _table(runs, s, args.device)
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
        body = _int8_section(command, minutes, machine, header, rows, args, s)
        print(body) if args.no_write else common.write_section("bench_peers_int8", body)
        return
    cpu = args.device == "cpu"
    body = "\n\n".join(
        [
            "## bench_peers: ours vs Hugging Face BART / Marian and CTranslate2"
            if cpu
            else "## bench_peers on a GPU: ours vs Hugging Face BART / Marian in bf16 autocast",
            f"Command: `{command}` ({minutes:.1f} min). {machine} {_versions(args.device)}.",
            _description(args, s),
            common.markdown_table(header, rows),
            "Ratios are ours / peer: for step time lower is better, for sentences/s higher is better. Goals from "
            "issue 12.",
            "Configurations:\n\n" + _configs(s, cpu),
        ]
    )
    if args.no_write:
        print(body)
    else:
        common.write_section("bench_peers" if args.device == "cpu" else "bench_peers_gpu", body)
        log.info("wrote the bench_peers section of %s", common.RESULTS)


if __name__ == "__main__":
    sys.exit(main())
