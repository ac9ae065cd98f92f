"""Every target token weighs the same: in an optimizer step (micro-batches x ranks), and in validation.

Two-process runs of every strategy accumulate two micro-batches per rank; their gradient must be the
per-token gradient of the four batches computed here in one process. Validation has one batch, so one rank
holds only an evening-out repeat and still logs the monitored ``val/loss``. A second validation set of many
uneven batches gives the corpus per-token loss and perplexity, the same on two processes as here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from torch import Tensor
from typing_extensions import override

from tests.helpers import STRATEGY_CONFIGS, check, cli, fit_args
from torch_handle.data import TranslationDataModule
from torch_handle.data.batching import TokenBudgetBatchSampler
from torch_handle.module import Seq2SeqModule

ACCUMULATE = 2
MAX_TOKENS = 96  # a few short sentences per batch: batch sizes and token counts vary widely
WORDS = [f"{a}{b}" for a in "bcdfgklmnprst" for b in "aeiou"]


def _write(path: Path, rows: int, seed: int) -> None:
    """``rows`` line-aligned pairs of 1-14 words; the target repeats the source reversed, plus a word."""
    rng = random.Random(seed)
    sources = [" ".join(rng.choices(WORDS, k=rng.randint(1, 14))) for _ in range(rows)]
    path.with_suffix(".en").write_text("".join(f"{s}\n" for s in sources))
    path.with_suffix(".de").write_text("".join(f"{' '.join(reversed(s.split()))} ende\n" for s in sources))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    _write(root / "train", 80, seed=1)
    _write(root / "val", 3, seed=2)  # one validation batch for two ranks
    _write(root / "many", 40, seed=3)  # many validation batches of different sizes
    return root


def _full_weights_and_grads(trainer: L.Trainer, model: torch.nn.Module) -> tuple[dict, dict]:
    """Whole float32 parameters and gradients, gathered from whatever the strategy sharded."""
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

        named = list(model.named_parameters())
        return (
            {n: safe_get_full_fp32_param(p).clone() for n, p in named},
            {n: safe_get_full_grad(p).clone() for n, p in named},
        )
    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(strategy.model, with_grads=True):
            named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters()]
            return {n: p.detach().clone() for n, p in named}, {n: p.grad.clone() for n, p in named}
    named = list(model.named_parameters())
    return {n: p.detach().clone() for n, p in named}, {n: p.grad.clone() for n, p in named}


class StepRecorder(Callback):
    """Writes, under ``default_root_dir``, each rank's first ``accumulate_grad_batches`` batches, the weights
    and whole gradient of the first optimizer step (rank 0), and each rank's validation metrics."""

    def __init__(self) -> None:
        self.seen = 0
        self.recorded = False

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx < trainer.accumulate_grad_batches:
            record = {"src": batch["src"], "tgt": batch["tgt"], "step_tokens": batch.get("step_tokens")}
            torch.save(record, Path(trainer.default_root_dir) / f"batch.rank{trainer.global_rank}.{idx}.pt")
        self.seen += 1

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # DeepSpeed steps the optimizer once per micro-batch and reduces gradients only at the window's end.
        if self.recorded or self.seen < trainer.accumulate_grad_batches:
            return
        self.recorded = True
        weights, grads = _full_weights_and_grads(trainer, pl_module.model)
        if trainer.global_rank == 0:
            hparams = {k: v for k, v in pl_module.hparams.items() if not k.startswith("_")}
            hparams["transformer"] = pl_module.config  # a dataclass, as the CLI's may be a namespace
            record = {"hparams": hparams, "weights": weights, "grads": grads}
            torch.save(record, Path(trainer.default_root_dir) / "step.pt")

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            metrics = {k: float(trainer.callback_metrics[k]) for k in ("val/loss", "val/ppl", "val/objective")}
            (Path(trainer.default_root_dir) / f"val.rank{trainer.global_rank}.json").write_text(json.dumps(metrics))


def _reference(root: Path) -> tuple[Seq2SeqModule, list[dict[str, Tensor]]]:
    step = torch.load(root / "step.pt", weights_only=True)
    module = Seq2SeqModule(**step["hparams"])
    module.model.load_state_dict(step["weights"])
    batches = [torch.load(path, weights_only=True) for path in sorted(root.glob("batch.rank*.pt"))]
    return module, batches


_runs: dict[str, Path] = {}


