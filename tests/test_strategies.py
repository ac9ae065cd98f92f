"""Every strategy on two CPU processes (gloo) against the single-process run; export; failures; two nodes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from tests.helpers import (
    RUN_TIMEOUT,
    SHARES_REFERENCE_RUNS,
    SINGLE,
    STEPS,
    STRATEGY_CONFIGS,
    TINY,
    check,
    cli,
    env,
    fit_args,
    free_port,
    pretrained_args,
    pretrained_folder,
    reference_args,
    reference_run,
    strategy_args,
    train_losses,
)
from tests.one_process import in_this_process
from torch_handle.checkpoints import CheckpointError
from torch_handle.data import TranslationDataModule
from torch_handle.export import export, exported_metadata, load_exported, read_checkpoint
from torch_handle.export.__main__ import main
from torch_handle.model import Transformer, TransformerConfig, generate
from torch_handle.parallel import set_zero3_units

LOSS_TOLERANCE = 1e-4  # absolute, per batch, over 6 steps (12 batches)
# Relative Frobenius distance per tensor after 6 steps: every strategy reproduces the single-process weights
# (g0/2 + g1/2 is exact). FSDP once needed 1e-2 here: it hands configure_optimizers flattened 1-D views, and
# choosing the weight-decay group by dim() left it without weight decay.
EXACT = 1e-6


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", list(STRATEGY_CONFIGS))
@SHARES_REFERENCE_RUNS
def test_loss_curve_and_weights_match_single_process(strategy: str, base: Path) -> None:
    expected = train_losses(reference_run(SINGLE, base))
    actual = train_losses(reference_run(strategy, base))
    assert list(actual) == list(expected) == list(range(2 * STEPS))  # two batches per step
    for index, loss in expected.items():
        assert actual[index] == pytest.approx(loss, abs=LOSS_TOLERANCE), f"batch {index}"
    want, _, _ = read_checkpoint(reference_run(SINGLE, base) / "checkpoints" / "last.ckpt")
    got, _, _ = read_checkpoint(reference_run(strategy, base) / "checkpoints" / "last.ckpt")
    assert got.keys() == want.keys()
    for name in want:
        distance = torch.linalg.norm(got[name] - want[name]) / torch.linalg.norm(want[name])
        assert distance <= EXACT, f"{name}: relative distance {distance:.1e} over {EXACT:.0e}"


COPYING = ["--model.transformer.copy_attention", "true"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
def test_copy_attention_trains_on_two_processes_as_on_one(strategy: str, base: Path, tmp_path: Path) -> None:
    """The tiny T5 folder gains a fresh copy head (``--model.transformer.copy_attention``), which every strategy that
    trains it must train as one process does: every batch's loss and the last weights, the copy head's included."""
    single = base / "copying-single"
    if not (single / "checkpoints" / "last.ckpt").exists():  # one reference for the three strategies
        in_this_process(reference_args(SINGLE, single, *COPYING), single)
    check(cli(reference_args(strategy, tmp_path, *COPYING)))
    expected, actual = train_losses(single), train_losses(tmp_path)
    assert list(actual) == list(expected) == list(range(2 * STEPS))
    for index, loss in expected.items():
        assert actual[index] == pytest.approx(loss, abs=LOSS_TOLERANCE), f"batch {index}"
    want, _, _ = read_checkpoint(single / "checkpoints" / "last.ckpt")
    got, _, _ = read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert got.keys() == want.keys() and any("copy.query" in name for name in want)
    for name in want:
        if not want[name].any():
            assert torch.equal(got[name], want[name]), name
            continue
        distance = torch.linalg.norm(got[name] - want[name]) / torch.linalg.norm(want[name])
        assert distance <= EXACT, f"{name}: relative distance {distance:.1e} over {EXACT:.0e}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_an_imported_led_trains_on_two_processes_as_on_one(strategy: str, tmp_path: Path) -> None:
    """LED (sliding windows, a global first token with projections of its own) fine-tuned on 2 processes: the loss of
    every batch and the last weights equal one process's, as for the other families (the T5 reference runs)."""
    led = ["--model.init_from", str(pretrained_folder("led")), "--data.init_args.max_tokens", "256"]
    led += ["--data.init_args.max_source_tokens", "60"]  # the folder's 64 positions hold every source
    runs = {name: tmp_path / name for name in (SINGLE, strategy)}
    in_this_process(reference_args(SINGLE, runs[SINGLE], *led, pretrained=False), runs[SINGLE])  # no launch
    check(cli(reference_args(strategy, runs[strategy], *led, pretrained=False)))
    expected, actual = (train_losses(root) for root in runs.values())
    assert list(actual) == list(expected) == list(range(2 * STEPS))
    for index, loss in expected.items():
        assert actual[index] == pytest.approx(loss, abs=LOSS_TOLERANCE), f"batch {index}"
    want, _, _ = read_checkpoint(runs[SINGLE] / "checkpoints" / "last.ckpt")
    got, _, _ = read_checkpoint(runs[strategy] / "checkpoints" / "last.ckpt")
    assert got.keys() == want.keys() and any("global_proj" in name for name in want)
    for name in want:
        if not want[name].any():  # LED's logits bias is zero and not trained
            assert torch.equal(got[name], want[name]), name
            continue
        distance = torch.linalg.norm(got[name] - want[name]) / torch.linalg.norm(want[name])
        assert distance <= EXACT, f"{name}: relative distance {distance:.1e} over {EXACT:.0e}"


