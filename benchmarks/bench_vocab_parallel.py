"""Tensor parallelism with the vocabulary split (loss on the shards) against replicated tables, on 2 CPU processes.

Both settings split every attention head and feed-forward unit over the 2 ranks (``apply_tensor_parallel``); they
differ only in the embedding tables and the output layer: whole on every rank, the logits gathered for the loss
(``vocabulary=False``, what pipeline stages keep), or split by vocabulary rows with the loss computed on the logit
shards (``vocabulary=True``, the default). One step is forward, the module's label-smoothed loss, backward; each
rank records

- the bytes autograd keeps for the backward pass (``saved_tensors_hooks``, each storage once): activations, the
  logits and the log-probabilities among them, and the weights it holds references to (this rank's share);
- the largest ``(tokens, vocabulary)`` tensor it holds: the logits' share on this rank;
- the median wall time of the steps after a warm-up;
- the loss, which both settings must agree on.

Usage::

    python benchmarks/bench_vocab_parallel.py              # writes the bench_vocab_parallel section of RESULTS.md
    python benchmarks/bench_vocab_parallel.py --dry-run    # tiny sizes, prints the table (the test runs this)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "full": {"d_model": 512, "num_heads": 8, "layers": 2, "d_ff": 2048, "vocab": 32000, "rows": 8, "length": 64},
    "dry": {"d_model": 32, "num_heads": 2, "layers": 1, "d_ff": 64, "vocab": 512, "rows": 2, "length": 8},
}


def _child(size: str, vocabulary: bool, steps: int, out: Path) -> None:
    """One rank of one setting (run under torchrun); rank 0 writes its record as JSON to ``out``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from torch_handle.loss import token_sums
    from torch_handle.model import Transformer, TransformerConfig
    from torch_handle.parallel import apply_tensor_parallel, sharded_logits, vocab_parallel_token_sums

    s = SIZES[size]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = TransformerConfig(
        src_vocab_size=s["vocab"], tgt_vocab_size=s["vocab"], d_model=s["d_model"], num_heads=s["num_heads"],
        num_encoder_layers=s["layers"], num_decoder_layers=s["layers"], d_ff=s["d_ff"], dropout=0.0,
        tie_embeddings=True, max_len=2 * s["length"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = apply_tensor_parallel(Transformer(config).train(), mesh, vocabulary=vocabulary)
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(3, s["vocab"], (s["rows"], s["length"]), generator=generator)
    tgt = torch.randint(3, s["vocab"], (s["rows"], s["length"] + 1), generator=generator)

    saved: dict[int, int] = {}
    largest = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        local = t.to_local() if isinstance(t, DTensor) else t
        saved[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        if local.dim() >= 2 and local.shape[-1] * 2 >= s["vocab"]:  # a (tokens, vocabulary) tensor or its half
            largest = max(largest, local.numel() * local.element_size())
        return t

    def step(record: bool) -> float:
        for p in model.parameters():
            p.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack if record else lambda t: t, lambda t: t):
            with sharded_logits():
                logits = model(src, tgt[:, :-1])
            sums = vocab_parallel_token_sums if isinstance(logits, DTensor) else token_sums
            loss_sum, _, tokens = sums(logits, tgt[:, 1:], config.pad_id, 0.1)
            loss = loss_sum / tokens
        with loss_parallel():
            loss.backward()
        return float(loss)

    loss = step(record=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(record=False)
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        record = {"saved": sum(saved.values()), "largest": largest, "wall": statistics.median(times), "loss": loss}
        out.write_text(json.dumps(record))
    dist.destroy_process_group()


def _run(size: str, vocabulary: bool, steps: int, folder: Path) -> dict[str, Any]:
    out = folder / f"{size}-{vocabulary}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        __file__, "--child", size, "--vocabulary", str(vocabulary), "--steps", str(steps), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, env=env, cwd=ROOT, timeout=900, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes; prints the table, writes nothing")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    parser.add_argument("--child", choices=list(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--vocabulary", choices=("True", "False"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.vocabulary == "True", args.steps, args.out)
        return
    import torch

    size = "dry" if args.dry_run else "full"
    steps = 1 if args.dry_run else args.steps
    with tempfile.TemporaryDirectory() as folder:
        replicated = _run(size, False, steps, Path(folder))
        split = _run(size, True, steps, Path(folder))
    assert abs(split["loss"] - replicated["loss"]) <= 1e-4 * abs(replicated["loss"]), (split, replicated)
    s = SIZES[size]
    mib = 2**20
    rows = [
        ["replicated (gathered logits)", f"{replicated['saved'] / mib:,.1f}", f"{replicated['largest'] / mib:,.1f}",
         f"{replicated['wall']:.3f}", f"{replicated['loss']:.5f}", "1.00", "1.00"],
        ["split by vocabulary (loss on the shards)", f"{split['saved'] / mib:,.1f}", f"{split['largest'] / mib:,.1f}",
         f"{split['wall']:.3f}", f"{split['loss']:.5f}", f"{split['saved'] / replicated['saved']:.2f}",
         f"{split['wall'] / replicated['wall']:.2f}"],
    ]  # fmt: skip
    header = ["tables and logits", "saved for backward, rank 0 (MiB)", "largest (tokens, vocabulary) tensor (MiB)",
              "step wall (s)", "loss", "saved / replicated", "time / replicated"]  # fmt: skip
    body = "\n\n".join([
        "## Tensor parallelism: vocabulary split against replicated tables (`benchmarks/bench_vocab_parallel.py`)",
        f"Command: `python benchmarks/bench_vocab_parallel.py --steps {steps}`. {machine_line(1, torch.__version__)}",
        f"Model d_model {s['d_model']}, {s['num_heads']} heads, {s['layers']}+{s['layers']} layers, d_ff {s['d_ff']}, "
        f"vocabulary {s['vocab']:,} (tied), {s['rows']} x ({s['length']} + {s['length']}) tokens, fp32, 2 processes "
        "(gloo, one thread each), heads and feed-forward units split in both rows. A step is forward, the "
        "label-smoothed loss (0.1) and backward; the time is the median of the timed steps of rank 0.",
        markdown_table(header, rows),
    ])  # fmt: skip
    if args.dry_run:
        print(body)
    else:
        write_section("bench_vocab_parallel", body)
        print(body)


if __name__ == "__main__":
    main()
