"""The one LightningModule: loss and training, for every strategy; its evaluation and decoding are in
:mod:`torch_handle.evaluation`, its optimizer hooks in :mod:`torch_handle.optimization`, its parallelisation plan in
:mod:`torch_handle.parallelism`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import IO, Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import Self, override

from torch_handle.callbacks.checkpointing import use_checked_io
from torch_handle.checkpoints import check_checkpoint
from torch_handle.data.resume import finish_saved_epoch, record_stopped_epoch
from torch_handle.evaluation import Evaluation
from torch_handle.hierarchical import fitted_overlap, window_tokens
from torch_handle.loss import compiled_token_sums, token_sums
from torch_handle.model import ConfigError, Transformer, TransformerConfig
from torch_handle.model.logits import DecodingControls
from torch_handle.optimization import Optimization
from torch_handle.parallel import (
    Pipeline,
    check_context_parallel,
    sharded_logits,
    vocab_parallel_token_sums,
)
from torch_handle.parallelism import Parallelism
from torch_handle.pretrained.trained import init_config, init_weights

Task = Literal["translation", "summarization"]


class Seq2SeqModule(Evaluation, Optimization, Parallelism):
    """Trains the handwritten Transformer; the strategy (DDP, DeepSpeed, FSDP) is the Trainer's concern.

    Args:
        transformer: Model hyper-parameters. Its vocabulary sizes are replaced by ``vocab_size``.
        vocab_size: Size of the joint source/target vocabulary; the CLI links it from the data module's
            tokenizer, so it is never typed twice.
        task: ``translation`` reports sacreBLEU, ``summarization`` ROUGE-1/2/L/Lsum F1 and the geometric mean of
            ROUGE-1/2/L (``rougeGM``, SCROLLS's figure), both 0-100 as papers do;
            ``test`` also prints them (BLEU with its sacreBLEU signature). Loss and perplexity are per target token
            over the whole set.
        label_smoothing: Label smoothing of the cross entropy (the paper uses 0.1). The optimizer minimises the
            smoothed cross entropy, logged as ``train/objective``; ``train/loss`` and ``val/loss`` are the plain
            negative log-likelihood per token (perplexity is its exp), comparable across smoothing settings.
        lr: Peak learning rate, reached after ``warmup_steps``.
        weight_decay: AdamW's decoupled weight decay (not applied to biases, norms and embeddings).
        betas: AdamW's betas.
        warmup_steps: Linear warmup from ``lr / 1000`` to ``lr``; cosine decay to ``min_lr_ratio * lr`` after.
        min_lr_ratio: Final learning rate as a fraction of ``lr``.
        num_beams: Beam width when decoding in validation, test and predict.
        length_penalty: Beam-search length normalisation exponent.
        max_new_tokens: Longest generated output.
        no_repeat_ngram_size: No n-gram of this many tokens appears twice in an output (0 = off); decoding controls
            act as ``transformers``' ``generate`` options of the same names (:mod:`torch_handle.model.logits`).
        repetition_penalty: Divides the scores of tokens already in the output (multiplies negative ones); 1 = off.
        min_new_tokens: EOS is ruled out until the output holds this many tokens.
        do_sample: Draw each token (greedy) or each step's candidates (beam search) from the scores.
        temperature: Sampling divides the scores by it (1 = off).
        top_k: Sampling keeps the ``top_k`` best tokens only (0 = off).
        top_p: Sampling keeps the fewest best tokens whose probabilities add up to ``top_p`` (1 = off).
        seed: Makes sampling repeatable: a source gets the same output with the same seed on any number of
            processes and in any batch. None: a fresh seed (never from torch's generator), each sampling call on one
            process, each loop on several (rank 0 draws it for all, as ranks that split a source must agree).
        generate_every_n_val_epochs: Decode (and compute BLEU/ROUGE) in validation only every n epochs;
            0 never decodes in validation. Test always decodes.
        lead_words: Summarization ``test`` also scores the Lead baseline, the document's first
            ``lead_words`` words, as ``test/lead_rouge*``: every ROUGE figure gets a reference beside it.
        naive_ratio: Summarization ``test`` also scores SCROLLS's naive baseline, the input's first
            ``naive_ratio * len(input)`` characters, as ``test/naive_rouge*``. None takes SCROLLS's ratio, the
            training pairs' mean summary-to-input length ratio in characters, from ``--data.train_file``; without
            that file the naive baseline is skipped.
        chunk_overlap: Summarization documents longer than ``--data.max_source_tokens`` are summarized
            hierarchically (see :func:`torch_handle.summarize`) in windows that share this many tokens.
        long_documents: What ``test`` and ``predict`` do with a summarization document longer than
            ``--data.max_source_tokens``: ``windows`` summarizes all of it hierarchically (``chunk_overlap``); ``cut``
            summarizes its first ``max_source_tokens``, as training reads it, in one pass (as SCROLLS's baselines
            truncate): the cheaper decoding, blind to the rest.
        context_parallel: Processes that share each batch and split its sources (1 = off): each encodes
            ``S / context_parallel`` consecutive positions of every source, exchanging ``window`` keys and values with
            its neighbours in each layer, and the decoder runs replicated on them; activation memory per process falls
            as ``1 / context_parallel``. Needs ``transformer.encoder_attention: local`` and must divide the number of
            processes; the rest are data-parallel replicas. Chosen for each run: checkpoints do not keep it.
        compile: ``torch.compile`` each encoder and decoder layer (as torchtitan compiles its blocks) once the
            parallelisation plans are applied, and the loss: fused kernels and fewer launches on a GPU, after a
            compilation of about a minute. Chosen for each run: checkpoints do not keep it.
        fp8: Train the layers' matrix products in float8 on an NVIDIA GPU with FP8 tensor cores (compute capability
            8.9 or newer), with torchao's float8 linears (:mod:`torch_handle.parallel.float8`): alone or under ddp
            or fsdp2, compiled or not, or under fsdp. Weights and checkpoints keep their precision; ``test`` and
            ``predict`` decode without float8. Chosen for each run: checkpoints do not keep it.
        init_from: A model to start from: a Hugging Face model folder (BART, mBART, Marian, PEGASUS, T5, mT5, LED) or
            its hub id (``Helsinki-NLP/opus-mt-en-de``, fetched once into the Hugging Face cache), or one of ours as
            :func:`torch_handle.load` reads it (an export, a checkpoint, a run folder, e.g. a ``--config pretrain``
            run's): its architecture replaces ``transformer`` (but for the attention kernel, activation checkpointing,
            LED's ``global_tokens`` and ``copy_attention``), its weights the random ones, and its tokenizer the data's
            (:mod:`torch_handle.pretrained.trained`).
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
        no_repeat_ngram_size: int = 0,
        repetition_penalty: float = 1.0,
        min_new_tokens: int = 0,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        generate_every_n_val_epochs: int = 1,
        lead_words: int = 100,
        naive_ratio: float | None = None,
        chunk_overlap: int = 256,
        long_documents: Literal["windows", "cut"] = "windows",
        context_parallel: int = 1,
        compile: bool = False,
        fp8: bool = False,
        init_from: str | None = None,
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
            ("naive_ratio", naive_ratio, naive_ratio is None or 0 < naive_ratio <= 1, "in (0, 1] or None"),
            ("chunk_overlap", chunk_overlap, chunk_overlap >= 0, ">= 0"),
            ("context_parallel", context_parallel, context_parallel >= 1, ">= 1"),
        ):
            if not valid:
                raise ConfigError(f"--model.{name} must be {rule}, got {value}")
        try:
            self.controls = DecodingControls(
                no_repeat_ngram_size, repetition_penalty, min_new_tokens, do_sample, temperature, top_k, top_p, seed
            )
        except ValueError as err:
            raise ConfigError(f"--model.{err}") from err
        # How many processes split a source is the run's layout, never the checkpoint's: not a hyper-parameter.
        self.save_hyperparameters(ignore=["context_parallel", "compile", "fp8"])
        self.context_parallel = context_parallel
        self.use_compile = compile
        self.use_fp8 = fp8
        config = dataclasses.replace(transformer, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size)
        if init_from is not None:
            config = self._pretrained_config(init_from, transformer, vocab_size)
        check_context_parallel(config, context_parallel)
        if config.target_length is not None and max_new_tokens + 1 > config.target_length:
            name = "max_target_len" if config.max_target_len else "max_len"
            raise ConfigError(
                f"max_new_tokens={max_new_tokens} does not fit {name}={config.target_length} of position="
                f"{config.position!r}: lower max_new_tokens or raise transformer.{name}"
            )
        self.model = Transformer(config)
        self.config = config
        if init_from is not None:
            init_weights(self.model, init_from)
        self.eval_metrics = torch.nn.ModuleDict({stage: self._new_metrics(stage) for stage in ("val", "test")})
        self._decoded: set[str] = set()  # stages that decoded in their current epoch
        self._naive_ratio: float | None = None  # this test's naive-baseline ratio (see ``naive_ratio``)
        self.chunk_overlap = chunk_overlap  # fitted to the data's windows in setup
        self._parallelized = False  # configure_model applied the parallelisation plans
        self._pipeline: Pipeline | None = None  # this process's pipeline stages, under pipeline parallelism

    def _pretrained_config(self, folder: str, given: TransformerConfig, vocab_size: int) -> TransformerConfig:
        """The architecture of the model at ``folder`` (``init_from``), with ``given``'s run settings (attention
        kernel, activation checkpointing, global tokens, copy attention). Checkpoints keep it as ``transformer``, so
        they load without the folder."""
        config = init_config(folder)
        if vocab_size != config.tgt_vocab_size:
            raise ConfigError(
                f"--model.init_from {folder} embeds {config.tgt_vocab_size} tokens, the data's tokenizer has "
                f"{vocab_size}: leave --data.tokenizer_path unset, and the folder's tokenizer is used"
            )
        config = dataclasses.replace(
            config,
            attention_backend=given.attention_backend,
            activation_checkpointing=given.activation_checkpointing,
            global_tokens=given.global_tokens,
            copy_attention=given.copy_attention,
        )
        built = isinstance(self.hparams["transformer"], TransformerConfig)  # else its fields, as the CLI keeps them
        self.hparams["transformer"] = config if built else config.to_dict()
        self.hparams["init_from"] = None
        return config

    # --- loss ---------------------------------------------------------------------------------------------

    def _loss(self, batch: dict[str, Any], memory: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Summed label-smoothed cross entropy over non-padding targets; also the summed NLL and the token count.

        ``memory``, the encoder's output for ``batch["src"]``, is passed in evaluation, where decoding reuses it.
        Sums, not means: the caller divides by the tokens of whatever it averages over (an optimizer step, a
        whole evaluation set), so every token weighs the same.
        """
        src, tgt = batch["src"], batch["tgt"]
        labels = tgt[:, 1:]
        targets = labels != self.config.pad_id  # logits at these positions only: the loss skips the rest
        with sharded_logits():  # under tensor parallelism, the logits stay split by vocabulary for the loss
            if memory is None:
                logits = self.model(src, tgt[:, :-1], targets)  # (N, V)
            else:
                logits = self.model.decode(
                    tgt[:, :-1], memory, self.model.memory_padding(src), targets=targets, source=src
                )
        return self._token_sums(logits, labels[targets])

    def _token_sums(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Smoothed loss, NLL (both summed) and the token count of ``logits (..., V)`` against ``labels (...)``."""
        if isinstance(logits, DTensor):
            return vocab_parallel_token_sums(logits, labels, self.config.pad_id, self.hparams.label_smoothing)
        sums = compiled_token_sums() if self.use_compile else token_sums
        return sums(logits, labels, self.config.pad_id, self.hparams.label_smoothing)

    def _pipelined(self, batch: dict[str, Any], scale: Tensor | float | None) -> tuple[Tensor, Tensor, Tensor]:
        """A batch through the pipeline (:mod:`torch_handle.parallel.pipeline`): forward and backward when ``scale``
        is given (each micro-batch backpropagates its summed smoothed loss times ``scale``), forward only when None.
        Returns the batch's three sums (see :meth:`_token_sums`) on every stage."""
        sums: list[Tensor] = []

        def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
            loss_sum, nll_sum, tokens = self._token_sums(logits, labels)
            sums.append(torch.stack((loss_sum.detach(), nll_sum.detach(), tokens.to(nll_sum.dtype))))
            return loss_sum * scale if scale is not None else loss_sum

        tgt = batch["tgt"]
        run = self._pipeline.step if scale is not None else self._pipeline.eval
        run(batch["src"], tgt[:, :-1], tgt[:, 1:], loss_fn)
        total = torch.stack(sums).sum(dim=0) if sums else torch.zeros(3, device=tgt.device)
        loss_sum, nll_sum, tokens = self._pipeline.from_last_stage(total.float())
        return loss_sum, nll_sum, tokens.long()

    @override
    def setup(self, stage: str) -> None:
        # A trainer's ckpt_path is checked before any unpickler reads it, with or without the Checkpoint callback.
        use_checked_io(self.trainer)
        # The windows of a long document must advance: said before training, not when test first reads them.
        data, self.chunk_overlap = self.trainer.datamodule, self.hparams.chunk_overlap
        if self.hparams.task == "summarization" and self.hparams.long_documents == "windows" and data is not None:
            if hasattr(data, "collator") and hasattr(data, "tokenizer"):
                window = window_tokens(data.collator.max_source_tokens, data.tokenizer)
                self.chunk_overlap = fitted_overlap(self.hparams.chunk_overlap, window)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path | IO, *args: Any, **kwargs: Any) -> Self:  # type: ignore[override]
        """Lightning's, once :func:`~torch_handle.checkpoints.check_checkpoint` has found nothing in a local
        ``checkpoint_path`` that could run code (a file object or a remote path is Lightning's alone)."""
        if isinstance(checkpoint_path, str | Path) and "://" not in str(checkpoint_path):
            check_checkpoint(checkpoint_path)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A run with max_steps resumed at an epoch's end trains the right next one, on the right logging step.
        # (load_from_checkpoint calls this hook without a trainer; no loop is restored then.)
        trainer = self._trainer
        finish_saved_epoch(checkpoint, iteration_based=trainer is not None and trainer.max_steps != -1)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint written when max_steps stopped training resumes where it stopped.
        if self._trainer is not None:
            record_stopped_epoch(checkpoint, self._trainer)

    @override
    def on_train_start(self) -> None:
        trainer = self.trainer
        batches, accumulate = trainer.num_training_batches, trainer.accumulate_grad_batches
        if trainer.strategy.handles_gradient_accumulation and batches % accumulate:
            rank_zero_warn(
                f"{type(trainer.strategy).__name__} carries accumulation windows across epochs, but the loss is "
                f"normalised per epoch: the step spanning each epoch end weighs its tokens slightly off; choose "
                f"accumulate_grad_batches dividing the {batches} batches per epoch and rank"
            )

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        step_tokens = batch.get("step_tokens", 0)
        if self._pipeline is not None:
            # The schedule runs the backward passes; Lightning's (``backward`` below) is skipped, and with it
            # Lightning's division by accumulate_grad_batches, which the scale therefore leaves out. Lightning zeroes
            # the gradients between training_step and backward, too late here: they are zeroed first.
            accumulate = self.trainer.accumulate_grad_batches
            if batch_idx % accumulate == 0:
                for optimizer in self.trainer.optimizers:
                    optimizer.zero_grad()
            if step_tokens:
                scale = self._step_scale() / (accumulate * step_tokens)
            else:
                tokens = (batch["tgt"][:, 1:] != self.config.pad_id).sum()
                scale = 1 / (accumulate * tokens.clamp(min=1))
            loss_sum, nll_sum, tokens = self._pipelined(batch, scale)
            loss = loss_sum * scale * accumulate  # what Lightning reports, undivided as it divides it
        else:
            loss_sum, nll_sum, tokens = self._loss(batch)
            # The step's gradient is sum(token losses) / step_tokens over all its micro-batches and ranks, as
            # fairseq does; a loader without step_tokens falls back to each micro-batch's own mean.
            loss = loss_sum * (self._step_scale() / step_tokens) if step_tokens else loss_sum / tokens
        per_token = tokens.clamp(min=1)
        batch_size = batch["tgt"].shape[0]
        nll = nll_sum.detach() / per_token  # per token, without label smoothing
        self.log("train/loss", nll, prog_bar=True, batch_size=batch_size)
        if self.trainer._logger_connector.should_update_logs:  # the steps the loggers write: each call costs host time
            self.log("train/objective", loss_sum.detach() / per_token, batch_size=batch_size)  # what the step minimises
            self.log("train/ppl", nll.exp(), batch_size=batch_size)
            self.log("train/tokens", tokens.float(), reduce_fx="sum", batch_size=batch_size)
        return loss
