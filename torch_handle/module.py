"""The one LightningModule: loss, metrics, optimizer and decoding, for every strategy."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torchmetrics.aggregation import MeanMetric
from torchmetrics.text import SacreBLEUScore
from typing_extensions import override

from torch_handle.data.resume import finish_saved_epoch
from torch_handle.errors import SetupError
from torch_handle.hierarchical import summarize
from torch_handle.loss import compiled_token_sums, token_sums
from torch_handle.metrics import (
    GEOMETRIC_MEAN,
    ChrF,
    Rouge,
    baseline_labels,
    bleu_signature,
    chrf_signature,
    geometric_mean,
    lead,
    naive,
    rouge_line,
)
from torch_handle.model import ConfigError, Transformer, TransformerConfig, generate
from torch_handle.model.logits import DecodingControls
from torch_handle.optim import parameter_groups, warmup_cosine
from torch_handle.parallel import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    Pipeline,
    apply_context_parallel,
    apply_fully_shard,
    apply_fully_shard_stages,
    apply_pipeline_parallel,
    apply_tensor_parallel,
    build_mesh,
    check_context_parallel,
    check_pipeline_parallel,
    check_tensor_parallel,
    sharded_logits,
    vocab_parallel_token_sums,
)
from torch_handle.pretrained import fill, pretrained_config
from torch_handle.pretrained.reader import read_weights

Task = Literal["translation", "summarization"]
BLEU_TOKENIZE = "13a"  # sacreBLEU's default tokenizer, the one WMT results are reported with


def _percent(value: Tensor | dict[str, Tensor], prefix: str, name: str = "bleu") -> dict[str, Tensor]:
    """BLEU or chrF (a tensor named ``name``) or ROUGE (a dict, given its geometric mean) on the 0-100 scale that
    sacreBLEU and papers report."""
    scores = value | {GEOMETRIC_MEAN: geometric_mean(value)} if isinstance(value, dict) else {name: value}
    return {f"{prefix}{name}": 100 * score.float() for name, score in scores.items()}


def _signatures() -> dict[str, str]:
    """sacreBLEU's signature of each translation score, printed beside it."""
    return {"bleu": bleu_signature(BLEU_TOKENIZE), "chrf": chrf_signature()}


def _pipeline_size(mesh: DeviceMesh) -> int:
    return mesh[PIPELINE_PARALLEL].size() if PIPELINE_PARALLEL in mesh.mesh_dim_names else 1


