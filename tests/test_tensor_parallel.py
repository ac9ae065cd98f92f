"""Tensor parallelism (``torch_handle.parallel.tensor``) on two CPU processes against one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import (
    assert_weights_close,
    check,
    checkpoint_weights,
    cli,
    csv_logger,
    fit_args,
    logged,
    pretrained_folder,
    torchrun_results,
)
from tests.tensor_parallel_worker import CASES, STEPS
from torch_handle.errors import SetupError
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.parallel import apply_tensor_parallel
from torch_handle.strategies import ModelParallelStrategy

TOLERANCE = 1e-5  # fp32, absolute: loss, every gradient and the weights after the steps, against one process


MESHES = {"tp2": (1, 2), "fsdp2": (2, 1), "fsdp2-tp2": (2, 2)}  # (data_parallel, tensor_parallel); 2-D: 4 processes


@pytest.fixture(scope="module", params=list(MESHES))
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case trained on one mesh, by ``dp x tp`` processes (torchrun, gloo)."""
    dp, tp = MESHES[request.param]
    out = tmp_path_factory.mktemp(request.param) / "results.jsonl"
    results = torchrun_results("tensor_parallel_worker.py", dp * tp, out, str(dp), str(tp))
    return {"mesh": request.param, **{r["case"]: r for r in results}}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_ranks_train_as_one_process(case: str, results: dict[str, dict]) -> None:
    """Post-LN and pre-LN, tied and untied embeddings, every position type, full and local attention, padding in
    source and target, pooled memory, activation checkpointing: equal losses, gradients and weights, step by step,
    under tensor parallelism, FSDP2 and both."""
    r = results[case]
    assert len(r["loss"]) == len(r["grad"]) == STEPS
    assert max(r["loss"]) <= TOLERANCE
    assert max(r["grad"]) <= TOLERANCE < r["grad_scale"]  # gradients that exist, equal
    assert r["weights"] <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
def test_the_heads_feed_forward_and_vocabulary_are_split_the_rest_replicated(results: dict[str, dict]) -> None:
    """What tensor parallelism splits; FSDP2 alone shards every parameter on its dimension."""
    sharded = results["pre-ln-tied-alibi-local"]["sharded"]
    if MESHES[results["mesh"]][1] == 1:
        assert len(sharded) == len(results["pre-ln-tied-alibi-local"]["names"])
        return
    tables = {"src_embed.weight", "tgt_embed.weight", "lm_head.weight"}  # split by vocabulary rows
    assert tables <= set(sharded)
    sharded = [name for name in sharded if name not in tables]
    per_layer = {name.split(".", 2)[2] for name in sharded}
    assert per_layer == {
        "self_attn.in_proj.weight", "self_attn.out_proj.weight",
        "cross_attn.in_proj.weight", "cross_attn.out_proj.weight",
        "ff.linear1.weight", "ff.linear1.bias", "ff.linear2.weight",
    }  # fmt: skip
    assert len(sharded) == 2 * 5 + 2 * 7  # 2 encoder layers (5 each), 2 decoder layers (7 each)
    led = {name.split(".", 2)[2] for name in results["led"]["sharded"] if name.startswith("encoder_layers.")}
    assert "self_attn.global_proj.weight" in led  # LED's global tokens' heads, split as the others


def test_heads_that_do_not_divide_are_one_line() -> None:
    model = Transformer(TransformerConfig(d_model=12, num_heads=3, d_ff=8, num_encoder_layers=1))

    class Mesh:
        def size(self) -> int:
            return 2

    with pytest.raises(SetupError) as err:
        apply_tensor_parallel(model, Mesh())  # type: ignore[arg-type]  # refused before the mesh is used
    assert str(err.value) == (
        "tensor_parallel_size=2 must divide transformer.num_heads (3) and transformer.d_ff (8): "
        "choose a tensor_parallel_size that divides both"
    )


# --- through the CLI: configs/tp.yaml stacked on the demo config, two processes --------------------------------------


def _tp_args(root: Path, devices: int, *extra: str) -> list[str]:
    """Four steps of ``fit --config configs/demo.yaml --config configs/tp.yaml`` with the tiny model."""
    return fit_args(
        root,
        "--config", "configs/tp.yaml",
        "--trainer.accelerator", "cpu",
        "--trainer.devices", str(devices),
        "--trainer.max_steps", "4",
        "--checkpoint.every_n_train_steps", "2",
        "--checkpoint.save_top_k", "-1",
        *extra,
    )  # fmt: skip


