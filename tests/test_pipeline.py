"""Pipeline parallelism (``torch_handle.parallel.pipeline``) on two and four CPU processes against one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from tests.pipeline_worker import BASE, CASES, SCHEDULES, STAGES_PER_RANK, STEPS
from torch_handle.errors import SetupError
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.parallel import PipelineConfig, apply_pipeline_parallel
from torch_handle.parallel.pipeline import plan_stages

TOLERANCE = 1e-5  # fp32, absolute: loss, every gradient and the weights after the steps, against one process

MESHES = {"pp2": (1, 2), "fsdp2-pp2": (2, 2)}  # (data_parallel, pipeline_parallel); the 2-D one: 4 processes


@pytest.fixture(scope="module", params=list(MESHES))
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case and schedule trained on one mesh, by ``dp x pp`` processes (torchrun, gloo): ``case/schedule`` ->
    one result per rank, and ``mesh`` -> the mesh's sizes."""
    dp, pp = MESHES[request.param]
    out = tmp_path_factory.mktemp(request.param) / "results.jsonl"
    by_case: dict[str, Any] = {"mesh": (dp, pp)}
    for r in torchrun_results("pipeline_worker.py", dp * pp, out, str(dp), str(pp)):
        by_case.setdefault(r["case"], []).append(r)
    return by_case


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_stages_train_as_one_process(case: str, schedule: str, results: dict[str, Any]) -> None:
    """Post-LN and pre-LN, tied embeddings (a copy on the first stage and the last), every position type, local
    attention, pooled memory carried to the decoder stage, padding in source and target, rows that do not divide
    into the micro-batches, clipping by the global norm: equal losses, gradients and weights, step by step, for GPipe,
    1F1B and interleaved 1F1B (two stages per process), alone and under FSDP2."""
    dp, pp = results["mesh"]
    ranks = results[f"{case}/{schedule}"]
    stages = pp * STAGES_PER_RANK[schedule]
    assert sorted(i for r in ranks for i in r["stages"]) == sorted(list(range(stages)) * dp)
    for r in ranks:
        assert len(r["loss"]) == len(r["grad"]) == STEPS
        assert max(r["loss"]) <= TOLERANCE
        assert max(r["grad"]) <= TOLERANCE < r["grad_scale"]  # gradients that exist, equal
        assert r["weights"] <= TOLERANCE
    names = [set(r["names"]) for r in ranks]
    whole = set(Transformer(TransformerConfig(**{**BASE, **CASES[case]})).state_dict())
    assert set.union(*names) == whole and all(n < whole for n in names)  # each stage holds part, under its own name


def test_stages_cut_encoder_then_decoder_layers_evenly() -> None:
    plans = plan_stages(num_encoder_layers=2, num_decoder_layers=3, stages=2)
    assert [(p.encoder, p.decoder) for p in plans] == [(range(0, 2), range(0, 1)), (range(2, 2), range(1, 3))]
    assert [(p.finishes_encoder, p.receives_memory, p.sends_memory) for p in plans] == [
        (True, False, True),
        (False, True, True),
    ]
    plans = plan_stages(num_encoder_layers=6, num_decoder_layers=6, stages=4)
    assert [(p.encoder, p.decoder) for p in plans] == [
        (range(0, 3), range(0, 0)),
        (range(3, 6), range(0, 0)),
        (range(6, 6), range(0, 3)),
        (range(6, 6), range(3, 6)),
    ]
    assert [p.receives_memory for p in plans] == [False, False, True, True]


class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("processes", "config", "line"),
    [
        (5, PipelineConfig(microbatches=5), "pipeline_parallel_size=5 x stages_per_rank=1 stages exceed the 4 encoder "
         "and decoder layers: every stage needs one; choose fewer stages"),
        (2, PipelineConfig("interleaved_1f1b", 4, 3), "pipeline_parallel_size=2 x stages_per_rank=3 stages exceed the "
         "4 encoder and decoder layers: every stage needs one; choose fewer stages"),
        (2, PipelineConfig(microbatches=1), "microbatches=1 cannot keep the 2 pipeline processes busy: set "
         "--trainer.strategy.init_args.microbatches to at least pipeline_parallel_size"),
        (2, PipelineConfig("interleaved_1f1b", 3, 2), "microbatches=3 cannot keep the 2 pipeline processes busy: "
         "set --trainer.strategy.init_args.microbatches to a multiple of pipeline_parallel_size"),
        (2, PipelineConfig("interleaved_1f1b"), "pipeline_schedule=interleaved_1f1b with stages_per_rank=1: "
         "interleaved_1f1b runs several stages per process and the other schedules one; set "
         "--trainer.strategy.init_args.stages_per_rank 2 (or more) with interleaved_1f1b, 1 otherwise"),
        (2, PipelineConfig("1f1b", 4, 2), "pipeline_schedule=1f1b with stages_per_rank=2: interleaved_1f1b runs "
         "several stages per process and the other schedules one; set --trainer.strategy.init_args.stages_per_rank "
         "2 (or more) with interleaved_1f1b, 1 otherwise"),
    ],
    ids=["more-stages-than-layers", "more-virtual-stages-than-layers", "fewer-microbatches-than-processes",
         "microbatches-not-a-multiple-under-interleaving", "interleaving-one-stage", "several-stages-not-interleaved"],
)  # fmt: skip
def test_a_pipeline_that_cannot_fill_its_stages_is_one_line(processes: int, config: PipelineConfig, line: str) -> None:
    model = Transformer(TransformerConfig(d_model=16, num_heads=2, d_ff=8, num_encoder_layers=2, num_decoder_layers=2))
    with pytest.raises(SetupError) as err:
        apply_pipeline_parallel(model, _Mesh(processes), config)  # type: ignore[arg-type]
    assert str(err.value) == line


