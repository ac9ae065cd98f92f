"""Multi30k En-De with the shipped recipe: BLEU on the official test sets, sacreBLEU and the literature's
tokenized lowercased BLEU side by side, with the training wall time.

    torch-handle prepare multi30k --out data
    python benchmarks/bench_multi30k.py --data data/multi30k                  # fit (timed), then score
    python benchmarks/bench_multi30k.py --data data/multi30k --no-fit         # score the run in --run
    python benchmarks/bench_multi30k.py --data DIR --dry-run                  # tiny model, a few steps, no write

Training is ``torch-handle fit --config multi30k`` (configs/multi30k.yaml) in a child process, timed from start to
exit. With ``--no-fit`` the training time is read from the run's TensorBoard log (first to last event: it leaves
out start-up and tokenizer training). Scoring decodes each test set with ``torch_handle.load(run).translate`` at
the recipe's beam, on the last checkpoint, and scores it three ways: sacreBLEU (13a) cased and lowercased, and the
literature's BLEU, which the published figures report (fairseq ``transformer_tiny``: 41.0 on test_2016_flickr):
hypotheses and references both put through the Multi30k repository's ``lc.norm.tok`` pipeline
(``scripts/task1-tokenize.sh``: lowercase, Moses punctuation normalisation, Moses tokenizer, here sacremoses',
which reproduces the repository's test_2016_flickr ``.lc.norm.tok.de`` file line for line), then corpus BLEU on
those tokens as multi-bleu.perl counts it (no further tokenization, no smoothing).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from sacrebleu.metrics import BLEU
from sacremoses import MosesPunctNormalizer, MosesTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, write_section  # noqa: E402

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SECTION = "multi30k"
SPLITS = ("test_2016_flickr", "test_2017_flickr", "test_2018_flickr", "test_2017_mscoco")
PUBLISHED = {"test_2016_flickr": "41.0"}  # fairseq transformer_tiny, lowercased tokenized BLEU
CASED, LOWERCASED = BLEU(), BLEU(lowercase=True)
TOKENIZED = BLEU(tokenize="none", smooth_method="none", force=True)  # multi-bleu.perl on lc.norm.tok text
HEADER = [
    "test set", "sentences", "BLEU (cased, 13a)", "BLEU (lowercased, 13a)", "BLEU (lc.norm.tok, the literature's)",
    "published (lc.norm.tok)", "sentences/s",
]  # fmt: skip
DRY_RUN = [
    "--model.transformer.d_model=32", "--model.transformer.num_heads=2", "--model.transformer.num_encoder_layers=1",
    "--model.transformer.num_decoder_layers=1", "--model.transformer.d_ff=64", "--model.max_new_tokens=16",
    "--data.init_args.bpe_vocab_size=300", "--trainer.max_steps=3", "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
]  # fmt: skip


def fit(data: Path, run: Path, threads: int, extra: list[str]) -> float:
    """Trains the recipe in a child process; returns its wall time in seconds."""
    command = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", "multi30k"]
    command += [f"--data.init_args.data_dir={data}", f"--trainer.default_root_dir={run}", *extra]
    log.info("%s", " ".join(command))
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - start


def logged_training_seconds(run: Path) -> float:
    """First to last event of the run's TensorBoard logs (a fit timed elsewhere, or resumed)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    times = []
    for events in run.glob("lightning_logs/version_*/events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        times += [event.wall_time for tag in accumulator.Tags()["scalars"] for event in accumulator.Scalars(tag)]
    if not times:
        raise SystemExit(f"error: no logged scalars under {run}/lightning_logs: pass a run folder that fit wrote")
    return max(times) - min(times)


def lc_norm_tok(lines: list[str], language: str = "de") -> list[str]:
    """The Multi30k repository's ``lc.norm.tok`` text: lowercased, punctuation normalised, Moses-tokenized."""
    normalizer, tokenizer = MosesPunctNormalizer(language), MosesTokenizer(language)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True) for line in lines]


def score(run: Path, data: Path, limit: int | None, device: str = "cpu") -> list[list[object]]:
    import torch_handle

    model = torch_handle.load(run, device=device)
    rows = []
    for split in SPLITS:
        source, reference = data / f"{split}.en", data / f"{split}.de"
        if not (source.is_file() and reference.is_file()):
            log.info("%s: no %s.en/.de in %s, skipped", split, split, data)
            continue
        sources = source.read_text(encoding="utf-8").splitlines()[:limit]
        references = reference.read_text(encoding="utf-8").splitlines()[:limit]
        start = time.perf_counter()
        hypotheses = model.translate(sources)
        seconds = time.perf_counter() - start
        cased = CASED.corpus_score(hypotheses, [references])
        lowercased = LOWERCASED.corpus_score(hypotheses, [references])
        tokenized = TOKENIZED.corpus_score(lc_norm_tok(hypotheses), [lc_norm_tok(references)])
        rows.append(
            [
                split,
                len(sources),
                f"{cased.score:.1f}",
                f"{lowercased.score:.1f}",
                f"{tokenized.score:.1f}",
                PUBLISHED.get(split, "-"),
                f"{len(sources) / seconds:.1f}",
            ]
        )
        log.info(
            "%s: BLEU %.2f, lowercased %.2f, lc.norm.tok %.2f (%.0f s)",
            split, cased.score, lowercased.score, tokenized.score, seconds,
        )  # fmt: skip
    return rows


def recipe_options(description: str, run: str, argv: list[str] | None) -> argparse.Namespace:
    """The options of a benchmark of the recipe's run (this one's, ``bench_averaging``'s), parsed; sets the threads."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/multi30k"), help="torch-handle prepare's folder")
    parser.add_argument("--run", type=Path, default=Path(run), help="the run folder to write or score")
    parser.add_argument("--no-fit", action="store_true", help="score the existing run in --run")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, a few steps, 20 sentences; no write")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing RESULTS.md")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(options.threads)
    return options


def training_time(options: argparse.Namespace, extra: list[str]) -> tuple[float, str]:
    """Fits the recipe with ``extra`` and times it, or with ``--no-fit`` reads the run's time: seconds, and how."""
    if options.no_fit:
        return logged_training_seconds(options.run), "first to last TensorBoard event of the run"
    return fit(options.data, options.run, options.threads, extra), "wall"


def publish(options: argparse.Namespace, name: str, section: str) -> None:
    """Writes ``section`` into RESULTS.md as section ``name``, or prints it (a dry run, ``--no-write``)."""
    if options.dry_run or options.no_write:
        print(section)
    else:
        write_section(name, section)
        log.info("wrote the %s section of benchmarks/RESULTS.md", name)


def main(argv: list[str] | None = None) -> None:
    options = recipe_options(__doc__, "runs/multi30k", argv)
    machine = machine_line(options.threads, torch.__version__)
    seconds, how = training_time(options, DRY_RUN if options.dry_run else [])
    rows = score(options.run, options.data, 20 if options.dry_run else None)
    section = "\n\n".join(
        [
            "## Multi30k En-De: the shipped recipe (`configs/multi30k.yaml`)",
            machine,
            f"Training: {seconds / 60:.1f} min ({how}), `{options.run}`; beam search on the last checkpoint.",
            markdown_table(HEADER, rows),
            f"sacreBLEU signatures: `{CASED.get_signature().format()}`, `{LOWERCASED.get_signature().format()}`, "
            f"`{TOKENIZED.get_signature().format()}` (on `lc.norm.tok` text).",
        ]
    )
    publish(options, SECTION, section)


if __name__ == "__main__":
    main()
