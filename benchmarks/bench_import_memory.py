"""Peak memory of importing a Hugging Face folder: ours (``torch_handle.pretrained``) against transformers'
``from_pretrained``, each in a child process of its own.

    python benchmarks/bench_import_memory.py                  # a BART-base-sized model, random weights
    python benchmarks/bench_import_memory.py --layers 2 --d-model 256 --vocab 8000   # a quick check

The same model is also exported as our own safetensors file and read back by ``torch_handle.load`` (a tensor at a
time into an unwritten model), beside the way it was read before: a randomly initialized model, then
``load_state_dict`` of the whole file.

The parent saves one model with ``save_pretrained``, once as a single ``model.safetensors`` and once in shards of
``--shard-mb``; each child imports its libraries, notes its resident memory, loads the folder, reads every parameter
(so that lazily mapped pages count too), then prints its peak resident memory (``VmHWM``) over that baseline and the
resident memory left. The figure the issue asks for is the peak over the weight files' bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, peak_rss_bytes, rss_bytes, run_child  # noqa: E402


def child(which: str, folder: Path) -> None:
    import torch

    if which == "ours":
        from torch_handle.export import empty_model
        from torch_handle.pretrained import fill, pretrained_config
        from torch_handle.pretrained.reader import read_weights

        base = rss_bytes()
        model = empty_model(pretrained_config(folder)[0])  # what load_pretrained does, its tokenizer aside
        fill(model, read_weights(folder), str(folder))
    elif which == "export":
        import torch_handle

        base = rss_bytes()
        model = torch_handle.load(folder / "model.safetensors").model
    elif which == "export, whole file":
        from torch_handle.export import exported_metadata, exported_weights
        from torch_handle.model import Transformer

        base = rss_bytes()
        model = Transformer(exported_metadata(folder / "model.safetensors")[0])
        model.load_state_dict(exported_weights(folder / "model.safetensors"), strict=True)
    else:
        import transformers

        base = rss_bytes()
        model = transformers.BartForConditionalGeneration.from_pretrained(folder)
    with torch.no_grad():
        checksum = sum(float(p.sum()) for p in model.parameters())  # every page resident
    held = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(json.dumps({"peak": peak_rss_bytes() - base, "after": rss_bytes() - base, "weights": held, "sum": checksum}))


def save_export(hf_folder: Path, folder: Path) -> None:
    """The imported model of ``hf_folder`` as our own export, ``folder/model.safetensors`` (with a small trained
    tokenizer: the folder holds none, and the memory is the weights')."""
    from torch_handle.data.tokenizer import Tokenizer
    from torch_handle.export import Decoding, empty_model
    from torch_handle.export.write import write_exported
    from torch_handle.pretrained import fill, pretrained_config
    from torch_handle.pretrained.reader import read_weights

    model = empty_model(pretrained_config(hf_folder)[0])
    fill(model, read_weights(hf_folder), str(hf_folder))
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}  # tied ones stored apart
    folder.mkdir()
    tokenizer = Tokenizer.train(["a small text to train a tokenizer on"] * 4, 300).to_str()
    write_exported(weights, model.config, tokenizer, Decoding(), folder / "model.safetensors")


def save(folder: Path, options: argparse.Namespace, shard: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=options.vocab, d_model=options.d_model, encoder_layers=options.layers,
        decoder_layers=options.layers, encoder_attention_heads=options.d_model // 64,
        decoder_attention_heads=options.d_model // 64, encoder_ffn_dim=4 * options.d_model,
        decoder_ffn_dim=4 * options.d_model, max_position_embeddings=1024,
    )  # fmt: skip
    transformers.BartForConditionalGeneration(config).save_pretrained(folder, max_shard_size=shard)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6, help="encoder and decoder layers (BART-base: 6)")
    parser.add_argument("--d-model", type=int, default=768, help="model width (BART-base: 768)")
    parser.add_argument("--vocab", type=int, default=50265, help="vocabulary (BART-base: 50,265)")
    parser.add_argument("--shard-mb", type=int, default=200, help="shard size of the sharded folder")
    parser.add_argument("--child", nargs=2, metavar=("WHICH", "FOLDER"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(options.child[0], Path(options.child[1]))
        return
    rows = []
    with tempfile.TemporaryDirectory() as work:
        cases = [("one file", "100GB", ("ours", "transformers"))]
        cases += [(f"shards of {options.shard_mb} MB", f"{options.shard_mb}MB", ("ours", "transformers"))]
        cases += [("our export", "", ("export", "export, whole file"))]
        for layout, shard, loaders in cases:
            folder = Path(work) / layout.replace(" ", "-")
            if shard:
                save(folder, options, shard)
            else:
                save_export(Path(work) / "one-file", folder)
            for which in loaders:
                r = run_child(__file__, ["--child", which, str(folder)])
                mib = 2**20
                rows.append([
                    layout, which, f"{r['weights'] / mib:,.0f}", f"{r['peak'] / mib:,.0f}", f"{r['after'] / mib:,.0f}",
                    f"{r['peak'] / r['weights']:.2f}",
                ])  # fmt: skip
    print(machine_line(1, __import__("torch").__version__))
    header = ["folder", "loader", "weights (MiB)", "peak over baseline (MiB)", "resident after (MiB)", "peak / weights"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