class Seq2SeqModule(L.LightningModule):
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
            processes and in any batch. None: each sampling call draws a fresh seed (never from torch's generator).
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
        context_parallel: Processes that share each batch and split its sources (1 = off): each encodes
            ``S / context_parallel`` consecutive positions of every source, exchanging ``window`` keys and values with
            its neighbours in each layer, and the decoder runs replicated on them; activation memory per process falls
            as ``1 / context_parallel``. Needs ``transformer.encoder_attention: local`` and must divide the number of
            processes; the rest are data-parallel replicas. Chosen for each run: checkpoints do not keep it.
        compile: ``torch.compile`` each encoder and decoder layer (as torchtitan compiles its blocks) once the
            parallelisation plans are applied, and the loss: fused kernels and fewer launches on a GPU, after a
            compilation of about a minute. Chosen for each run: checkpoints do not keep it.
        init_from: A Hugging Face model folder (BART, mBART, Marian, PEGASUS) to start from: its architecture
            replaces ``transformer`` (but for the attention kernel and activation checkpointing), its weights the
            random ones, and its tokenizer the data's (:mod:`torch_handle.pretrained`).
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
        context_parallel: int = 1,
        compile: bool = False,
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
        self.save_hyperparameters(ignore=["context_parallel", "compile"])
        self.context_parallel = context_parallel
        self.use_compile = compile
        config = dataclasses.replace(transformer, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size)
        if init_from is not None:
            config = self._pretrained_config(Path(init_from), transformer, vocab_size)
        check_context_parallel(config, context_parallel)
        if config.position in ("sinusoidal", "learned") and max_new_tokens + 1 > config.max_len:
            raise ConfigError(
                f"max_new_tokens={max_new_tokens} does not fit max_len={config.max_len} of position="
                f"{config.position!r}: lower max_new_tokens or raise transformer.max_len"
            )
        self.model = Transformer(config)
        self.config = config
        if init_from is not None:
            fill(self.model, read_weights(Path(init_from)), init_from)
        self.eval_metrics = torch.nn.ModuleDict({stage: self._new_metrics(stage) for stage in ("val", "test")})
        self._decoded: set[str] = set()  # stages that decoded in their current epoch
        self._naive_ratio: float | None = None  # this test's naive-baseline ratio (see ``naive_ratio``)
        self._parallelized = False  # configure_model applied the parallelisation plans
        self._pipeline: Pipeline | None = None  # this process's pipeline stages, under pipeline parallelism

    def _pretrained_config(self, folder: Path, given: TransformerConfig, vocab_size: int) -> TransformerConfig:
        """The architecture of the Hugging Face model in ``folder``, with ``given``'s run settings (attention
        kernel, activation checkpointing). Checkpoints keep it as ``transformer``, so they load without the folder."""
        config, _, _ = pretrained_config(folder)
        if vocab_size != config.tgt_vocab_size:
            raise ConfigError(
                f"--model.init_from {folder} embeds {config.tgt_vocab_size} tokens, the data's tokenizer has "
                f"{vocab_size}: leave --data.tokenizer_path unset, and the folder's tokenizer is used"
            )
        config = dataclasses.replace(
            config,
            attention_backend=given.attention_backend,
            activation_checkpointing=given.activation_checkpointing,
        )
        built = isinstance(self.hparams["transformer"], TransformerConfig)  # else its fields, as the CLI keeps them
        self.hparams["transformer"] = config if built else config.to_dict()
        self.hparams["init_from"] = None
        return config

    def _new_metrics(self, stage: str) -> torch.nn.ModuleDict:
        """Per-token smoothed objective and NLL (token-weighted means, summed over ranks); BLEU and chrF, or ROUGE."""
        metrics = {"objective": MeanMetric(), "nll": MeanMetric()}
        metrics["score"] = SacreBLEUScore(tokenize=BLEU_TOKENIZE) if self.hparams.task == "translation" else Rouge()
        if self.hparams.task == "translation":
            metrics["chrf"] = ChrF()
        if stage == "test" and self.hparams.task == "summarization":
            metrics["lead"] = Rouge()
            metrics["naive"] = Rouge()
        for metric in metrics.values():
            metric.set_dtype(torch.float64)  # corpus sums over many batches
        return torch.nn.ModuleDict(metrics)

    @property
    def tokenizer(self) -> Any:
        """The data module's tokenizer: it decodes exactly as the data was encoded."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None or not hasattr(datamodule, "tokenizer"):
            raise RuntimeError("decoding needs a data module with a tokenizer: pass datamodule= to the Trainer")
        return datamodule.tokenizer

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
                logits = self.model.decode(tgt[:, :-1], memory, self.model.memory_padding(src), targets=targets)
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
    def configure_model(self) -> None:
        """Applies the parallelisation plans once the processes are connected: pipeline stages and/or tensor
        parallelism, then FSDP2, on the mesh of :class:`~torch_handle.strategies.ModelParallelStrategy`; or context
        parallelism on a ``(data_parallel, context_parallel)`` mesh laid out here; nothing under the other
        strategies."""
        if self._pipeline is not None and self.trainer.state.fn != TrainerFn.FITTING:
            raise SetupError(
                "this module was split into pipeline stages by fit: test or predict its checkpoint with a new module "
                "(torch-handle test --ckpt_path ..., or trainer.test(Seq2SeqModule(...), ckpt_path=...))"
            )
        if self._parallelized:  # a second fit or test of this module
            return
        self.check_parallel_plans()
        mesh, cp = self._device_mesh, self.context_parallel
        if mesh is not None and _pipeline_size(mesh) > 1:
            pipeline = self.trainer.strategy.pipeline  # torch_handle.strategies.ModelParallelStrategy's
            stages = apply_pipeline_parallel(self.model, mesh[PIPELINE_PARALLEL], pipeline)
            if mesh[TENSOR_PARALLEL].size() > 1:  # each stage's heads and feed-forward units split in turn
                apply_tensor_parallel(self.model, mesh[TENSOR_PARALLEL], vocabulary=False)
            apply_fully_shard_stages(stages, mesh[DATA_PARALLEL])
            self._pipeline = Pipeline(stages, mesh[PIPELINE_PARALLEL], pipeline)
        elif mesh is not None:
            if mesh[TENSOR_PARALLEL].size() > 1:
                apply_tensor_parallel(self.model, mesh[TENSOR_PARALLEL])
            apply_fully_shard(self.model, mesh[DATA_PARALLEL])  # also on one replica: Lightning loads DTensors
        elif cp > 1:
            trainer = self.trainer
            self._device_mesh = build_mesh(trainer.world_size, cp, trainer.strategy.root_device.type)
            apply_context_parallel(self.model, self._device_mesh[CONTEXT_PARALLEL].get_group())
        if self.use_compile:
            for layer in (*self.model.encoder_layers, *self.model.decoder_layers):
                layer.compile()
        self._parallelized = True

    def check_parallel_plans(self) -> None:
        """Raises :class:`SetupError` in one line when the plans of the strategy's device mesh cannot apply to this
        model. :class:`~torch_handle.strategies.ModelParallelStrategy` asks as soon as it has laid the mesh out,
        before the run folder is made; :meth:`configure_model` asks again for Lightning's own strategy."""
        mesh, cp = self._device_mesh, self.context_parallel
        if mesh is None:
            return
        if cp > 1:
            raise SetupError(
                f"--model.context_parallel={cp} lays out its own device mesh, but "
                f"{type(self.trainer.strategy).__name__} brings another: use it with strategy ddp, fsdp or "
                "deepspeed, or set --model.context_parallel 1"
            )
        if _pipeline_size(mesh) > 1:
            every = self.hparams.generate_every_n_val_epochs
            if every:
                raise SetupError(
                    f"--model.generate_every_n_val_epochs={every}: a pipeline cannot run beam search (test and predict "
                    "decode with every process as a replica): set --model.generate_every_n_val_epochs 0"
                )
            check_pipeline_parallel(self.model.config, _pipeline_size(mesh), self.trainer.strategy.pipeline)
        if mesh[TENSOR_PARALLEL].size() > 1:
            check_tensor_parallel(self.model.config, mesh[TENSOR_PARALLEL].size())

    def _step_scale(self) -> int:
        """What the backward pass divides a micro-batch's loss by, undone so that the step's mean is per token.

        Lightning divides by ``accumulate_grad_batches``, a strategy that accumulates itself (DeepSpeed)
        divides by it once more, and DDP, DeepSpeed and FSDP average gradients over ranks. Under context
        parallelism a batch's ranks all compute its loss, and their gradients add up to ``context_parallel``
        times its gradient (see :mod:`torch_handle.parallel.context`); tensor-parallel ranks compute one loss
        together: only data-parallel replicas count here.
        """
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches
        mesh = self._device_mesh  # tensor- and context-parallel ranks share their replica's batch
        replicas = trainer.world_size if mesh is None else mesh[DATA_PARALLEL].size()
        return accumulate * replicas * (accumulate if trainer.strategy.handles_gradient_accumulation else 1)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A run with max_steps resumed at an epoch's end trains the right next one, on the right logging step.
        # (load_from_checkpoint calls this hook without a trainer; no loop is restored then.)
        trainer = self._trainer
        finish_saved_epoch(checkpoint, iteration_based=trainer is not None and trainer.max_steps != -1)

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
        self.log("train/objective", loss_sum.detach() / per_token, batch_size=batch_size)  # what the step minimises
        self.log("train/ppl", nll.exp(), batch_size=batch_size)
        self.log("train/tokens", tokens.float(), reduce_fx="sum", batch_size=batch_size)
        return loss

    # --- evaluation ---------------------------------------------------------------------------------------

    def _evaluate(self, batch: dict[str, Any], stage: str, decode: bool) -> None:
        """Loss, NLL and decoding metrics of one batch, accumulated over the set (logged at the epoch end).

        A batch that only evens out the batch count across ranks (``batch["repeat"]``) runs like any other,
        because sharded strategies need every rank to step together, but is not counted.
        """
        # One encoder pass for the loss and the decoding. Not on several processes: there a rank's decoding calls
        # mirror the other ranks' (dummy calls included, see ``decode_batch``), and under ZeRO-3 or FSDP each
        # encoder pass gathers parameters, so every call must run the encoder alike.
        if self._pipeline is not None:  # the loss only: decoding is refused in configure_model
            loss_sum, nll_sum, tokens = self._pipelined(batch, None)
            memory = None
        else:
            memory = self.model.encode(batch["src"]) if self.trainer.world_size == 1 else None
            loss_sum, nll_sum, tokens = self._loss(batch, memory)
        predictions = self.decode_batch(batch, memory) if decode else None
        if decode:
            self._decoded.add(stage)
        if batch.get("repeat", False):
            return
        metrics = self.eval_metrics[stage]
        per_token = tokens.clamp(min=1)
        metrics["objective"].update(loss_sum / per_token, weight=tokens)  # weighted by tokens: the corpus mean
        metrics["nll"].update(nll_sum / per_token, weight=tokens)
        references = batch.get("references", batch["tgt_text"])  # every reference of each document, when several
        if predictions is not None:
            scorer = metrics["score"]
            if isinstance(scorer, SacreBLEUScore):
                scorer.update(predictions, [[r] for r in batch["tgt_text"]])
            else:
                scorer.update(predictions, references)
            if "chrf" in metrics:
                metrics["chrf"].update(predictions, batch["tgt_text"])
        if stage == "test" and "lead" in metrics:
            metrics["lead"].update([lead(doc, self.hparams.lead_words) for doc in batch["src_text"]], references)
            if self._naive_ratio is not None:
                metrics["naive"].update([naive(doc, self._naive_ratio) for doc in batch["src_text"]], references)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        every = self.hparams.generate_every_n_val_epochs
        decode = every > 0 and (self.current_epoch + 1) % every == 0 and not self.trainer.sanity_checking
        self._evaluate(batch, "val", decode)

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test", decode=True)

    @override
    def on_validation_epoch_start(self) -> None:
        self._start_epoch("val")

    @override
    def on_test_epoch_start(self) -> None:
        self._start_epoch("test")
        if self.hparams.task == "summarization":
            self._naive_ratio = self.hparams.naive_ratio
            ratio_of = getattr(getattr(self.trainer, "datamodule", None), "summary_ratio", None)
            if self._naive_ratio is None and ratio_of is not None:
                self._naive_ratio = ratio_of()
            if self._naive_ratio is None:
                rank_zero_info(
                    "test: no naive baseline: no training file to take its ratio from; set --model.naive_ratio"
                )

    def _start_epoch(self, stage: str) -> None:
        """Fresh metric states, made under this loop's grad mode: states left by ``trainer.validate`` (inference
        mode) cannot be updated in place by the validation inside ``trainer.fit`` (no_grad)."""
        self._decoded.discard(stage)
        for metric in self.eval_metrics[stage].values():
            metric.reset()

    def _log_epoch(self, stage: str) -> None:
        """Logs the set's per-token loss (NLL) and perplexity (its exp), the smoothed objective, and BLEU and chrF or
        ROUGE (0-100).

        Every rank computes (``compute`` sums the states over ranks) and logs, also a rank whose batches were
        all repeats: ``ModelCheckpoint`` reads the monitored value on every rank.
        """
        metrics = self.eval_metrics[stage]
        nll = metrics["nll"].compute()
        self.log(f"{stage}/loss", nll.float(), prog_bar=True)
        values = {f"{stage}/ppl": nll.exp().float(), f"{stage}/objective": metrics["objective"].compute().float()}
        if stage in self._decoded:
            scores = _percent(metrics["score"].compute(), f"{stage}/")
            if "lead" in metrics:
                scores |= _percent(metrics["lead"].compute(), f"{stage}/lead_")
            if "naive" in metrics and self._naive_ratio is not None:  # the same on every rank: compute syncs
                scores |= _percent(metrics["naive"].compute(), f"{stage}/naive_")
            if "chrf" in metrics:
                scores |= _percent(metrics["chrf"].compute(), f"{stage}/", "chrf")
            values |= scores
            signatures = _signatures() if self.hparams.task == "translation" else {}
            printed = []
            for key, value in scores.items():
                name = key.removeprefix(stage + "/")
                signature = f" ({signatures[name]})" if name in signatures else ""
                printed.append(f"{name} {float(value):.2f}{signature}")
            rank_zero_info(f"{stage}: {', '.join(printed)}")
        self.log_dict(values)

    def summary(self, logged: Mapping[str, Any], stage: str = "test") -> list[str]:
        """The set's scores (0-100) as ``logged`` them (the trainer's ``callback_metrics``), one line per metric with
        how it was computed; ``test`` prints them after Lightning's table. Reads logged values only: no collective
        runs after the loop, whichever ranks print."""
        if f"{stage}/{'bleu' if self.hparams.task == 'translation' else 'rouge1'}" not in logged:
            return []
        if self.hparams.task == "translation":
            signatures = _signatures()
            return [
                f"{label} {float(logged[f'{stage}/{name}']):.2f}  (sacreBLEU {signatures[name]})"
                for name, label in (("bleu", "BLEU"), ("chrf", "chrF2"))
                if f"{stage}/{name}" in logged
            ]
        labels = {"": "model"} | baseline_labels(self.hparams.lead_words, self._naive_ratio)
        lines = [rouge_line(label, logged, f"{stage}/{prefix}") for prefix, label in labels.items()]
        return [*filter(None, lines), f"({self.eval_metrics[stage]['score'].signature})"]

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    # --- decoding -----------------------------------------------------------------------------------------

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[str]:
        return self.decode_batch(batch)

    def decode_batch(self, batch: dict[str, Any], memory: Tensor | None = None) -> list[str]:
        """Outputs for a batch; summarization documents cut by the collator are summarized hierarchically.

        ``memory`` is the encoder's output for ``batch["src"]`` when the caller has it; it is reused where the
        whole batch is decoded as it stands.

        Ranks decode different documents, so a long one takes more ``generate`` calls on one rank than a short
        batch on another; :meth:`_generate` and :meth:`_wait_for_other_ranks` keep their collectives in step.
        """
        if self.hparams.task != "summarization":
            out = self.tokenizer.decode_batch(self._generate(batch["src"], memory).tolist())
            self._wait_for_other_ranks()
            return out
        long = batch["src_truncated"]  # cut by the collator: too long for one pass
        out = [""] * len(long)
        short = [i for i, is_long in enumerate(long) if not is_long]
        if short:
            src = batch["src"][short]
            width = int((src != self.config.pad_id).sum(dim=1).max())
            if len(short) < len(long) or width < src.shape[1]:
                src, memory = src[:, :width], None  # (b, S) without shared padding: encoded anew
            for i, text in zip(short, self.tokenizer.decode_batch(self._generate(src, memory).tolist()), strict=True):
                out[i] = text
        for i in (i for i, is_long in enumerate(long) if is_long):
            out[i] = summarize(
                self.model,
                self.tokenizer,
                batch["src_text"][i],
                max_source_tokens=self.trainer.datamodule.collator.max_source_tokens,
                overlap=self.hparams.chunk_overlap,
                max_new_tokens=self.hparams.max_new_tokens,
                num_beams=self.hparams.num_beams,
                length_penalty=self.hparams.length_penalty,
                controls=self.controls,
                generate_fn=self._generate,
            )
        self._wait_for_other_ranks()
        return out

    def _all_done(self) -> Callable[[bool], bool]:
        """Maps "this rank is done" to "every rank is done": sharded strategies gather parameters inside
        forward, so every rank keeps decoding until all are done."""
        return bool if self.trainer.world_size == 1 else self.trainer.strategy.reduce_boolean_decision

    def _any_rank(self, decision: bool) -> bool:
        """Whether ``decision`` holds on any rank."""
        if self.trainer.world_size == 1:
            return decision
        return self.trainer.strategy.reduce_boolean_decision(decision, all=False)

    def _generate(self, src: Tensor, memory: Tensor | None = None) -> Tensor:
        """Beam-search ``src (B, S)``; one call of the lockstep protocol.

        Before each call every rank states whether it has one to make (a rank with none makes a dummy call
        in :meth:`_wait_for_other_ranks`), so every rank issues the same collectives and forward passes.
        """
        self._any_rank(True)
        h = self.hparams
        all_done = self._all_done()
        return generate(
            self.model, src, h.max_new_tokens, h.num_beams, h.length_penalty, all_done, memory, controls=self.controls
        )

    def _wait_for_other_ranks(self) -> None:
        """Dummy ``generate`` calls, mirroring the other ranks' real ones, until no rank has one left."""
        if self.trainer.world_size == 1:
            return
        all_done = self._all_done()
        dummy = torch.full((1, 1), self.config.eos_id, dtype=torch.long, device=self.device)  # (1, 1)
        h = self.hparams

        def done(_: bool) -> bool:
            return all_done(True)

        while self._any_rank(False):
            generate(self.model, dummy, h.max_new_tokens, h.num_beams, h.length_penalty, done, controls=self.controls)

    # --- optimisation -------------------------------------------------------------------------------------

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if self._pipeline is None:  # the pipeline's schedule ran the backward passes in training_step
            with loss_parallel():  # the backward of a loss over vocabulary-split logits; no-op for plain tensors
                super().backward(loss, *args, **kwargs)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if self._pipeline is None:  # the pipeline's training_step zeroes them before its backward passes
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._pipeline is not None:  # before clipping: the tied embedding's two copies get one gradient
            self._pipeline.sync_tied_grads()

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Under pipeline parallelism, clipping by norm takes the norm over every stage's gradients."""
        if self._pipeline is not None and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            self._pipeline.clip_grad_norm_(gradient_clip_val)
            return
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # Lightning refuses to clip for a fused optimizer under mixed precision, lest the optimizer unscale fp16
            # gradients after the clipping; bf16 has no scaler and nothing to unscale, so the plain clipping is right.
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @override
    def configure_optimizers(self) -> Any:
        groups = parameter_groups(self, self.hparams.weight_decay)
        # Fused AdamW (one kernel for every parameter) where the parameters live on a GPU and the strategy steps the
        # module's optimizer there (DeepSpeed steps its own flat partitions, on the CPU under offload), without an
        # fp16 loss scaler (the fused step would unscale the gradients after Lightning clipped them).
        fused = (
            self.device.type == "cuda"
            and not isinstance(self.trainer.strategy, DeepSpeedStrategy)
            and getattr(self.trainer.precision_plugin, "scaler", None) is None
        )
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=self.hparams.betas, fused=fused or None)
        # The number of steps is read at the first step, not here (see warmup_cosine). ``factor`` is a plain
        # function: LambdaLR keeps it out of checkpoints.
        hparams, trainer = self.hparams, self.trainer

        @functools.cache
        def total() -> int:
            return max(int(trainer.estimated_stepping_batches), 1)

        def factor(step: int) -> float:
            return warmup_cosine(step, hparams.warmup_steps, total, hparams.min_lr_ratio)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}