@pytest.mark.slow
@pytest.mark.distributed
@SHARES_REFERENCE_RUNS
def test_zero3_export_predicts_as_the_gathered_checkpoint(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = reference_run("zero3", base) / "checkpoints" / "last.ckpt"
    exported = export(checkpoint, tmp_path / "model.safetensors")
    sources = tmp_path / "input.txt"
    sources.write_text("one two three\nfour five six seven\neight\n")
    args = [
        "predict",
        "--ckpt_path", str(exported),
        "--data.init_args.predict_file", str(sources),
        "--trainer.accelerator", "cpu",
        "--trainer.devices", "1",
        "--trainer.enable_progress_bar", "false",
        "--model.num_beams", "2",
        "--model.max_new_tokens", "8",
    ]  # fmt: skip
    capsys.readouterr()
    in_this_process(args, tmp_path / "predict")  # one process of the default strategy: no launch
    (written,) = capsys.readouterr().out.splitlines()[-1:]  # predict prints the path of the file it wrote
    predicted = Path(written).read_text().splitlines()

    # The same decoding, in this process, from the ZeRO-3 shards gathered by DeepSpeed itself.
    model, tokenizer = load_exported(exported)
    weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    missing, unexpected = model.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()}, strict=False)
    assert not unexpected and set(missing) <= {"src_embed.weight"}  # DeepSpeed keeps T5's shared table under one name
    tokenizer.save(tmp_path / "tokenizer.json")
    data = TranslationDataModule(tokenizer_path=str(tmp_path / "tokenizer.json"), predict_file=str(sources))
    data.setup("predict")
    by_source = {
        source: text
        for batch in data.predict_dataloader()  # batched by length: predict writes in the file's order
        for source, text in zip(
            batch["src_text"], tokenizer.decode_batch(generate(model, batch["src"], 8, 2, 1.0).tolist()), strict=True
        )
    }
    assert predicted == [by_source[line] for line in sources.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
@SHARES_REFERENCE_RUNS
def test_export_of_every_layout_holds_the_trained_weights(strategy: str, base: Path, tmp_path: Path) -> None:
    checkpoint = reference_run(strategy, base) / "checkpoints" / "last.ckpt"
    model, tokenizer = load_exported(export(checkpoint, tmp_path / "model.safetensors"))
    weights, config, _ = read_checkpoint(checkpoint)
    assert exported_metadata(tmp_path / "model.safetensors")[0] == config
    assert tokenizer.vocab_size == config.tgt_vocab_size
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], atol=0, rtol=0)


