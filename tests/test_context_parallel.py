"""Context parallelism of the sliding-window encoder (``torch_handle.parallel.context``) on two CPU processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.context_parallel_worker import CASES
from tests.helpers import ROOT, TINY_MODEL, check, cli, csv_logger, logged, torchrun_results
from torch_handle.errors import SetupError
from torch_handle.export import read_checkpoint
from torch_handle.model import ConfigError, Transformer, TransformerConfig
from torch_handle.parallel import build_mesh, check_context_parallel

SHARED = ROOT.parent / "shared" / "data"
TOLERANCE = 1e-5  # fp32, absolute: encoder output, loss and every gradient against one process


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    results = torchrun_results("context_parallel_worker.py", 2, tmp_path_factory.mktemp("cp") / "results.jsonl")
    return {r["case"]: r for r in results}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(case: str, two_rank_results: dict[str, dict]) -> None:
    """Windows narrower and wider than a slice, lengths that do not divide, padding, every position type,
    pooling 1 and 4, the SDPA, naive and (forward only: no CPU backward) flex kernels."""
    r = two_rank_results[case]
    assert r["memory_shape"] == r["want_shape"]
    assert r["memory"] <= TOLERANCE
    assert r["loss"] <= TOLERANCE
    assert r["grad"] <= TOLERANCE < r["grad_scale"]  # gradients that exist, equal
    if r["flex"] is not None:
        assert r["flex"] <= TOLERANCE


def test_a_mesh_that_does_not_divide_the_processes_is_one_line() -> None:
    with pytest.raises(SetupError) as err:
        build_mesh(3, 2, "cpu")
    assert str(err.value) == (
        "--model.context_parallel=2 does not divide the 3 processes (trainer.devices x trainer.num_nodes): "
        "choose a context_parallel that divides it"
    )


FULL_ATTENTION = (
    "--model.context_parallel=2 splits the sliding-window encoder: set --model.transformer.encoder_attention local, "
    "or --model.context_parallel 1 for full attention"
)


@pytest.mark.slow
def test_full_attention_is_refused_in_one_line(documents: Path, tmp_path: Path) -> None:
    """The same line from the plan (a notebook applying it by hand) and from the CLI, before any process starts."""
    model = Transformer(
        TransformerConfig(d_model=8, num_heads=2, d_ff=8, num_encoder_layers=1, encoder_attention="full")
    )
    with pytest.raises(ConfigError) as err:
        check_context_parallel(model.config, 2)
    assert str(err.value) == FULL_ATTENTION
    assert type(model) is Transformer
    run = cli(_cp_args(tmp_path, documents, 2, "--model.transformer.encoder_attention", "full"))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == f"error: {FULL_ATTENTION}"


@pytest.mark.slow
def test_a_strategy_with_its_own_mesh_is_refused_in_one_line(documents: Path, tmp_path: Path) -> None:
    """ModelParallelStrategy lays out a (data_parallel, tensor_parallel) mesh; context parallelism would be ignored."""
    run = cli(
        [
            *_cp_args(tmp_path, documents, 2),
            "--config",
            "configs/tp.yaml",  # torch_handle.strategies.ModelParallelStrategy
            "--model.context_parallel",
            "2",
        ]  # fmt: skip
    )
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
        "error: --model.context_parallel=2 lays out its own device mesh, but ModelParallelStrategy brings another: "
        "use it with strategy ddp, fsdp or deepspeed, or set --model.context_parallel 1"
    )
    assert run.stderr.count("error:") == 1 and not any(tmp_path.iterdir())  # no process started, nothing written


# --- through the CLI: the shipped config on two processes ------------------------------------------------------


def _cp_args(root: Path, data: Path, devices: int, *extra: str) -> list[str]:
    """``cli.py fit --config configs/summarization_cp.yaml`` with a tiny model on real SQuALITY/QMSum text."""
    return [
        "fit", "--config", "configs/summarization_cp.yaml", *TINY_MODEL,
        "--model.transformer.window", "16",
        "--model.transformer.max_len", "512",
        "--model.context_parallel", str(devices),
        "--model.max_new_tokens", "8",
        "--model.lr", "0.01",
        "--model.warmup_steps", "2",
        "--trainer.accelerator", "cpu",
        "--trainer.devices", str(devices),
        "--trainer.max_steps", "4",
        "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(root),
        "--data.init_args.train_file", str(data / "train.jsonl"),
        "--data.init_args.val_file", str(data / "train.jsonl"),
        "--data.init_args.test_file", str(data / "train.jsonl"),
        "--data.init_args.bpe_vocab_size", "300",
        "--data.init_args.max_source_tokens", "300",
        "--data.init_args.max_target_tokens", "48",
        "--data.init_args.max_tokens", "700",
        "--checkpoint.every_n_train_steps", "2",
        "--checkpoint.monitor", "null",  # no validation: keep every scheduled checkpoint
        "--checkpoint.save_top_k", "-1",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve SQuALITY stories cut to 60-290 words (sources of uneven length, padded in their batches)."""
    if not SHARED.is_dir():
        pytest.skip(f"shared data directory {SHARED} is absent")
    folder = tmp_path_factory.mktemp("cp-data")
    rows = [json.loads(line) for line in (SHARED / "squality" / "train_plot.jsonl").read_text().splitlines()][:12]
    with (folder / "train.jsonl").open("w") as f:
        for i, row in enumerate(rows):
            document = " ".join(row["document"].split()[: 60 + 23 * i])
            f.write(json.dumps({"document": document, "summary": " ".join(row["summary"].split()[:30])}) + "\n")
    return folder


