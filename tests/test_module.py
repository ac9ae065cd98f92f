"""``Seq2SeqModule``: loss, optimizer groups, learning-rate schedule and checkpoint round trip."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import Mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from torch_handle import loss as loss_file
from torch_handle.data import PAD_ID, TranslationDataModule
from torch_handle.model import generate
from torch_handle.module import Seq2SeqModule

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 40
TINY = tiny_config()


def _module(**kwargs: object) -> Seq2SeqModule:
    return Seq2SeqModule(TINY, vocab_size=VOCAB, **kwargs).eval()


def _batch() -> dict[str, torch.Tensor]:
    """Two examples, the second padded on both sides."""
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD_ID, PAD_ID]])
    tgt = torch.tensor([[1, 11, 12, 13, 2], [1, 14, 2, PAD_ID, PAD_ID]])
    return {"src": src, "tgt": tgt}


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_loss_is_torch_cross_entropy_ignoring_padding(eps: float) -> None:
    module, batch = _module(label_smoothing=eps), _batch()
    loss, nll, tokens = module._loss(batch)  # sums over the batch's target tokens
    logits = module.model(batch["src"], batch["tgt"][:, :-1]).reshape(-1, VOCAB)
    labels = batch["tgt"][:, 1:].reshape(-1)
    expected = F.cross_entropy(logits, labels, ignore_index=PAD_ID, label_smoothing=eps, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, F.cross_entropy(logits, labels, ignore_index=PAD_ID, reduction="sum"))
    assert tokens == (labels != PAD_ID).sum() == 6


def test_padding_never_contributes_to_the_loss() -> None:
    module, batch = _module(), _batch()
    loss, nll, tokens = module._loss(batch)
    padded = {key: F.pad(value, (0, 3), value=PAD_ID) for key, value in batch.items()}  # 3 more pad columns
    torch.testing.assert_close(module._loss(padded), (loss, nll, tokens))
    single = {key: value[:1, :] for key, value in batch.items()}  # the unpadded example alone
    single_loss, _, single_tokens = module._loss(single)
    assert single_tokens == 4
    # The sum over tokens is the sum of the per-example sums.
    other = {key: value[1:, :3] for key, value in batch.items()}
    other_loss, _, other_tokens = module._loss(other)
    torch.testing.assert_close(loss, single_loss + other_loss)
    assert single_tokens + other_tokens == tokens


def _configure(module: Seq2SeqModule, total_steps: int) -> dict:
    module.trainer = Mock(estimated_stepping_batches=total_steps)
    return module.configure_optimizers()


def test_no_weight_decay_on_norms_biases_and_embeddings() -> None:
    module = Seq2SeqModule(
        tiny_config(),
        vocab_size=VOCAB,
        weight_decay=0.05,
    )
    decay, no_decay = _configure(module, 100)["optimizer"].param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    names = {id(p): name for name, p in module.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert decayed | not_decayed == set(names.values()) and not decayed & not_decayed
    for name in not_decayed:
        assert name.endswith(".bias") or "norm" in name or "embed" in name, name
    for name in decayed:
        assert name.endswith(".weight") and "norm" not in name and "embed" not in name, name
    assert any("embed" in name for name in not_decayed) and any("linear1.weight" in name for name in decayed)


def test_lr_warms_up_linearly_then_decays_to_the_floor() -> None:
    module = _module(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    configured = _configure(module, total_steps=100)
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(100):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-6)  # lr / 1000
    assert lrs[5] == pytest.approx(1e-6 + (1e-3 - 1e-6) * 5 / 10)
    assert lrs[10] == pytest.approx(1e-3) and max(lrs) == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[55] == pytest.approx(1e-4 + (1e-3 - 1e-4) * 0.5, rel=1e-3)  # cosine midpoint
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-2)


@pytest.fixture(scope="module")
def trained_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, TranslationDataModule, Seq2SeqModule]:
    root = tmp_path_factory.mktemp("module_ckpt")
    datamodule = TranslationDataModule(demo_size=300, bpe_vocab_size=300, max_tokens=1024)
    module = Seq2SeqModule(TINY, vocab_size=datamodule.vocab_size, warmup_steps=2)
    trainer = L.Trainer(
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module, datamodule=datamodule)
    path = root / "model.ckpt"
    trainer.save_checkpoint(path)
    return path, datamodule, module.eval()


def test_checkpoint_loads_with_weights_only(
    trained_checkpoint: tuple[Path, TranslationDataModule, Seq2SeqModule],
) -> None:
    path, datamodule, _ = trained_checkpoint
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["hyper_parameters"]["transformer"] == TINY
    assert checkpoint["TranslationDataModule"]["tokenizer"] == datamodule.tokenizer.to_str()


def test_load_from_checkpoint_gives_identical_logits(
    trained_checkpoint: tuple[Path, TranslationDataModule, Seq2SeqModule],
) -> None:
    path, datamodule, reference = trained_checkpoint
    loaded = Seq2SeqModule.load_from_checkpoint(path).eval()
    batch = next(iter(datamodule.val_dataloader()))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(batch["src"], batch["tgt"]), reference.model(batch["src"], batch["tgt"]), rtol=0, atol=0
        )
    untrained = Seq2SeqModule(TINY, vocab_size=datamodule.vocab_size).eval()
    assert not torch.equal(untrained.model.tgt_embed.weight, loaded.model.tgt_embed.weight)


def test_a_repeated_evaluation_batch_runs_but_is_not_counted() -> None:
    module = _module(task="summarization")
    batch = {**_batch(), "src_text": ["one two three", "four five"], "tgt_text": ["one", "four"]}
    calls = []
    module.trainer = Mock(world_size=1)
    module._loss = lambda b, m=None: calls.append(b) or Seq2SeqModule._loss(module, b, m)  # type: ignore[method-assign]
    metrics = module.eval_metrics["test"]
    module._evaluate({**batch, "repeat": True}, "test", decode=False)
    assert len(calls) == 1  # the forward pass still runs: sharded strategies step every rank together
    assert not any(metric.update_called for metric in metrics.values())
    module._evaluate({**batch, "repeat": False}, "test", decode=False)
    assert metrics["lead"].update_called and metrics["nll"].update_called and metrics["objective"].update_called


def test_validate_then_fit_then_validate_in_one_process() -> None:
    """The notebook's order: ``trainer.validate`` (inference mode), ``trainer.fit`` (whose validation runs under
    no_grad: metric states made in inference mode cannot be updated in place there), then validate again."""
    datamodule = TranslationDataModule(demo_size=300, bpe_vocab_size=300, max_tokens=1024)
    module = Seq2SeqModule(TINY, vocab_size=datamodule.vocab_size, warmup_steps=2, generate_every_n_val_epochs=0)
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (before,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule)
    after_fit = trainer.callback_metrics["val/loss"].item()
    (after,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    assert after["val/loss"] == pytest.approx(after_fit, rel=1e-6)
    assert after["val/loss"] != pytest.approx(before["val/loss"], rel=1e-6)  # one step did train


def test_evaluation_encodes_each_batch_once_for_the_loss_and_the_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module(max_new_tokens=3, num_beams=2)
    batch = {**_batch(), "tgt_text": ["a b", "c"]}
    model, encoded, reused = module.model, [], []
    torch.testing.assert_close(module._loss(batch, model.encode(batch["src"])), module._loss(batch))
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda src: encoded.append(encode(src)) or encoded[-1])
    monkeypatch.setattr(
        module, "_generate", lambda src, memory=None: reused.append(memory) or generate(model, src, 3, 2, memory=memory)
    )
    tokenizer = Mock(decode_batch=lambda rows: ["x"] * len(rows))
    monkeypatch.setattr(Seq2SeqModule, "tokenizer", property(lambda _: tokenizer))
    module.trainer = Mock(world_size=1)
    module._evaluate(batch, "test", decode=True)
    assert len(encoded) == 1 and reused == encoded  # decoding took the loss's encoder output, and encoded nothing


def test_a_fused_optimizer_is_clipped_under_bf16_mixed_precision() -> None:
    """On a GPU the module's AdamW is fused. Lightning refuses to clip a fused optimizer's gradients under any mixed
    precision (an fp16 scaler would unscale them after the clipping); bf16 has no scaler, so the module clips them
    itself: the step sees a gradient norm of ``gradient_clip_val``. Run on the CPU with its fused AdamW."""

    norms: list[float] = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            loss = closure() if closure is not None else None  # Lightning's closure: forward, backward, clipping
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            norms.append(float(torch.stack([g.norm() for g in grads]).norm()))
            super().step()
            return loss

    class Fused(Seq2SeqModule):
        def configure_optimizers(self) -> dict:
            configured = super().configure_optimizers()
            optimizer = Recording(configured["optimizer"].param_groups, lr=self.hparams.lr, fused=True)
            configured["optimizer"] = optimizer
            configured["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            return configured

    datamodule = TranslationDataModule(demo_size=300, bpe_vocab_size=300, max_tokens=1024)
    module = Fused(TINY, vocab_size=datamodule.vocab_size, warmup_steps=2, generate_every_n_val_epochs=0)
    trainer = L.Trainer(
        max_steps=2, precision="bf16-mixed", gradient_clip_val=1e-3, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    assert norms == pytest.approx([1e-3, 1e-3], rel=1e-3)


def test_compile_compiles_each_layer_once_and_stays_out_of_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--model.compile true`` compiles every encoder and decoder layer once (not again when the same module
    validates) and the loss, and is a choice of the run: the checkpoint's hyper-parameters do not keep it."""
    compiled: list[object] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *args, **kwargs: compiled.append(self))
    monkeypatch.setattr(torch, "compile", lambda fn, *args, **kwargs: compiled.append(fn) or fn)
    loss_file.compiled_token_sums.cache_clear()
    datamodule = TranslationDataModule(demo_size=300, bpe_vocab_size=300, max_tokens=1024)
    config = tiny_config(num_encoder_layers=2)
    module = Seq2SeqModule(config, vocab_size=datamodule.vocab_size, generate_every_n_val_epochs=0, compile=True)
    trainer = L.Trainer(
        max_steps=1, limit_val_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule)
    trainer.validate(module, datamodule=datamodule, verbose=False)  # configure_model again: nothing more compiles
    assert compiled == [*module.model.encoder_layers, *module.model.decoder_layers, loss_file.token_sums]
    loss_file.compiled_token_sums.cache_clear()
    assert "compile" not in module.hparams


