"""One rank of the pipeline-parallel equality checks; ``tests/test_pipeline.py`` launches it with torchrun on a
``(data_parallel, pipeline_parallel)`` mesh.

For each case and schedule every rank builds the same model, keeps its stages (two under interleaved 1F1B; FSDP2 over
the data-parallel dimension, as the LightningModule does, also on one replica), and trains it beside a single-process
copy of the whole model, which sees every replica's batches, for a few AdamW steps of two accumulated batches each. Each
step records the largest absolute difference of the loss and of every gradient the rank holds (gathered to its full
shape), after the tied embedding's gradients are summed across stages and the gradients clipped by their global norm;
after the last step, of the weights. Rank 0 gathers every rank's figures and writes them as JSON lines to the path in
argv[1].
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.helpers import comparable, full  # the launching test puts the checkout on PYTHONPATH
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.parallel import Pipeline, PipelineConfig, apply_fully_shard_stages, apply_pipeline_parallel
from torch_handle.pretrained.t5 import FIXED as T5

BASE = {
    "src_vocab_size": 48,
    "tgt_vocab_size": 48,
    "d_model": 16,
    "num_heads": 4,
    "num_encoder_layers": 2,
    "num_decoder_layers": 3,
    "d_ff": 32,
    "dropout": 0.0,
    "max_len": 64,
}
STEPS = 3
CLIP = 0.5  # below the gradients' norm: clipping acts, so the global norm must be right
# name -> config overrides
CASES = {
    "post-ln-sinusoidal": {"norm_first": False, "position": "sinusoidal"},
    "pre-ln-tied-alibi-local": {"norm_first": True, "tie_embeddings": True, "position": "alibi",
                                "encoder_attention": "local", "window": 3},
    "pre-ln-rope-pool4": {"norm_first": True, "position": "rope", "cross_downsample": 4},
    # BART's layout: learned positions after an offset, the embeddings' LayerNorm on the first stage, an output bias
    "post-ln-learned-tied-untied-vocab-bart": {"norm_first": False, "position": "learned", "tie_embeddings": True,
                                               "src_vocab_size": 40, "position_offset": 2, "layernorm_embedding": True,
                                               "final_norm": False, "final_logits_bias": True},
    # LED: local windows plus a global first token whose queries, keys and values come from projections of their own
    # (split by heads as the others), BART's learned positions after an offset
    "led": {"norm_first": False, "position": "learned", "position_offset": 2, "encoder_attention": "longformer",
            "window": 4, "global_tokens": 1, "activation": "gelu"},
    # T5 v1.1: relative-bias tables split by heads, RMSNorm, no biases, a gated feed-forward, heads wider than
    # d_model / num_heads, and few buckets over a short distance, so the logarithmic buckets are used too
    "t5-v1.1": {**T5, "activation": "gelu_tanh", "gated_ff": True, "attention_head_dim": 8, "relative_buckets": 8,
                "relative_max_distance": 12},
}  # fmt: skip
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}
MICROBATCHES = 4
ACCUMULATE = 2  # batches per optimizer step, each one schedule step


def batch(config: TransformerConfig, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of ``step``: five rows (filler rows even them up to the micro-batches), padded in the source and
    the target."""
    generator = torch.Generator().manual_seed(100 * step + index)
    src = torch.randint(3, config.src_vocab_size, (5, 13), generator=generator)
    src[1, 9:] = config.pad_id
    src[2, 4:] = config.pad_id
    tgt = torch.randint(3, config.tgt_vocab_size, (5, 8), generator=generator)
    tgt[:, 0] = config.bos_id
    tgt[0, 5:] = config.pad_id
    tgt[3, 2:] = config.pad_id
    return src, tgt


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Label-smoothed cross entropy summed over the non-padding targets."""
    flat = logits.flatten(0, 1)
    return F.cross_entropy(flat, labels.flatten(), ignore_index=pad_id, label_smoothing=0.1, reduction="sum")


def run_case(name: str, overrides: dict, schedule: str, mesh: DeviceMesh) -> dict:
    config = TransformerConfig(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = Transformer(config).train()
    if config.final_logits_bias:  # a fresh model's are zeros
        model.logits_bias.normal_()
    reference = copy.deepcopy(model)
    dp, pp = mesh["data_parallel"], mesh["pipeline_parallel"]
    pipeline_config = PipelineConfig(schedule, MICROBATCHES, STAGES_PER_RANK[schedule])
    stages = apply_pipeline_parallel(model, pp, pipeline_config)
    apply_fully_shard_stages(stages, dp)  # as the LightningModule does, on one replica too
    pipeline = Pipeline(stages, pp, pipeline_config)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    result: dict = {"case": f"{name}/{schedule}", "stages": [s.plan.index for s in stages], "loss": [], "grad": []}
    result["grad_scale"] = 0.0
    for step in range(STEPS):
        for optimizer in optimizers:
            optimizer.zero_grad()
        # (replica, batch) for every replica's ACCUMULATE batches of this step
        batches = {(r, a): batch(config, step, ACCUMULATE * r + a) for r in range(dp.size()) for a in range(ACCUMULATE)}
        tokens = sum(int((tgt[:, 1:] != config.pad_id).sum()) for _, tgt in batches.values())
        sums: list[torch.Tensor] = []

        def loss_fn(
            logits: torch.Tensor, labels: torch.Tensor, sums: list = sums, tokens: int = tokens
        ) -> torch.Tensor:
            total = loss_sum(logits, labels, config.pad_id)
            sums.append(total.detach())
            return total * dp.size() / tokens  # FSDP2 averages over the replicas

        for a in range(ACCUMULATE):  # gradients accumulate over the schedule's steps
            src, tgt = batches[dp.get_local_rank(), a]
            pipeline.step(src, tgt[:, :-1], tgt[:, 1:], loss_fn)
        pipeline.sync_tied_grads()
        pipeline.clip_grad_norm_(CLIP)
        want = sum(loss_sum(reference(s, t[:, :-1]), t[:, 1:], config.pad_id) for s, t in batches.values()) / tokens
        want.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        got = pipeline.from_last_stage(torch.stack(sums).sum() if sums else torch.zeros(()))
        dist.all_reduce(got, group=dp.get_group())
        result["loss"].append(abs(float(got) / tokens - float(want.detach())))
        reference_params = dict(reference.named_parameters())
        differences = []
        for key, param in model.named_parameters():
            differences.append(float((full(param.grad) - reference_params[key].grad).abs().max()))
            result["grad_scale"] = max(result["grad_scale"], float(reference_params[key].grad.abs().max()))
        result["grad"].append(max(differences))
        for optimizer in optimizers:
            optimizer.step()
    want_state = reference.state_dict()
    state = model.state_dict()
    result["weights"] = max(
        float((comparable(k, full(v)) - comparable(k, want_state[k])).abs().max()) for k, v in state.items()
    )
    result["names"] = sorted(state)
    return result


def main() -> None:
    """argv: the output path, then the data-parallel and pipeline-parallel sizes (their product: the processes)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    shape = (int(sys.argv[2]), int(sys.argv[3]))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("data_parallel", "pipeline_parallel"))
    results = [run_case(n, o, s, mesh) for n, o in CASES.items() for s in SCHEDULES]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for rank in gathered for r in rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