def test_export_rejects_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    for path in (tmp_path / "missing.ckpt", tmp_path / "notes.txt", tmp_path):
        with pytest.raises(SystemExit, match="^error: .*") as raised:
            main([str(path), str(tmp_path / "out.safetensors")])
        assert "\n" not in str(raised.value)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        exported_metadata(tmp_path / "notes.txt")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_rank_ends_the_job(tmp_path: Path) -> None:
    run = cli(
        fit_args(
            tmp_path, "--config", STRATEGY_CONFIGS["ddp"], "--trainer.accelerator", "cpu",
            "--trainer.max_steps", "20", "--trainer.callbacks+=tests.helpers.FailOnRank",
        ),
        timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode != 0
    assert "injected failure on rank 1 at step 1" in run.stderr


@pytest.mark.slow
@pytest.mark.distributed
@SHARES_REFERENCE_RUNS
def test_two_nodes_on_localhost_train_as_ddp(base: Path, tmp_path: Path) -> None:
    """Two torchrun "nodes" of one process each match the two-process DDP run step for step."""
    port = free_port()
    command = [
        "fit",
        *fit_args(tmp_path, "--trainer.max_steps", "3")[1:], *pretrained_args(),  # as the DDP reference run
        "--trainer.accelerator", "cpu", "--trainer.strategy", "ddp",
        "--trainer.num_nodes", "2", "--trainer.devices", "1",
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                f"--node-rank={rank}", f"--rdzv-endpoint=127.0.0.1:{port}", "cli.py", *command,
            ],
            cwd=Path(__file__).resolve().parents[1],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [node.communicate(timeout=RUN_TIMEOUT)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-5000:]
    expected = train_losses(reference_run("ddp", base))
    actual = train_losses(tmp_path)
    assert list(actual) == list(range(6))
    for index, loss in actual.items():
        assert loss == pytest.approx(expected[index], abs=1e-6)
    shutil.rmtree(tmp_path, ignore_errors=True)


DEMO = "configs/demo.yaml"
CLIP = ["--trainer.gradient_clip_val", "0.05"]  # well under the tiny model's gradient norms: every step clips
LOGGER = ["--trainer.logger", "true"]  # demo.yaml's LearningRateMonitor needs one (TINY turns it off)


def _demo_fit(name: str, root: Path, *extra: str) -> list[str]:
    """``reference_args`` of strategy ``name`` on the shipped demo config (tied embeddings, clipping)."""
    args = reference_args(name, root, *extra, pretrained=False)
    return [args[0], "--config", DEMO, *args[1:], *LOGGER]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_on_a_data_config_clips_gradients_as_one_process(tmp_path: Path) -> None:
    """Every data config sets ``gradient_clip_val``; FSDP clips through its sharded ``clip_grad_norm_`` and so
    follows the single process's clipped loss curve, which differs from the unclipped one."""
    roots = {run: tmp_path / run for run in ("single", "fsdp", "unclipped")}
    in_this_process(_demo_fit(SINGLE, roots["single"], *CLIP), roots["single"])  # one process: no launch
    check(cli(_demo_fit("fsdp", roots["fsdp"], *CLIP)))
    in_this_process(_demo_fit(SINGLE, roots["unclipped"], "--trainer.gradient_clip_val", "0"), roots["unclipped"])
    expected, actual, unclipped = (train_losses(root) for root in roots.values())
    assert list(actual) == list(expected) == list(range(2 * STEPS))
    for index, loss in expected.items():
        assert actual[index] == pytest.approx(loss, abs=LOSS_TOLERANCE), f"batch {index}"
    assert max(abs(unclipped[i] - expected[i]) for i in expected) > 10 * LOSS_TOLERANCE, "clipping did not bite"


@pytest.fixture(scope="module")
def zero3_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-3 on two processes on the shipped demo config (tied embeddings), which records the modules it hooks."""
    root = tmp_path_factory.mktemp("zero3-demo")
    check(cli(_demo_fit("zero3", root, "--trainer.callbacks+=tests.test_strategies.HookedModules")))
    return root


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@SHARES_REFERENCE_RUNS
def test_zero3_folder_tests_and_exports(tied: bool, base: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """fit -> test from the ZeRO-3 folder -> export, with and without tied embeddings."""
    root = request.getfixturevalue("zero3_demo") if tied else reference_run("zero3", base)
    folder = root / "checkpoints" / "last.ckpt"
    test_args = [
        "test", *(["--config", DEMO] if tied else []), *strategy_args("zero3"), *TINY,
        "--trainer.default_root_dir", str(root),
        "--trainer.limit_test_batches", "2",
        "--model.num_beams", "1",
        *(LOGGER if tied else []),
    ]  # fmt: skip
    check(cli(test_args))

    model, _ = load_exported(export(folder, tmp_path / "model.safetensors"))
    assert model.config.tie_embeddings is tied
    gathered = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    for name, tensor in model.state_dict().items():
        if f"model.{name}" in gathered:  # DeepSpeed keeps a tied weight under one of its names
            torch.testing.assert_close(tensor, gathered[f"model.{name}"], atol=0, rtol=0)
    if tied:
        assert model.src_embed.weight is model.tgt_embed.weight


class HookedModules(L.Callback):
    """Writes the names of the modules that DeepSpeed ZeRO-3 gathers parameters for in a forward hook."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        hooks = {name: module._forward_pre_hooks.values() for name, module in pl_module.named_modules()}
        hooked = [
            name
            for name, found in hooks.items()
            if any(getattr(h, "__name__", "") == "_pre_forward_module_hook" for h in found)
        ]
        (Path(trainer.default_root_dir) / f"hooked.rank{trainer.global_rank}.json").write_text(json.dumps(hooked))


@pytest.mark.slow
@pytest.mark.distributed
@SHARES_REFERENCE_RUNS  # the worker that trains zero3_demo for test_zero3_folder_tests_and_exports
def test_zero3_gathers_each_layer_as_one_unit(zero3_demo: Path) -> None:
    # DeepSpeed's default hooks every submodule, and that host time was more than the GPU's work in a step (44.5% of
    # DDP on an H100); the numbers are those of one process either way (test_loss_curve_and_weights_match_...).
    for rank in (0, 1):
        hooked = json.loads((zero3_demo / f"hooked.rank{rank}.json").read_text())
        layers = [name for name in hooked if name.startswith(("model.encoder_layers.", "model.decoder_layers."))]
        assert layers == ["model.encoder_layers.0", "model.decoder_layers.0"], hooked


def test_zero3_units_are_the_layers_and_nothing_else() -> None:
    from deepspeed.utils import get_z3_leaf_modules

    model = Transformer(TransformerConfig(d_model=16, num_heads=2, num_encoder_layers=2, num_decoder_layers=3, d_ff=32))
    assert set_zero3_units(model) == 5
    assert get_z3_leaf_modules(model) == [*model.encoder_layers, *model.decoder_layers]
    assert set_zero3_units(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0  # another LightningModule: untouched


def test_deepspeed_on_cpu_compiles_no_shared_memory_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The op serves inference only; compiling it in a run's first process took minutes on a busy machine, and a
    compile cut short left a lock file that every later run waited on forever."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.comm.torch import build_shm_op

    from torch_handle.strategies import use_deepspeed_cpu_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored afterwards, as is the accelerator below
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    accelerator = get_accelerator()
    try:
        use_deepspeed_cpu_accelerator()
        assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
        assert build_shm_op() is None
    finally:
        set_accelerator(accelerator)
    assert list(tmp_path.iterdir()) == []  # nothing compiled


@pytest.mark.parametrize(
    ("precision", "config", "expected"),
    [
        ("bf16-mixed", None, {"enabled": True, "check_grad_overflow": False}),
        ("32-true", None, None),
        # a DeepSpeed config of the user's that asks for the check keeps it
        (
            "bf16-mixed",
            {"bf16": {"enabled": True, "check_grad_overflow": True}},
            {"enabled": True, "check_grad_overflow": True},
        ),
    ],
)
def test_bf16_deepspeed_applies_every_step_as_ddp_does(
    precision: str, config: dict | None, expected: dict | None
) -> None:
    # ZeRO-2's overflow check tests every gradient one by one (8% of a CPU step at 365 tensors) for a loss scale that
    # bf16 does not have.
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    from torch_handle.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=2, config=config, precision_plugin=DeepSpeedPrecision(precision))
    strategy._format_config()
    assert strategy.config.get("bf16") == expected
