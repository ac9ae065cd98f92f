"""``multi30k_averaging``: the Multi30k recipe with and without weight averaging on one GPU (issue 41).

Two fits of the user's GPU recipe (``--config multi30k --config multi30k_gpu``) side by side: one saving every
epoch's checkpoint, one stacked with ``--config ema``. Then, on the validation set, the plain run's last checkpoint,
the EMA run's (whose weights are the average), and ``torch-handle average`` of the plain run's last N checkpoints for
each N; the N with the best validation BLEU is chosen, and test_2016_flickr is scored once for each of the three.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu.recipe import GPU, user_command
from gpu.setting import ROOT, Setting, fmt, launched_env, mark, result_table

LAST = (5, 10)  # the checkpoint averages tried, fairseq's usual counts for a recipe of this length
DRY_LAST = (2, 3)
DRY_EPOCHS = ["--trainer.max_epochs=3", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]


def _fit_side_by_side(commands: dict[str, list[str]], work: Path) -> None:
    """Runs the fits at once, each writing ``work/NAME.log``; raises with the tail of the first that fails."""
    children = {}
    for name, command in commands.items():
        with (work / f"{name}.log").open("w") as log:
            children[name] = subprocess.Popen(
                command, cwd=ROOT, env=launched_env(), stdout=log, stderr=subprocess.STDOUT
            )
    while True:
        failed = next((name for name, child in children.items() if child.poll()), None)  # exited non-zero
        if failed is not None:  # the other fit would only hold the device
            for child in children.values():
                child.kill()
            tail = (work / f"{failed}.log").read_text().strip().splitlines()[-3:]
            raise RuntimeError(f"fit {failed} exited {children[failed].returncode}: {' | '.join(tail)}")
        if all(child.poll() is not None for child in children.values()):
            return
        time.sleep(1)


def _bleu(checkpoint: Path, data: Path, split: str, limit: int | None, device: str) -> tuple[float, float]:
    """Lowercased and cased sacreBLEU of ``checkpoint``'s translations of ``split``, at the recipe's beam."""
    import bench_multi30k

    import torch_handle

    sources = (data / f"{split}.en").read_text(encoding="utf-8").splitlines()[:limit]
    references = (data / f"{split}.de").read_text(encoding="utf-8").splitlines()[:limit]
    hypotheses = torch_handle.load(checkpoint, device=device).translate(sources)
    lowercased = bench_multi30k.LOWERCASED.corpus_score(hypotheses, [references]).score
    return lowercased, bench_multi30k.CASED.corpus_score(hypotheses, [references]).score


def multi30k_averaging(setting: Setting, data: Path, epochs: int | None) -> dict[str, Any]:
    """The two fits, the averages, BLEU on validation for each, then test once for the plain, EMA and chosen runs."""
    from torch_handle.average import last_checkpoints, write_average

    if not (data / "train.en").is_file():
        return {
            "ok": True,
            "tables": [result_table("Weight averaging", ["result"], [[f"skipped: no {data}/train.en"]])],
        }
    last = DRY_LAST if setting.dry_run else LAST
    if epochs is not None and epochs < max(last):
        raise ValueError(f"--recipe-epochs {epochs}: the averages need at least {max(last)} epochs' checkpoints")
    work = Path(tempfile.mkdtemp(prefix="gpu_suite-averaging-"))
    extra = DRY_EPOCHS if setting.dry_run else [f"--trainer.max_epochs={epochs}"] if epochs else []
    plain, ema = work / "plain", work / "ema"
    every_epoch = ["--checkpoint.save_top_k=-1"]  # each validation's checkpoint, for the averages of the last N
    _fit_side_by_side(
        {
            "plain": user_command(setting, "fit", GPU, data, plain, every_epoch + extra),
            "ema": user_command(setting, "fit", [*GPU, "--config", "ema"], data, ema, extra),
        },
        work,
    )
    mark("fits: done")
    candidates = {
        "last checkpoint": plain / "checkpoints" / "last.ckpt",
        "EMA (--config ema)": ema / "checkpoints" / "last.ckpt",
    }
    for n in last:
        out = plain / "checkpoints" / f"averaged-{n}.ckpt"
        write_average(last_checkpoints(plain, n), out)
        candidates[f"average of the last {n} epochs' checkpoints"] = out
    limit, device = (20 if setting.dry_run else None), setting.device.type
    val = {name: _bleu(path, data, "val", limit, device) for name, path in candidates.items()}
    mark(f"validation BLEU: {val}")
    averages = [name for name in candidates if name.startswith("average")]
    chosen = max(averages, key=lambda name: val[name][0])
    test = {name: _bleu(candidates[name], data, "test_2016_flickr", limit, device) for name in [*candidates][:2]}
    test[chosen] = _bleu(candidates[chosen], data, "test_2016_flickr", limit, device)
    rows = [
        [
            name,
            fmt(val[name][0], 2),
            fmt(val[name][1], 2),
            *(
                ("not scored (not chosen on validation)", "")
                if name not in test
                else (fmt(test[name][0], 2), fmt(test[name][1], 2))
            ),
        ]
        for name in candidates
    ]
    title = (
        "The Multi30k GPU recipe (`--config multi30k --config multi30k_gpu`), two fits side by side: one saving every "
        "epoch's checkpoint, one with `--config ema`; sacreBLEU (13a) at the recipe's beam on val, then on "
        f"test_2016_flickr once for the plain and EMA runs and for the average chosen on val ({chosen})."
    )
    header = ["weights", "val BLEU (lowercased)", "val BLEU (cased)", "test BLEU (lowercased)", "test BLEU (cased)"]
    return {"ok": True, "tables": [result_table(title, header, rows)], "chosen": chosen}
