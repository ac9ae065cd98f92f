"""Validation, test and predict for :class:`~torch_handle.module.Seq2SeqModule`: corpus metrics, and decoding that
keeps every rank's collectives in step."""

from __future__ import annotations

import dataclasses
import secrets
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor
from torchmetrics.aggregation import MeanMetric
from torchmetrics.text import SacreBLEUScore
from typing_extensions import override

from torch_handle.hierarchical import summarize
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
from torch_handle.model import Transformer, TransformerConfig, generate
from torch_handle.model.logits import DecodingControls
from torch_handle.parallel import Pipeline

# The epoch-level values logged below come from torchmetrics' compute(), already reduced over every process:
# syncing them again, as Lightning advises for a tensor logged without sync_dist, would add collectives to no effect.
warnings.filterwarnings(
    "ignore", message=r"It is recommended to use `self.log\('(val|test)/", category=PossibleUserWarning
)

BLEU_TOKENIZE = "13a"  # sacreBLEU's default tokenizer, the one WMT results are reported with


def _percent(value: Tensor | dict[str, Tensor], prefix: str, name: str = "bleu") -> dict[str, Tensor]:
    """BLEU or chrF (a tensor named ``name``) or ROUGE (a dict, given its geometric mean) on the 0-100 scale that
    sacreBLEU and papers report."""
    scores = value | {GEOMETRIC_MEAN: geometric_mean(value)} if isinstance(value, dict) else {name: value}
    return {f"{prefix}{name}": 100 * score.float() for name, score in scores.items()}


def _signatures() -> dict[str, str]:
    """sacreBLEU's signature of each translation score, printed beside it."""
    return {"bleu": bleu_signature(BLEU_TOKENIZE), "chrf": chrf_signature()}


class Evaluation(L.LightningModule):
    """The evaluation half of :class:`~torch_handle.module.Seq2SeqModule`, which builds what is declared here and
    computes the loss (``_loss``, ``_pipelined``); its ``__init__`` documents the options read from ``hparams``."""

    model: Transformer
    config: TransformerConfig
    controls: DecodingControls
    _loop_controls: DecodingControls | None = None
    eval_metrics: torch.nn.ModuleDict
    _pipeline: Pipeline | None
    _decoded: set[str]
    _naive_ratio: float | None
    chunk_overlap: int  # hparams' chunk_overlap, fitted in setup to the data's windows
    _loss: Callable[..., tuple[Tensor, Tensor, Tensor]]
    _pipelined: Callable[..., tuple[Tensor, Tensor, Tensor]]

    @property
    def decoding_controls(self) -> DecodingControls:
        """The controls of the running loop (:meth:`_share_seed`), else the configured ones."""
        return self._loop_controls or self.controls

    def _share_seed(self) -> None:
        """Sampling without ``--model.seed`` draws a fresh seed; processes that decode one source together (tensor
        or context parallelism, lockstep) must draw the same tokens, so rank 0 draws one for the loop and every rank
        takes it. A source's draws still depend on its own tokens, so data-parallel ranks sample their rows apart."""
        c = self.controls
        self._loop_controls = None
        if c.do_sample and c.seed is None and self.trainer.world_size > 1:
            seed = self.trainer.strategy.broadcast(secrets.randbits(62), src=0)
            self._loop_controls = dataclasses.replace(c, seed=seed)

    @property
    def tokenizer(self) -> Any:
        """The data module's tokenizer: it decodes exactly as the data was encoded."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None or not hasattr(datamodule, "tokenizer"):
            raise RuntimeError("decoding needs a data module with a tokenizer: pass datamodule= to the Trainer")
        return datamodule.tokenizer

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
            data = getattr(self.trainer, "datamodule", None)
            ratio_of = getattr(data, "summary_ratio", None)
            if self._naive_ratio is None and ratio_of is not None:
                self._naive_ratio = ratio_of()
            if self._naive_ratio is None:
                train = (getattr(data, "files", None) or {}).get("train")
                missing = f" ({train} does not exist)" if train else ""
                rank_zero_info(
                    f"test: no naive baseline: no training file to take its ratio from{missing}; set "
                    "--model.naive_ratio"
                )

    def _start_epoch(self, stage: str) -> None:
        """Fresh metric states, made under this loop's grad mode: states left by ``trainer.validate`` (inference
        mode) cannot be updated in place by the validation inside ``trainer.fit`` (no_grad)."""
        self._decoded.discard(stage)
        self._share_seed()
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
        model = "model" if self.hparams.long_documents == "windows" else "model (long documents cut)"
        labels = {"": model} | baseline_labels(self.hparams.lead_words, self._naive_ratio)
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
    @override
    def on_predict_epoch_start(self) -> None:
        self._share_seed()

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
        if self.hparams.long_documents == "cut":  # decoded as the collator cut them, as training reads them
            long = [False] * len(long)
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
                overlap=self.chunk_overlap,  # fitted to the windows in setup
                max_new_tokens=self.hparams.max_new_tokens,
                num_beams=self.hparams.num_beams,
                length_penalty=self.hparams.length_penalty,
                controls=self.decoding_controls,
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
            self.model,
            src,
            h.max_new_tokens,
            h.num_beams,
            h.length_penalty,
            all_done,
            memory,
            controls=self.decoding_controls,
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
            generate(
                self.model,
                dummy,
                h.max_new_tokens,
                h.num_beams,
                h.length_penalty,
                done,
                controls=self.decoding_controls,
            )