def test_the_compiled_loss_equals_the_eager_one_with_its_gradient() -> None:
    """``--model.compile true`` compiles the loss too (a GPU lever): the same sums and the same gradient, padding
    left out, as the eager function."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, VOCAB, requires_grad=True)
    labels = torch.randint(3, VOCAB, (2, 5))
    labels[1, 3:] = PAD_ID
    eager = loss_file.token_sums(logits, labels, PAD_ID, 0.1)
    compiled = loss_file.compiled_token_sums()(logits, labels, PAD_ID, 0.1)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)
    (want_grad,) = torch.autograd.grad(eager[0], logits)
    (got_grad,) = torch.autograd.grad(compiled[0], logits)
    torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_compile_under_fsdp_in_mixed_precision_is_one_line(precision: str) -> None:
    """torch.compile fails on FSDP1's mixed-precision flat parameters (found on an H200 and on this CPU): refused
    before anything is built, pointing at FSDP2; in full precision it compiles."""
    from lightning.pytorch.strategies import FSDPStrategy

    from torch_handle.errors import SetupError

    module = _module(compile=True)
    module._trainer = Mock(strategy=Mock(spec=FSDPStrategy), precision=precision, state=Mock(fn="fit"))
    if precision == "32-true":
        module.configure_model()
        return
    with pytest.raises(SetupError) as raised:
        module.configure_model()
    assert str(raised.value) == (
        f"--model.compile does not run under fsdp in {precision} (torch.compile fails on FSDP1's mixed-precision flat "
        "parameters): compile sharded layers with FSDP2 (--config tp --trainer.strategy.init_args.tensor_parallel_size "
        "1), or leave --model.compile off"
    )