@pytest.fixture(scope="module")
def cp_run(documents: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four steps of the shipped context-parallel config on two processes, dropout on (0.1)."""
    root = tmp_path_factory.mktemp("cp-run")
    check(cli(_cp_args(root, documents, 2)))
    return root


def _weights(root: Path, name: str = "last.ckpt") -> dict[str, torch.Tensor]:
    weights, _, _ = read_checkpoint(root / "checkpoints" / name)
    return weights


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("copying", [False, True], ids=["plain", "copy_attention"])
def test_two_context_parallel_processes_train_as_one(copying: bool, documents: Path, tmp_path: Path) -> None:
    """Without dropout, 4 steps on 2 processes that split every source end with one process's weights; with copy
    attention too, which reads the gathered encoder output."""
    no_dropout = ("--model.transformer.dropout", "0")
    if copying:
        no_dropout += ("--model.transformer.copy_attention", "true", "--model.transformer.cross_downsample", "1")
    check(cli(_cp_args(tmp_path / "one", documents, 1, *no_dropout)))
    check(cli(_cp_args(tmp_path / "two", documents, 2, *no_dropout)))
    want, got = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert got.keys() == want.keys()
    for name in want:
        if name.endswith("in_proj.bias"):
            # The key bias adds the same score to every key of a query: softmax cancels it, so its gradient is
            # rounding noise that AdamW scales up to whole steps, in any two implementations (the decoder's too).
            # Queries' and values' biases must agree.
            d = want[name].shape[0] // 3
            want[name], got[name] = (torch.cat((w[:d], w[2 * d :])) for w in (want[name], got[name]))
        distance = torch.linalg.norm(got[name] - want[name]) / torch.linalg.norm(want[name])
        assert distance <= 1e-5, f"{name}: relative distance {distance:.1e}"
    assert any(not torch.equal(got[name], w) for name, w in _weights(tmp_path / "one", "epoch=0-step=2.ckpt").items())


@pytest.mark.slow
@pytest.mark.distributed
def test_a_context_parallel_run_resumes_exactly(cp_run: Path, documents: Path, tmp_path: Path) -> None:
    """Resumed from step 2 (dropout on: every rank's random state comes back), it ends bit for bit as the run."""
    checkpoint = cp_run / "checkpoints" / "epoch=0-step=2.ckpt"
    check(cli(_cp_args(tmp_path, documents, 2, "--ckpt_path", str(checkpoint))))
    want, got = _weights(cp_run), _weights(tmp_path)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
@pytest.mark.distributed
def test_the_shipped_config_trains_one_document_per_batch(documents: Path, tmp_path: Path) -> None:
    """As summarization_cp.yaml is built to run: every batch one document (its budget is one source's:
    ``max_tokens`` = ``max_source_tokens``), split over the two processes. Throughput counts that document once a step
    (each process reported its half, which Lightning's monitor refused at the first step: 0.5 samples, 1 batch)."""
    one_document = ["--data.init_args.max_tokens", "300"]  # = _cp_args' max_source_tokens; every story is longer
    check(cli(_cp_args(tmp_path, documents, 2, *one_document, *csv_logger(tmp_path))))
    assert logged(tmp_path, "train/samples") == logged(tmp_path, "train/batches") == [1.0, 2.0, 3.0, 4.0]
