"""``python -m torch_handle.export CKPT OUTPUT`` (``torch-handle export``): a training checkpoint to one safetensors
file, a CTranslate2 model folder or a Hugging Face folder."""

from __future__ import annotations

import argparse
import logging
from functools import partial
from pathlib import Path

from torch_handle.checkpoints import CheckpointError
from torch_handle.commands import typed_command
from torch_handle.ctranslate2 import ExportError
from torch_handle.export import __doc__ as EXPORT_DOC
from torch_handle.export.write import export, export_ctranslate2


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=typed_command("export"), description=EXPORT_DOC.splitlines()[0])
    parser.add_argument(
        "checkpoint",
        help="a .ckpt file, a DeepSpeed, FSDP, tensor- or pipeline-parallel checkpoint folder, or a Hugging Face "
        "model folder (ctranslate2 and hf: also a .safetensors export)",
    )
    parser.add_argument(
        "output", help="the safetensors file to write, or the CTranslate2 or Hugging Face folder to create"
    )
    parser.add_argument(
        "--format",
        choices=("safetensors", "ctranslate2", "hf"),
        default="safetensors",
        help="safetensors: one file for torch_handle.load; ctranslate2: a model folder for ctranslate2.Translator "
        "(needs pip install 'torch-handle[bench]'; an imported BART, mBART, Marian, PEGASUS or T5 v1.0 goes through "
        "CTranslate2's own converter, which needs transformers; the checkpoint may also be a .safetensors export); "
        "hf: a Hugging Face folder for transformers' from_pretrained (models of the BART, mBART, Marian, PEGASUS, "
        "T5/mT5 or LED families)",
    )
    options = parser.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from torch_handle.pretrained.reader import is_pretrained_folder  # it imports the export package
    from torch_handle.pretrained.writer import export_folder, export_hf

    write = {"ctranslate2": export_ctranslate2, "hf": export_hf}.get(options.format, export)
    try:
        if is_pretrained_folder(Path(options.checkpoint)):  # it reads the folder's index, which may be refused
            write = partial(export_folder, form=options.format)
        write(options.checkpoint, options.output)
    except (CheckpointError, ExportError) as err:
        raise SystemExit(f"error: {err}") from err


if __name__ == "__main__":
    main()