# --- through the CLI: configs/pp.yaml stacked on the demo config -----------------------------------------------------


def _pp_args(root: Path, devices: int, *extra: str) -> list[str]:
    """Four steps of ``fit --config configs/demo.yaml --config configs/pp.yaml`` with the tiny model (one encoder
    layer on the first stage, one decoder layer on the second)."""
    return fit_args(
        root,
        "--config", "configs/pp.yaml",
        "--trainer.accelerator", "cpu",
        "--trainer.devices", str(devices),
        "--trainer.max_steps", "4",
        "--checkpoint.every_n_train_steps", "2",
        "--checkpoint.save_top_k", "-1",
        *extra,
    )  # fmt: skip


ONE_STAGE = ("--trainer.strategy.init_args.pipeline_parallel_size", "1")


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped pipeline config on two processes, dropout on (0.1), a sharded checkpoint every 2 steps."""
    root = tmp_path_factory.mktemp("pp-run")
    check(cli(_pp_args(root, 2, "--model.transformer.dropout", "0.1")))
    return root


@pytest.mark.slow
@pytest.mark.distributed
def test_two_pipeline_stages_train_as_one_process(tmp_path: Path) -> None:
    """Without dropout, 4 steps of 2 accumulated batches on 2 stages end with one process's weights: the schedule's
    backward passes, the accumulation and the tied embedding's summed gradients are Lightning's step. The stages'
    step-2 shards, keyed by parameter name, also continue on one process holding the whole model, to the same end;
    throughput counts each batch once. The model starts from a tiny Hugging Face LED folder (BART's layers and tied
    embeddings, sliding windows, a global first token with projections of its own)."""
    accumulate = ("--trainer.accumulate_grad_batches", "2", "--data.init_args.max_source_tokens", "60")
    led = ("--model.init_from", str(pretrained_folder("led")))
    check(cli(_pp_args(tmp_path / "one", 1, *ONE_STAGE, *accumulate, *led, *csv_logger(tmp_path / "one"))))
    check(cli(_pp_args(tmp_path / "two", 2, *accumulate, *led, *csv_logger(tmp_path / "two"))))
    for count in ("train/samples", "train/lengths"):  # both stages compute one batch: globally, it counts once
        assert logged(tmp_path / "two", count) == logged(tmp_path / "one", count), count
    shards = tmp_path / "two" / "checkpoints" / "epoch=0-step=2.ckpt"
    check(cli(_pp_args(tmp_path / "resumed", 1, *ONE_STAGE, *accumulate, "--ckpt_path", str(shards))))
    want = checkpoint_weights(tmp_path / "one")
    for run in ("two", "resumed"):
        assert_weights_close(want, checkpoint_weights(tmp_path / run), run)
    step2 = checkpoint_weights(tmp_path / "one", "epoch=0-step=2.ckpt")
    assert any(not torch.equal(want[name], w) for name, w in step2.items())


INTERLEAVED = (
    "--trainer.strategy.init_args.pipeline_schedule", "interleaved_1f1b",
    "--trainer.strategy.init_args.stages_per_rank", "2",
    "--model.transformer.num_encoder_layers", "2",
    "--model.transformer.num_decoder_layers", "2",
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_interleaved_stages_train_as_one_process(tmp_path: Path) -> None:
    """Two stages on each of two processes (encoder layers 0 and 1 on stages 0 and 1, decoder layers on 2 and 3;
    process 0 holds stages 0 and 2): 4 steps end with one process's weights, and the step-2 shards continue on one
    process to the same end."""
    check(cli(_pp_args(tmp_path / "one", 1, *ONE_STAGE, *INTERLEAVED[4:])))
    check(cli(_pp_args(tmp_path / "two", 2, *INTERLEAVED)))
    shards = tmp_path / "two" / "checkpoints" / "epoch=0-step=2.ckpt"
    check(cli(_pp_args(tmp_path / "resumed", 1, *ONE_STAGE, *INTERLEAVED[4:], "--ckpt_path", str(shards))))
    want = checkpoint_weights(tmp_path / "one")
    for run in ("two", "resumed"):
        assert_weights_close(want, checkpoint_weights(tmp_path / run), run)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_pipeline_run_resumes_exactly(pp_run: Path, tmp_path: Path) -> None:
    """Resumed from the step-2 shards (each stage reads its weights and AdamW state by name, every rank's random
    state restored), it ends bit for bit as the uninterrupted run."""
    checkpoint = pp_run / "checkpoints" / "epoch=0-step=2.ckpt"
    assert checkpoint.is_dir()  # one shard per stage
    check(cli(_pp_args(tmp_path, 2, "--model.transformer.dropout", "0.1", "--ckpt_path", str(checkpoint))))
    want, got = checkpoint_weights(pp_run), checkpoint_weights(tmp_path)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
def test_stages_that_do_not_divide_the_processes_are_one_line(tmp_path: Path) -> None:
    run = cli(_pp_args(tmp_path, 3))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
        "error: pipeline_parallel_size=2 must divide the 3 processes (trainer.devices x trainer.num_nodes): choose a "
        "pipeline_parallel_size that divides them"
    )
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_interleaving_one_stage_per_process_is_one_line_before_the_run_folder(tmp_path: Path) -> None:
    run = cli(_pp_args(tmp_path, 2, *INTERLEAVED[:2]))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
        "error: pipeline_schedule=interleaved_1f1b with stages_per_rank=1: interleaved_1f1b runs several stages per "
        "process and the other schedules one; set --trainer.strategy.init_args.stages_per_rank 2 (or more) with "
        "interleaved_1f1b, 1 otherwise"
    )
    assert run.stderr.count("error:") == 1 and not any(tmp_path.iterdir())  # no process started, nothing written


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_stages_split_by_tensor_parallelism_train_as_one_process(tmp_path: Path) -> None:
    """2 stages x 2 tensor-parallel ranks (4 processes, one batch a step): 4 steps end with one process's weights,
    the batch counts once, not once per process, and the step-2 shards (split by stage and by heads) continue on one
    process to the same end. The model starts from a tiny Hugging Face T5 folder: its relative-bias tables, split by
    heads on the first stage, give the biases that the second stage receives."""
    tp = ("--trainer.strategy.init_args.tensor_parallel_size", "2")
    t5 = ("--model.init_from", str(pretrained_folder("t5")))
    check(cli(_pp_args(tmp_path / "one", 1, *ONE_STAGE, *t5, *csv_logger(tmp_path / "one"))))
    check(cli(_pp_args(tmp_path / "four", 4, *tp, *t5, *csv_logger(tmp_path / "four"))))
    for count in ("train/samples", "train/lengths"):
        assert logged(tmp_path / "four", count) == logged(tmp_path / "one", count), count
    shards = tmp_path / "four" / "checkpoints" / "epoch=0-step=2.ckpt"
    check(cli(_pp_args(tmp_path / "continued", 1, *ONE_STAGE, "--ckpt_path", str(shards))))  # architecture inside
    want = checkpoint_weights(tmp_path / "one")
    for run in ("four", "continued"):
        assert_weights_close(want, checkpoint_weights(tmp_path / run), run)


@pytest.mark.slow
def test_decoding_in_validation_under_a_pipeline_is_one_line(tmp_path: Path) -> None:
    """Beam search is one sequential loop per batch: refused before training, not after the first epoch."""
    run = cli(_pp_args(tmp_path, 2, "--model.generate_every_n_val_epochs", "1"))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
        "error: --model.generate_every_n_val_epochs=1: a pipeline cannot run beam search (test and predict decode "
        "with every process as a replica): set --model.generate_every_n_val_epochs 0"
    )
    assert run.stderr.count("error:") == 1 and not any(tmp_path.iterdir())  # no process started, nothing written


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_across_pipelines_trains_as_one_process(tmp_path: Path) -> None:
    """``--trainer.devices 4`` with 2 stages: two pipelines, each stage sharded by FSDP2 across them, each pipeline
    taking one batch of a step, as one process accumulating both batches does."""
    check(cli(_pp_args(tmp_path / "one", 1, *ONE_STAGE, "--trainer.accumulate_grad_batches", "2")))
    check(cli(_pp_args(tmp_path / "four", 4)))
    assert_weights_close(checkpoint_weights(tmp_path / "one"), checkpoint_weights(tmp_path / "four"))
