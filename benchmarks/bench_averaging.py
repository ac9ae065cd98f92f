"""Weight averaging on the full Multi30k recipe (issue 41): the trained weights, their EMA, and fairseq's average of
the last N epochs' checkpoints, chosen on val and scored once on test_2016_flickr.

    python benchmarks/bench_averaging.py --data data/multi30k                  # fit (timed), then score
    python benchmarks/bench_averaging.py --data data/multi30k --no-fit         # score the run in --run
    python benchmarks/bench_averaging.py --data DIR --dry-run                  # tiny model, 3 epochs, no write

One fit gives every candidate: ``torch-handle fit --config multi30k --config ema --checkpoint.save_top_k=-1``. Its
checkpoints hold the EMA as their weights and the trained weights as ``current_model_state`` (Lightning's
``WeightAveraging``). Those are the weights of the same fit without ``--config ema`` (on a GPU, up to the
nondeterminism between any two fits): the EMA only reads them, validation swaps them back exactly, and nothing that
trains reads the validation loss. The candidates: the last checkpoint's trained weights, its EMA, and
``torch-handle average --trained`` of the last N epochs' checkpoints for each N. Validation BLEU chooses N;
test_2016_flickr is scored once for the trained weights, the EMA and the chosen average.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_multi30k  # noqa: E402
from common import machine_line, markdown_table  # noqa: E402

log = logging.getLogger(__name__)

SECTION = "multi30k_averaging"
FIT = ["--config", "ema", "--checkpoint.save_top_k=-1"]  # stacked on the recipe: EMA, and every epoch's checkpoint
LAST = (5, 10)  # the counts fairseq's translation recipes average
DRY_LAST = (2, 3)
DRY_EPOCHS = ["--trainer.max_epochs=3", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
TRAINED_ROW, EMA_ROW = "trained weights (last checkpoint)", "EMA (--config ema)"
HEADER = ["weights", "val BLEU (lowercased)", "val BLEU (cased)", "test BLEU (lowercased)", "test BLEU (cased)"]


def _bleu(checkpoint: Path, data: Path, split: str, limit: int | None, device: str) -> tuple[float, float]:
    """Lowercased and cased sacreBLEU (13a) of ``checkpoint``'s translations of ``split`` at the recipe's beam."""
    import torch_handle

    sources = (data / f"{split}.en").read_text(encoding="utf-8").splitlines()[:limit]
    references = (data / f"{split}.de").read_text(encoding="utf-8").splitlines()[:limit]
    hypotheses = torch_handle.load(checkpoint, device=device).translate(sources)
    lowercased = bench_multi30k.LOWERCASED.corpus_score(hypotheses, [references]).score
    return lowercased, bench_multi30k.CASED.corpus_score(hypotheses, [references]).score


def compare(
    run: Path, data: Path, last: tuple[int, ...], limit: int | None, device: str
) -> tuple[list[list[str]], str]:
    """The table's rows (val for every candidate, test for three) and the average chosen on val."""
    from torch_handle.average import TRAINED, last_checkpoints, write_average

    newest = last_checkpoints(run / "checkpoints", max(last))
    trained = run / "checkpoints" / "trained"  # a subfolder: no input of a later `average --last`
    candidates = {TRAINED_ROW: write_average(newest[-1:], trained / "last.ckpt", TRAINED), EMA_ROW: newest[-1]}
    for n in last:
        out = trained / f"averaged-{n}.ckpt"
        candidates[f"average of the last {n} epochs' trained weights"] = write_average(newest[-n:], out, TRAINED)
    val = {name: _bleu(path, data, "val", limit, device) for name, path in candidates.items()}
    log.info("val BLEU (lowercased, cased): %s", val)
    chosen = max((name for name in candidates if name.startswith("average")), key=lambda name: val[name][0])
    test = {
        name: _bleu(candidates[name], data, "test_2016_flickr", limit, device)
        for name in (TRAINED_ROW, EMA_ROW, chosen)
    }
    rows = [
        [name, f"{val[name][0]:.2f}", f"{val[name][1]:.2f}"]
        + ([f"{test[name][0]:.2f}", f"{test[name][1]:.2f}"] if name in test else ["not scored (not chosen)", ""])
        for name in candidates
    ]
    return rows, chosen


def main(argv: list[str] | None = None) -> None:
    options = bench_multi30k.recipe_options(__doc__, "runs/multi30k_averaging", argv)
    machine = machine_line(options.threads, torch.__version__)
    tiny = [arg for arg in bench_multi30k.DRY_RUN if not arg.startswith("--trainer.")]  # the model, not the steps
    seconds, how = bench_multi30k.training_time(options, FIT + ([*tiny, *DRY_EPOCHS] if options.dry_run else []))
    start = time.perf_counter()
    last = DRY_LAST if options.dry_run else LAST
    rows, chosen = compare(options.run, options.data, last, 20 if options.dry_run else None, "cpu")
    section = "\n\n".join(
        [
            "## Multi30k En-De: weight averaging on the full recipe",
            machine,
            f"Command: `torch-handle fit --config multi30k {' '.join(FIT)}`, {seconds / 60:.1f} min ({how}), "
            f"`{options.run}`; scoring {(time.perf_counter() - start) / 60:.1f} min. sacreBLEU (13a) at the recipe's "
            f"beam on val for every candidate, then on test_2016_flickr once for the trained "
            f"weights, the EMA and the average chosen on val: {chosen}.",
            markdown_table(HEADER, rows),
        ]
    )
    bench_multi30k.publish(options, SECTION, section)


if __name__ == "__main__":
    main()
