"""One rank of the context-parallel equality check; ``tests/test_context_parallel.py`` launches it with torchrun.

For each case, every rank builds the same model and batch, runs the single-process reference on a copy, then the
context-parallel encoder over the group, and records the largest absolute differences of the encoder output, the
loss and every parameter gradient (the average over ranks, as data-parallel averaging over all ranks takes it).
Rank 0 writes them as JSON lines to the path in argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_handle.model import Transformer, TransformerConfig
from torch_handle.parallel import apply_context_parallel

BASE = {
    "src_vocab_size": 40,
    "tgt_vocab_size": 40,
    "d_model": 16,
    "num_heads": 2,
    "num_encoder_layers": 2,
    "num_decoder_layers": 1,
    "d_ff": 32,
    "dropout": 0.0,
    "norm_first": True,
    "encoder_attention": "local",
    "max_len": 256,
}

ROPE_LINEAR = {"position": "rope", "rope_scaling": "linear", "rope_scaling_factor": 2.0}
ROPE_NTK = {"position": "rope", "rope_scaling": "ntk", "rope_scaling_factor": 4.0}
NAIVE = {"attention_backend": "naive"}
POOL4 = {"cross_downsample": 4}
# name -> (config overrides, source length, source lengths of the rows before padding)
CASES = {
    "alibi-w3": ({"position": "alibi", "window": 3}, 37, [37, 30, 5]),
    "alibi-w40-wider-than-slice": ({"position": "alibi", "window": 40}, 37, [37, 21, 9]),
    "rope-linear": ({**ROPE_LINEAR, "window": 5}, 29, [29, 17, 29]),
    "rope-ntk": ({**ROPE_NTK, "window": 7}, 33, [33, 33, 12]),
    "sinusoidal-post-ln": ({"position": "sinusoidal", "window": 4, "norm_first": False}, 30, [30, 25, 3]),
    "learned-tied": ({"position": "learned", "window": 6, "tie_embeddings": True}, 31, [31, 10, 31]),
    "alibi-pool4": ({"position": "alibi", "window": 5, **POOL4}, 37, [37, 23, 6]),
    "rope-pool4-w50": ({"position": "rope", "window": 50, **POOL4}, 45, [45, 45, 19]),
    "sinusoidal-pool4-naive": ({"position": "sinusoidal", "window": 3, **POOL4, **NAIVE}, 26, [26, 14, 26]),
    "alibi-naive-w1": ({"position": "alibi", "window": 1, **NAIVE}, 9, [9, 4, 7]),
}


def batch(config: TransformerConfig, length: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    src = torch.randint(3, config.src_vocab_size, (len(lengths), length), generator=generator)
    for row, n in enumerate(lengths):
        src[row, n:] = config.pad_id
    tgt = torch.randint(3, config.tgt_vocab_size, (len(lengths), 9), generator=generator)
    tgt[:, 0] = config.bos_id
    tgt[1, 6:] = config.pad_id
    return src, tgt


def loss_of(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(src, tgt[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=model.config.pad_id)


def run_case(name: str, overrides: dict, length: int, lengths: list[int], group: dist.ProcessGroup) -> dict:
    config = TransformerConfig(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = Transformer(config)
    reference = copy.deepcopy(model)
    src, tgt = batch(config, length, lengths)

    want_memory = reference.encode(src).detach()
    want_loss = loss_of(reference, src, tgt)
    want_loss.backward()

    apply_context_parallel(model, group)
    memory = model.encode(src).detach()
    loss = loss_of(model, src, tgt)
    loss.backward()
    size = dist.get_world_size(group)
    grad_error = 0.0
    for (param_name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert p.grad is not None, param_name
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        grad_error = max(grad_error, float((grad / size - q.grad).abs().max()))
    with torch.no_grad():  # the flex kernel has no backward on CPU: compare its forward alone
        flex_error = None
        if config.attention_backend != "naive":
            for layer in (*model.encoder_layers, *reference.encoder_layers):
                layer.self_attn.backend = "flex"
            flex_error = float((model.encode(src) - reference.encode(src)).abs().max())
    return {
        "case": name,
        "memory_shape": list(memory.shape),
        "want_shape": list(want_memory.shape),
        "memory": float((memory - want_memory).abs().max()),
        "loss": abs(float(loss) - float(want_loss)),
        "grad": grad_error,
        "grad_scale": max(float(q.grad.abs().max()) for q in reference.parameters()),
        "flex": flex_error,
    }


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = [run_case(name, *case, dist.group.WORLD) for name, case in CASES.items()]
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
