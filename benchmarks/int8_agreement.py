"""How far int8 decoding (``torch_handle.load(..., quantize="int8")``) moves a trained model's outputs from fp32's.

Translates ``--source`` with the model at ``--checkpoint`` (anything ``torch_handle.load`` reads) in fp32 and in int8,
greedy and beam (the model's own beam width), and prints a markdown table: sentences identical to fp32's, BLEU of
the int8 outputs against the fp32 ones, and, with ``--reference``, each one's BLEU (sacrebleu 13a, cased) against it.
With ``--compile``, int8 decodes as ``load(..., quantize="int8", compile=True)`` makes it: its step compiled, with
``torchao``'s int8 weights.

    python benchmarks/int8_agreement.py --checkpoint runs/multi30k --source data/multi30k/test_2016_flickr.en \\
        --reference data/multi30k/test_2016_flickr.de
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import markdown_table
from sacrebleu.metrics import BLEU

import torch_handle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="what torch_handle.load reads: an export, a .ckpt, a run")
    parser.add_argument("--source", type=Path, required=True, help="one sentence a line")
    parser.add_argument("--reference", type=Path, help="its translations, one a line: BLEU of each output")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--compile", action="store_true", help="int8 with compile=True: its step compiled")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sources = args.source.read_text(encoding="utf-8").splitlines()
    references = args.reference.read_text(encoding="utf-8").splitlines() if args.reference else None
    fp32 = torch_handle.load(args.checkpoint)
    int8 = torch_handle.load(args.checkpoint, quantize="int8", compile=args.compile)
    header = ["decoding", "identical to fp32", "BLEU int8 vs fp32", "BLEU fp32", "BLEU int8", "s fp32 / int8"]
    rows = []
    for beams in (1, fp32.decoding.num_beams):
        outputs, seconds = [], []
        for model in (fp32, int8):
            start = time.perf_counter()
            outputs.append(model.translate(sources, num_beams=beams))
            seconds.append(time.perf_counter() - start)
        same = sum(a == b for a, b in zip(*outputs, strict=True))
        scores = [f"{BLEU().corpus_score(out, [references]).score:.2f}" if references else "-" for out in outputs]
        label = ("greedy" if beams == 1 else f"beam {beams}") + (", int8 compiled" if args.compile else "")
        rows.append(
            [
                label,
                f"{same}/{len(sources)}",
                f"{BLEU().corpus_score(outputs[1], [outputs[0]]).score:.2f}",
                *scores,
                f"{seconds[0]:.1f} / {seconds[1]:.1f}",
            ]
        )
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