CHECKPOINTS = {"sharded": [], "one file": ["--trainer.strategy.init_args.save_distributed_checkpoint", "false"]}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def tp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The shipped tensor-parallel config on two processes, dropout on (0.1), a checkpoint every 2 steps: a folder of
    one shard per process (the config's), or one file gathered on rank 0."""
    root, extra = tmp_path_factory.mktemp("tp-run"), CHECKPOINTS[request.param]
    check(cli(_tp_args(root, 2, "--model.transformer.dropout", "0.1", *extra)))
    assert (root / "checkpoints" / "last.ckpt").is_dir() == (request.param == "sharded")
    return root, extra


@pytest.mark.slow
@pytest.mark.distributed
def test_two_tensor_parallel_processes_train_as_one(tmp_path: Path) -> None:
    """Started from a tiny Hugging Face LED folder (BART's layers, sliding windows, a global first token with
    projections of its own), without dropout, 4 steps on 2 processes that split every layer end with one process's
    weights; throughput counts each batch once."""
    led = ("--model.init_from", str(pretrained_folder("led")), "--data.init_args.max_source_tokens", "60")
    check(cli(_tp_args(tmp_path / "one", 1, *led, *csv_logger(tmp_path / "one"))))
    check(cli(_tp_args(tmp_path / "two", 2, *led, *csv_logger(tmp_path / "two"))))
    for count in ("train/samples", "train/lengths"):  # both processes compute one batch: globally, it counts once
        assert logged(tmp_path / "two", count) == logged(tmp_path / "one", count), count
    want, got = checkpoint_weights(tmp_path / "one"), checkpoint_weights(tmp_path / "two")
    assert_weights_close(want, got)
    step2 = checkpoint_weights(tmp_path / "one", "epoch=0-step=2.ckpt")
    assert any(not torch.equal(got[name], w) for name, w in step2.items())
    # The two processes' sharded checkpoint of step 2 continues on one process (weights and AdamW moments by heads
    # into whole tensors) and ends there too.
    checkpoint = tmp_path / "two" / "checkpoints" / "epoch=0-step=2.ckpt"
    continued = _tp_args(tmp_path / "continued", 1, "--ckpt_path", str(checkpoint), *led[2:])  # the model inside
    check(cli(continued))
    assert_weights_close(want, checkpoint_weights(tmp_path / "continued"))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_across_tensor_parallel_pairs_trains_as_one_process(tmp_path: Path) -> None:
    """configs/fsdp2_tp.yaml, 2 x 2 processes: each pair of tensor-parallel processes takes one batch of a step, as
    one process accumulating both batches does."""
    one = ("--trainer.accumulate_grad_batches", "2")
    check(cli(_tp_args(tmp_path / "one", 1, *one)))
    check(cli(_tp_args(tmp_path / "four", 4, "--config", "configs/fsdp2_tp.yaml")))
    assert_weights_close(checkpoint_weights(tmp_path / "one"), checkpoint_weights(tmp_path / "four"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tensor_parallel_run_resumes_exactly(tp_run: tuple[Path, list[str]], tmp_path: Path) -> None:
    """Resumed from step 2 (weights and AdamW state split back by heads, every rank's random state restored), it
    ends bit for bit as the uninterrupted run."""
    root, extra = tp_run
    checkpoint = root / "checkpoints" / "epoch=0-step=2.ckpt"
    check(cli(_tp_args(tmp_path, 2, "--model.transformer.dropout", "0.1", "--ckpt_path", str(checkpoint), *extra)))
    want, got = checkpoint_weights(root), checkpoint_weights(tmp_path)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_a_mesh_that_does_not_multiply_out_is_one_line(tmp_path: Path) -> None:
    run = cli(_tp_args(tmp_path, 2, "--trainer.strategy.init_args.data_parallel_size", "2"))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
        "error: data_parallel_size=2 x pipeline_parallel_size=1 x tensor_parallel_size=2 must equal the 2 processes "
        "(trainer.devices x trainer.num_nodes): set --trainer.strategy.init_args.data_parallel_size, "
        "pipeline_parallel_size and tensor_parallel_size to multiply out, or 'auto'"
    )
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_heads_that_do_not_divide_are_one_line_before_the_run_folder(tmp_path: Path) -> None:
    """Checked before the command starts any process: one line, printed once, and nothing written."""
    run = cli(_tp_args(tmp_path, 2, "--model.transformer.num_heads", "1"))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
        "error: tensor_parallel_size=2 must divide transformer.num_heads (1) and transformer.d_ff (64): "
        "choose a tensor_parallel_size that divides both"
    )
    assert run.stderr.count("error:") == 1 and not any(tmp_path.iterdir())  # no process started, nothing written


@pytest.mark.parametrize(
    ("sizes", "devices", "nodes", "mesh"),
    [
        ({"tensor_parallel_size": 1}, 2, 1, (2, 1, 1)),  # FSDP2 alone (docs/parallelism.md): data parallel over all
        ({}, 4, 2, (2, 1, 4)),  # Lightning's default: tensor parallel within a node, FSDP2 across nodes
        ({"pipeline_parallel_size": 2}, 4, 1, (2, 2, 1)),
    ],
    ids=["fsdp2", "default", "pipeline"],
)
def test_an_auto_data_parallel_size_takes_the_processes_the_others_leave(
    sizes: dict[str, int], devices: int, nodes: int, mesh: tuple[int, int, int]
) -> None:
    strategy = ModelParallelStrategy(**sizes)
    strategy.parallel_devices, strategy.num_nodes = [torch.device("cpu")] * devices, nodes
    assert strategy.mesh_sizes(fitting=True) == mesh
