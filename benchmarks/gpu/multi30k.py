"""``multi30k``: the shipped Multi30k recipe in ``bf16-mixed`` for a minute, then its test BLEU."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from gpu.setting import Setting, mark, result_table


def multi30k(setting: Setting, data: Path, epochs: int) -> dict[str, Any]:
    """The shipped Multi30k recipe (``configs/multi30k.yaml``) trained in ``bf16-mixed``, then BLEU on its test sets
    (``bench_multi30k``'s fit and score). Skipped, not failed, without the data (``torch-handle prepare multi30k``)."""
    import bench_multi30k

    if not (data / "train.en").is_file():
        return {"ok": True, "tables": [result_table("Multi30k", ["result"], [[f"skipped: no {data}/train.en"]])]}
    run = Path(tempfile.mkdtemp(prefix="gpu_suite-multi30k-"))
    extra = [f"--trainer.max_epochs={epochs}", f"--trainer.precision={setting.precision}"]
    extra += [
        f"--trainer.accelerator={setting.accelerator}",
        "--trainer.devices=1",
        "--trainer.enable_progress_bar=false",
    ]
    # Beside the other side-by-side steps (strategies is the longest), so that the suite fits its 9 minutes:
    # Lightning's max_time stops the fit after one minute and the last checkpoint is scored (its BLEU and times:
    # benchmarks/RESULTS.md, section "GPU suite").
    extra += bench_multi30k.DRY_RUN if setting.dry_run else ["--trainer.max_time=00:00:01:00"]
    seconds = bench_multi30k.fit(data, run, torch.get_num_threads(), extra)
    mark(f"fit: {seconds:.0f} s")
    rows = bench_multi30k.score(run, data, 20 if setting.dry_run else None, device=setting.device.type)
    last = torch.load(next(run.rglob("last.ckpt")), map_location="cpu", weights_only=True, mmap=True)
    trained = f"{last['global_step']} steps ({last['epoch'] + 1} of {epochs} epochs begun)"
    title = (
        f"`configs/multi30k.yaml` for {trained} in `{setting.precision}` on one device, beside the other "
        f"side-by-side steps: {seconds / 60:.1f} min "
        f"wall for the fit (start-up and tokenizer training included); beam search on the last checkpoint. "
        f"sacreBLEU `{bench_multi30k.CASED.get_signature().format()}`, lowercased, and the literature's BLEU on "
        "`lc.norm.tok` text (`bench_multi30k.py`)."
    )
    return {"ok": True, "tables": [result_table(title, bench_multi30k.HEADER, rows)]}
