"""``multi30k_averaging``: the Multi30k recipe with and without weight averaging on one GPU (issue 41).

One fit of the user's GPU recipe stacked with ``--config ema`` and saving every epoch's checkpoint, whose
checkpoints hold both the EMA and the trained weights; then ``bench_averaging``'s comparison: the trained weights,
the EMA and the averages of the last N epochs' trained weights on val, and test_2016_flickr once for the trained
weights, the EMA and the average chosen on val.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from gpu.recipe import GPU, timed_command, user_command
from gpu.setting import Setting, mark, result_table


def multi30k_averaging(setting: Setting, data: Path, epochs: int | None) -> dict[str, Any]:
    """The fit, then the comparison; skipped, not failed, without the data."""
    import bench_averaging

    if not (data / "train.en").is_file():
        return {
            "ok": True,
            "tables": [result_table("Weight averaging", ["result"], [[f"skipped: no {data}/train.en"]])],
        }
    last = bench_averaging.DRY_LAST if setting.dry_run else bench_averaging.LAST
    if epochs is not None and epochs < max(last):
        raise ValueError(f"--recipe-epochs {epochs}: the averages need at least {max(last)} epochs' checkpoints")
    work = Path(tempfile.mkdtemp(prefix="gpu_suite-averaging-"))
    extra = bench_averaging.DRY_EPOCHS if setting.dry_run else [f"--trainer.max_epochs={epochs}"] if epochs else []
    fit = user_command(setting, "fit", GPU, data, work / "run", bench_averaging.FIT + extra)
    seconds = timed_command(fit, work / "fit.log")
    mark(f"fit: {seconds:.0f} s")
    limit = 20 if setting.dry_run else None
    rows, chosen = bench_averaging.compare(work / "run", data, last, limit, setting.device.type)
    title = (
        f"The Multi30k GPU recipe (`--config multi30k --config multi30k_gpu {' '.join(bench_averaging.FIT)}`, "
        f"{seconds / 60:.1f} min wall): its trained weights, their EMA and the averages of the last N epochs' trained "
        "weights, sacreBLEU (13a) at the recipe's beam on val, then on test_2016_flickr once for the trained weights, "
        f"the EMA and the average chosen on val ({chosen})."
    )
    return {"ok": True, "tables": [result_table(title, bench_averaging.HEADER, rows)], "chosen": chosen}
