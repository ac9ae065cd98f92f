"""One rank of the tensor-parallel and FSDP2 equality checks; ``tests/test_tensor_parallel.py`` launches it with
torchrun on a ``(data_parallel, tensor_parallel)`` mesh: TP alone, FSDP2 alone, or both (2-D).

For each case every rank builds the same model, trains a single-process copy on every replica's batches and the
model side by side for a few AdamW steps, and records the largest absolute differences of the loss and of every
parameter gradient (gathered to its full shape) per step, and of the weights after the last step (but for the
bias of the keys, see :func:`comparable`). Rank 0 writes them
as JSON lines to the path in argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tests.helpers import comparable, full  # the launching test puts the checkout on PYTHONPATH
from torch_handle.loss import token_sums
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.parallel import apply_fully_shard, apply_tensor_parallel, sharded_logits, vocab_parallel_token_sums
from torch_handle.pretrained.t5 import FIXED as T5

BASE = {
    "src_vocab_size": 48,
    "tgt_vocab_size": 48,
    "d_model": 16,
    "num_heads": 4,
    "num_encoder_layers": 2,
    "num_decoder_layers": 2,
    "d_ff": 32,
    "dropout": 0.0,
    "max_len": 64,
}
STEPS = 3
# name -> config overrides
CASES = {
    "post-ln-sinusoidal": {"norm_first": False, "position": "sinusoidal"},
    "pre-ln-tied-alibi-local": {"norm_first": True, "tie_embeddings": True, "position": "alibi",
                                "encoder_attention": "local", "window": 3},
    "pre-ln-rope-pool4": {"norm_first": True, "position": "rope", "cross_downsample": 4},
    # BART's layout: learned positions after an offset, no final norm, an output bias (random below) added to each
    # rank's share of the vocabulary. Not its embedding LayerNorm (replicated as any norm): with it, on 2 x 2
    # processes, the gradients agreed but AdamW turned a near-zero gradient's noise into a weight past the tolerance.
    "post-ln-learned-tied-untied-vocab-bart": {"norm_first": False, "position": "learned", "tie_embeddings": True,
                                               "src_vocab_size": 40, "position_offset": 2, "final_norm": False,
                                               "final_logits_bias": True},
    # T5 v1.1: relative-bias tables split by heads, RMSNorm, no biases, a gated feed-forward, heads wider than
    # d_model / num_heads, and few buckets over a short distance, so the logarithmic buckets are used too
    "t5-v1.1": {**T5, "activation": "gelu_tanh", "gated_ff": True, "attention_head_dim": 8, "relative_buckets": 8,
                "relative_max_distance": 12},
    # LED: local windows plus a global first token whose queries, keys and values come from projections of their own
    # (split by heads as the others), BART's learned positions after an offset
    "led": {"norm_first": False, "position": "learned", "position_offset": 2, "encoder_attention": "longformer",
            "window": 4, "global_tokens": 1, "activation": "gelu"},
    "pre-ln-naive-checkpointed": {"norm_first": True, "attention_backend": "naive", "activation_checkpointing": True},
}  # fmt: skip


def batch(config: TransformerConfig, step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel replica ``replica``'s three rows at ``step``, padded in the source and the target."""
    generator = torch.Generator().manual_seed(100 * step + replica)
    src = torch.randint(3, config.src_vocab_size, (3, 13), generator=generator)
    src[1, 9:] = config.pad_id
    src[2, 4:] = config.pad_id
    tgt = torch.randint(3, config.tgt_vocab_size, (3, 8), generator=generator)
    tgt[:, 0] = config.bos_id
    tgt[0, 5:] = config.pad_id
    return src, tgt


def loss_of(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """The module's loss per target token; under tensor parallelism from logits split by vocabulary, as in training."""
    with sharded_logits():
        logits = model(src, tgt[:, :-1])
    sums = vocab_parallel_token_sums if isinstance(logits, DTensor) else token_sums
    loss_sum, _, tokens = sums(logits, tgt[:, 1:], model.config.pad_id, 0.1)
    return loss_sum / tokens


def run_case(name: str, overrides: dict, mesh: DeviceMesh) -> dict:
    config = TransformerConfig(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = Transformer(config).train()
    if config.final_logits_bias:  # imported as zeros by a fresh model: values that the split must add to each share
        model.logits_bias.normal_()
    reference = copy.deepcopy(model)
    dp, tp = mesh["data_parallel"], mesh["tensor_parallel"]
    if tp.size() > 1:
        apply_tensor_parallel(model, tp)
    if dp.size() > 1:
        apply_fully_shard(model, dp)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    result: dict = {"case": name, "loss": [], "grad": [], "grad_scale": 0.0}
    for step in range(STEPS):
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = loss_of(model, *batch(config, step, dp.get_local_rank()))  # this replica's rows
        with loss_parallel():  # as the module's backward
            loss.backward()
        # One process: the mean of every replica's loss, as data parallelism averages their gradients.
        want = sum(loss_of(reference, *batch(config, step, r)) for r in range(dp.size())) / dp.size()
        want.backward()
        losses = torch.stack((loss.detach(), want.detach()))
        dist.all_reduce(losses[:1], group=dp.get_group())  # the replicas' mean, to compare with the reference
        result["loss"].append(abs(float(losses[0]) / dp.size() - float(losses[1])))
        pairs = list(zip(model.named_parameters(), reference.named_parameters(), strict=True))
        assert all(a == b for (a, _), (b, _) in pairs), "the plans keep every parameter's name"
        result["grad"].append(max(float((full(p.grad) - q.grad).abs().max()) for (_, p), (_, q) in pairs))
        result["grad_scale"] = max(result["grad_scale"], *(float(q.grad.abs().max()) for _, (_, q) in pairs))
        for optimizer in optimizers:
            optimizer.step()
    state, want_state = model.state_dict(), reference.state_dict()
    assert state.keys() == want_state.keys()
    result["weights"] = max(
        float((comparable(k, full(state[k])) - comparable(k, want_state[k])).abs().max()) for k in want_state
    )
    result["names"] = sorted(state)
    result["sharded"] = sorted(
        k for k, v in state.items() if isinstance(v, DTensor) and not v.placements[-1].is_replicate()
    )
    return result


def main() -> None:
    """argv: the output path, then the data-parallel and tensor-parallel sizes (their product: the processes)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    shape = (int(sys.argv[2]), int(sys.argv[3]))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("data_parallel", "tensor_parallel"))
    results = [run_case(name, overrides, mesh) for name, overrides in CASES.items()]
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
