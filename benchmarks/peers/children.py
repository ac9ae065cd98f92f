"""bench_peers' child processes, one measurement each: a training run, a decoding run (ours, a Hugging Face peer or
CTranslate2), or the CTranslate2 export the CTranslate2 children decode. Each returns the JSON its parent pools."""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

from peers.models import (
    BOS,
    EOS,
    LABEL_SMOOTHING,
    PAD,
    TRAIN_BATCHES,
    Sizes,
    count_parameters,
    decoding_sources,
    hf_model,
    imported_bart,
    our_model,
    training_batch,
    vocabulary,
)


def _train_child(impl: str, s: Sizes, steps: int, warmup: int, device: str, compile: bool) -> dict[str, Any]:
    """Median step of ``impl`` eagerly and, with ``compile``, then compiled as its users would compile it: ours as
    ``--model.compile true`` does (each layer and the loss), the peers as HF ``TrainingArguments(torch_compile=True)``
    does (``torch.compile(model)``), with the loss compiled too. The compiled steps continue the same optimizer."""
    import torch

    from torch_handle.loss import compiled_token_sums, token_sums

    ours = impl in ("ours", "imported")
    model = our_model(s, no_eos=False) if impl == "ours" else imported_bart(s) if ours else hf_model(impl, s)
    model = model.to(device)
    generator = torch.Generator().manual_seed(1)
    batches = [tuple(t.to(device) for t in training_batch(torch, generator, s)) for _ in range(TRAIN_BATCHES)]
    cuda = device == "cuda"
    forward, sums = model, token_sums

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        src, tgt, labels = batch
        if ours:  # as the LightningModule: logits at the positions the loss reads only
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

    result = timed(warmup) | {"peak": _peak_bytes(device), "parameters": count_parameters(model)}
    result |= {"kernels": kernels()} if cuda else {}
    if compile:
        if ours:
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


def _export_child(s: Sizes, folder: Path) -> dict[str, Any]:
    """Writes our model as a CTranslate2 folder ``folder/model`` and our greedy sentences to compare with."""
    import torch

    from torch_handle.ctranslate2 import write_model
    from torch_handle.model import generate

    model = our_model(s).eval()
    write_model(model, vocabulary(s), folder / "model")
    reference = generate(model, torch.tensor(decoding_sources(s)), s.new_tokens).tolist()
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
        tokens = vocabulary(s)
        index = {token: i for i, token in enumerate(tokens)}
        appends_eos = json.loads((model_dir / "config.json").read_text())["add_source_eos"]
        batch = [[tokens[i] for i in row[: -1 if appends_eos else None]] for row in decoding_sources(s)]

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

        src = torch.tensor(decoding_sources(s), device=device)
        decode = _torch_decoder(impl, s, src, device)
        if impl == "ours-int8":
            reference = json.loads((folder / "reference.json").read_text())  # type: ignore[operator]
            agreement = sum(row == ref for row, ref in zip(decode(1), reference, strict=True))

    figures: dict[str, Any] = {"agreement": agreement}
    modes = [("greedy", 1, {}), ("beam", s.beams, {})]
    # torch_handle.load(..., compile=True), on a CPU only: ours fp32 unless --quantize, ours int8 with it
    if device == "cpu" and ((impl == "ours" and compiled) or impl == "ours-int8"):
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
        if options and impl == "ours":
            assert sentences == decode(beams), f"{impl} {name}: not the eager sentences"
        if name == "greedy_compiled" and impl == "ours-int8":  # its activations quantized per row, not per tensor
            figures["agreement_compiled"] = sum(row == ref for row, ref in zip(sentences, reference, strict=True))
        wall, cpu = common.median_wall_and_cpu(lambda b=beams, o=options: decode(b, **o), repeats, warmup=1)
        figures[name] = {"wall": wall, "cpu": cpu, "length": lengths[0], "first": first}
    return {"peak": common.peak_rss_bytes() if impl.startswith("ct2") else _peak_bytes(device)} | figures


def _torch_decoder(impl: str, s: Sizes, src: Any, device: str) -> Callable[..., list[list[int]]]:  # noqa: ANN401
    """``decode(num_beams)`` -> the generated ids of each sentence, for ours or a Hugging Face model (its
    ``tolist`` waits for the device); ours also takes ``compiled=True`` (over a :class:`CompiledDecode`)."""
    import torch

    if impl in ("ours", "ours-int8"):
        from torch_handle.model import CompiledDecode, generate
        from torch_handle.model.steps import cpu_decoding_layout
        from torch_handle.quantize import quantize

        model = our_model(s).to(device).eval()
        eager = model
        if device == "cpu" and impl == "ours-int8":  # as load(..., quantize="int8", compile=True) makes it
            quantize(model, "int8", compile=True)
        elif device == "cpu":  # as load() lays out a model decoding eagerly on a CPU; compiled, it keeps the trained
            eager = copy.deepcopy(model)
            cpu_decoding_layout(eager)
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

    model = hf_model(impl, s).to(device).eval()

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


def child(impl: str, task: str, s: Sizes, args: argparse.Namespace) -> dict[str, Any]:
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