def _fit(strategy: str, corpus: Path, base: Path) -> Path:
    """One optimizer step: 2 ranks x 2 micro-batches, then validation monitored by ``val/loss``."""
    if strategy not in _runs:
        root = base / f"token-loss-{strategy}"
        args = fit_args(
            root,
            "--config", STRATEGY_CONFIGS[strategy],
            "--trainer.accelerator", "cpu",
            "--data.init_args.data_dir", str(corpus),
            "--data.init_args.max_tokens", str(MAX_TOKENS),
            "--trainer.accumulate_grad_batches", str(ACCUMULATE),
            "--trainer.limit_train_batches", str(ACCUMULATE),
            "--trainer.max_epochs", "1",
            "--trainer.limit_val_batches", "1.0",
            "--trainer.callbacks+=tests.test_token_loss.StepRecorder",
            "--checkpoint.monitor", "val/loss",
            "--model.lr", "1e-30",  # the weights validation sees are those the gradient was taken at
        )  # fmt: skip
        check(cli(args))
        _runs[strategy] = root
    return _runs[strategy]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_step_gradient_is_the_per_token_gradient_of_all_micro_batches_and_ranks(
    strategy: str, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = _fit(strategy, corpus, tmp_path_factory.getbasetemp())
    module, batches = _reference(root)
    assert len(batches) == 2 * ACCUMULATE
    sums = [module._loss(batch) for batch in batches]
    tokens = sum(int(t) for _, _, t in sums)
    assert [batch["step_tokens"] for batch in batches] == [tokens] * len(batches)  # known without a collective
    (sum(loss for loss, _, _ in sums) / tokens).backward()
    grads = torch.load(root / "step.pt", weights_only=True)["grads"]
    for name, param in module.model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)
    # The one validation batch went to rank 0; rank 1 ran only its repeat and still logged what is monitored.
    logged = [json.loads((root / f"val.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert logged[0] == logged[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_validation_loss_and_perplexity_are_corpus_per_token_values(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    run = _fit("ddp", corpus, tmp_path_factory.getbasetemp())
    args = [
        "validate",
        "--config", STRATEGY_CONFIGS["ddp"],
        "--trainer.accelerator", "cpu",
        "--trainer.default_root_dir", str(tmp_path),
        "--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
        "--data.init_args.data_dir", str(corpus),
        "--data.init_args.val_split", "many",
        "--data.init_args.max_tokens", str(MAX_TOKENS),
        "--trainer.callbacks+=tests.test_token_loss.StepRecorder",
        "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    check(cli(args))
    logged = [json.loads((tmp_path / f"val.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert logged[0] == logged[1]

    module, _ = _reference(run)
    data = TranslationDataModule(
        data_dir=str(corpus), val_split="many", tokenizer_path=str(run / "checkpoints" / "tokenizer.json"),
        max_tokens=MAX_TOKENS,
    )  # fmt: skip
    data.setup("validate")
    with torch.no_grad():
        sums = torch.tensor([[float(x) for x in module._loss(batch)] for batch in data.val_dataloader()])
    loss, nll, tokens = sums.double().sum(dim=0)
    assert len(sums) > 4 and len(set(sums[:, 2].tolist())) > 2, "batches of different token counts"
    assert logged[0]["val/loss"] == pytest.approx(float(nll / tokens), rel=1e-6)  # unsmoothed, as ppl
    assert logged[0]["val/ppl"] == pytest.approx(float((nll / tokens).exp()), rel=1e-6)
    assert logged[0]["val/objective"] == pytest.approx(float(loss / tokens), rel=1e-6)  # label-smoothed
    batch_mean = float((sums[:, 1] / sums[:, 2]).mean())  # away from the corpus mean (untrained model)
    assert batch_mean != pytest.approx(float(nll / tokens), rel=1e-5), "the check tells the two apart"


@pytest.mark.parametrize(("num_replicas", "accumulate"), [(1, 1), (2, 5), (3, 2), (2, 3)])
def test_every_batch_carries_the_target_tokens_of_its_whole_optimizer_step(num_replicas: int, accumulate: int) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(2, 30) for _ in range(101)]
    scored = [n - 1 for n in lengths]
    ranks = [
        list(
            TokenBudgetBatchSampler(
                lengths, 64, shuffle=True, seed=5, num_replicas=num_replicas, rank=rank, scored=scored,
                accumulate=accumulate,
            )
        )
        for rank in range(num_replicas)
    ]  # fmt: skip
    per_rank = len(ranks[0])
    assert per_rank % accumulate or accumulate == 1, "the epoch ends in a shorter window"
    for start in range(0, per_rank, accumulate):  # Lightning steps after `accumulate` batches, and at the end
        window = [batch for rank in ranks for batch in rank[start : start + accumulate]]
        tokens = sum(scored[i % len(lengths)] for batch in window for i in batch)  # repeats count: trained on
        assert {batch.step_tokens for batch in window} == {tokens}
