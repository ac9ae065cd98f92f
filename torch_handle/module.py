"""The one LightningModule: loss, metrics, optimizer and decoding, for every strategy."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.text import SacreBLEUScore
from typing_extensions import override

from torch_handle.hierarchical import summarize
from torch_handle.metrics import Rouge
from torch_handle.model import ConfigError, Transformer, TransformerConfig, generate

# Checkpoints keep the config as a dataclass; let ``torch.load(weights_only=True)`` accept it.
torch.serialization.add_safe_globals([TransformerConfig])

Task = Literal["translation", "summarization"]


class Seq2SeqModule(L.LightningModule):
    """Trains the handwritten Transformer; the strategy (DDP, DeepSpeed, FSDP) is the Trainer's concern.

    Args:
        transformer: Model hyper-parameters. Its vocabulary sizes are replaced by ``vocab_size``.
        vocab_size: Size of the joint source/target vocabulary; the CLI links it from the data module's
            tokenizer, so it is never typed twice.
        task: ``translation`` reports sacreBLEU, ``summarization`` ROUGE-1/2/L/Lsum.
        label_smoothing: Label smoothing of the cross entropy (the paper uses 0.1).
        lr: Peak learning rate, reached after ``warmup_steps``.
        weight_decay: AdamW's decoupled weight decay (not applied to biases, norms and embeddings).
        betas: AdamW's betas.
        warmup_steps: Linear warmup from ``lr / 1000`` to ``lr``; cosine decay to ``min_lr_ratio * lr`` after.
        min_lr_ratio: Final learning rate as a fraction of ``lr``.
        num_beams: Beam width when decoding in validation, test and predict.
        length_penalty: Beam-search length normalisation exponent.
        max_new_tokens: Longest generated output.
        generate_every_n_val_epochs: Decode (and compute BLEU/ROUGE) in validation only every n epochs;
            0 never decodes in validation. Test always decodes.
        lead_words: Summarization ``test`` also scores the Lead baseline, the document's first
            ``lead_words`` words, as ``test/lead_rouge*``: every ROUGE figure gets a reference beside it.
        chunk_overlap: Summarization documents longer than ``--data.max_source_tokens`` are summarized
            hierarchically (see :func:`torch_handle.summarize`) in windows that share this many tokens.
    """

    def __init__(
        self,
        transformer: TransformerConfig = TransformerConfig(),  # noqa: B008 - jsonargparse reads the default
        vocab_size: int = 8000,
        task: Task = "translation",
        label_smoothing: float = 0.1,
        lr: float = 5e-4,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.98),
        warmup_steps: int = 4000,
        min_lr_ratio: float = 0.1,
        num_beams: int = 4,
        length_penalty: float = 1.0,
        max_new_tokens: int = 128,
        generate_every_n_val_epochs: int = 1,
        lead_words: int = 100,
        chunk_overlap: int = 256,
    ) -> None:
        super().__init__()
        for name, value, valid, rule in (
            ("lr", lr, lr > 0, "> 0"),
            ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
            ("betas", betas, all(0 <= b < 1 for b in betas), "in [0, 1)"),
            ("warmup_steps", warmup_steps, warmup_steps >= 0, ">= 0"),
            ("min_lr_ratio", min_lr_ratio, 0 <= min_lr_ratio <= 1, "in [0, 1]"),
            ("label_smoothing", label_smoothing, 0 <= label_smoothing < 1, "in [0, 1)"),
            ("num_beams", num_beams, num_beams >= 1, ">= 1"),
            ("max_new_tokens", max_new_tokens, max_new_tokens >= 1, ">= 1"),
            ("generate_every_n_val_epochs", generate_every_n_val_epochs, generate_every_n_val_epochs >= 0, ">= 0"),
            ("lead_words", lead_words, lead_words >= 1, ">= 1"),
            ("chunk_overlap", chunk_overlap, chunk_overlap >= 0, ">= 0"),
        ):
            if not valid:
                raise ConfigError(f"--model.{name} must be {rule}, got {value}")
        self.save_hyperparameters()
        config = dataclasses.replace(transformer, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size)
        if config.position in ("sinusoidal", "learned") and max_new_tokens + 1 > config.max_len:
            raise ConfigError(
                f"max_new_tokens={max_new_tokens} does not fit max_len={config.max_len} of position="
                f"{config.position!r}: lower max_new_tokens or raise transformer.max_len"
            )
        self.model = Transformer(config)
        self.config = config
        self.val_metric, self.test_metric = (self._new_metric() for _ in range(2))
        self.test_lead_metric = Rouge() if task == "summarization" else None

    def _new_metric(self) -> SacreBLEUScore | Rouge:
        return SacreBLEUScore(tokenize="13a") if self.hparams.task == "translation" else Rouge()

    @property
    def tokenizer(self) -> Any:
        """The data module's tokenizer: it decodes exactly as the data was encoded."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None or not hasattr(datamodule, "tokenizer"):
            raise RuntimeError("decoding needs a data module with a tokenizer: pass datamodule= to the Trainer")
        return datamodule.tokenizer

    # --- loss ---------------------------------------------------------------------------------------------

    def _loss(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Label-smoothed cross entropy over non-padding targets; also the plain NLL and the token count.

        One log-softmax serves both: smoothed loss = (1 - eps) * NLL + eps * mean over the vocabulary of
        -log p, the definition ``F.cross_entropy(label_smoothing=eps)`` uses.
        """
        tgt = batch["tgt"]
        logits = self.model(batch["src"], tgt[:, :-1])  # (B, T, V)
        labels = tgt[:, 1:].reshape(-1)
        log_probs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.shape[-1])
        keep = labels != self.config.pad_id
        tokens = keep.sum()
        nll = F.nll_loss(log_probs, labels, ignore_index=self.config.pad_id, reduction="sum") / tokens
        smooth = -(log_probs.mean(dim=-1) * keep).sum() / tokens
        eps = self.hparams.label_smoothing
        return (1 - eps) * nll + eps * smooth, nll, tokens

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, nll, tokens = self._loss(batch)
        batch_size = batch["tgt"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/ppl", nll.detach().exp(), batch_size=batch_size)
        self.log("train/tokens", tokens.float(), reduce_fx="sum", batch_size=batch_size)
        return loss

    # --- evaluation ---------------------------------------------------------------------------------------

    def _evaluate(self, batch: dict[str, Any], stage: str, metric: SacreBLEUScore | Rouge, decode: bool) -> None:
        """Loss, perplexity and decoding metrics of one batch.

        A batch that only evens out the batch count across ranks (``batch["repeat"]``) runs like any other,
        because sharded strategies need every rank to step together, but is not counted.
        """
        loss, nll, _ = self._loss(batch)
        predictions = self.decode_batch(batch) if decode else None
        if batch.get("repeat", False):
            return
        batch_size = batch["tgt"].shape[0]
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch_size)
        self.log(f"{stage}/ppl", nll.exp(), sync_dist=True, batch_size=batch_size)
        if predictions is not None:
            references = batch["tgt_text"]
            metric.update(predictions, [[r] for r in references] if isinstance(metric, SacreBLEUScore) else references)
        if stage == "test" and self.test_lead_metric is not None:
            lead_words = self.hparams.lead_words
            leads = [" ".join(doc.split()[:lead_words]) for doc in batch["src_text"]]
            self.test_lead_metric.update(leads, batch["tgt_text"])

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        every = self.hparams.generate_every_n_val_epochs
        decode = every > 0 and (self.current_epoch + 1) % every == 0 and not self.trainer.sanity_checking
        self._evaluate(batch, "val", self.val_metric, decode)

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_metric, decode=True)

    def _log_metric(self, stage: str, metric: SacreBLEUScore | Rouge, prefix: str = "") -> None:
        if not metric.update_called:
            return
        value = metric.compute()
        self.log_dict(
            {f"{stage}/{prefix}{k}": v for k, v in value.items()}
            if isinstance(value, dict)
            else {f"{stage}/{prefix}bleu": value}
        )
        metric.reset()

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_metric("val", self.val_metric)

    @override
    def on_test_epoch_end(self) -> None:
        self._log_metric("test", self.test_metric)
        if self.test_lead_metric is not None:
            self._log_metric("test", self.test_lead_metric, prefix="lead_")

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        return self.decode_batch(batch)

    def decode_batch(self, batch: dict[str, Any]) -> list[str]:
        """Outputs for a batch; summarization documents cut by the collator are summarized hierarchically."""
        if self.hparams.task != "summarization":
            return self.generate_text(batch["src"])
        limit = self.trainer.datamodule.collator.max_source_tokens
        long = batch["src_truncated"]  # cut by the collator: too long for one pass
        out = [""] * len(long)
        short = [i for i, is_long in enumerate(long) if not is_long]
        if short:
            src = batch["src"][short]
            src = src[:, : int((src != self.config.pad_id).sum(dim=1).max())]  # (b, S) without shared padding
            for i, text in zip(short, self.generate_text(src), strict=True):
                out[i] = text
        for i in (i for i, is_long in enumerate(long) if is_long):
            out[i] = summarize(
                self.model,
                self.tokenizer,
                batch["src_text"][i],
                max_source_tokens=limit,
                overlap=self.hparams.chunk_overlap,
                max_new_tokens=self.hparams.max_new_tokens,
                num_beams=self.hparams.num_beams,
                length_penalty=self.hparams.length_penalty,
            )
        return out

    def generate_text(self, src: Tensor) -> list[str]:
        """Beam-search ``src (B, S)`` and detokenize."""
        # Sharded strategies gather parameters inside forward: every rank decodes until all ranks are done.
        all_done = bool if self.trainer.world_size == 1 else self.trainer.strategy.reduce_boolean_decision
        h = self.hparams
        ids = generate(self.model, src, h.max_new_tokens, h.num_beams, h.length_penalty, all_done)
        return self.tokenizer.decode_batch(ids.tolist())

    # --- optimisation -------------------------------------------------------------------------------------

    @override
    def configure_optimizers(self) -> Any:
        # Decay the matrices of linear layers only; chosen by module, not by ``dim()``, because FSDP hands this
        # hook flattened 1-D views. Embeddings (also when tied to the output layer), norms and biases keep theirs.
        embeddings = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)}
        matrices = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Linear)} - embeddings
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if id(p) in matrices]
        no_decay = [p for p in params if id(p) not in matrices]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=self.hparams.betas,
        )
        # Linear warmup from lr / 1000, then cosine decay to min_lr_ratio * lr at the last step. The number of
        # steps is read at the first step, not here: ``estimated_stepping_batches`` would build the train loader
        # before a checkpoint is restored, and Lightning repositions only a loader it builds after restoring, so a
        # resumed epoch would restart at batch 0. ``factor`` is a plain function: LambdaLR keeps it out of checkpoints.
        hparams, trainer, start = self.hparams, self.trainer, 1e-3

        @functools.cache
        def total() -> int:
            return max(int(trainer.estimated_stepping_batches), 1)

        def factor(step: int) -> float:
            if step == 0:
                return start
            warmup = max(min(hparams.warmup_steps, total() - 1), 1)
            if step < warmup:
                return start + (1 - start) * step / warmup
            progress = min((step - warmup) / max(total() - warmup, 1), 1.0)
            return hparams.min_lr_ratio + (1 - hparams.min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
