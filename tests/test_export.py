"""Exports load anywhere, from any checkpoint a user can make, and a bad exported file is one ``error:`` line."""

from __future__ import annotations

import dataclasses
import json
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lightning
import pytest
import torch
from conftest import tiny_config
from safetensors.torch import save_file

from tests.helpers import ROOT, env
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.export import export, load_exported

pytestmark = pytest.mark.usefixtures("single_thread")

DEMO = str(ROOT / "configs" / "demo.yaml")
TINY = tiny_config(d_model=16, d_ff=32, max_len=32)


def _python_checkpoint(folder: Path, attention_backend: str = "auto") -> Path:
    """A checkpoint as a user saves it from Python: the module's config is a ``TransformerConfig`` object, the
    tokenizer sits beside it (as the checkpoint callback writes it)."""
    from torch_handle.module import Seq2SeqModule

    tokenizer = Tokenizer.train(["one two three four five six seven eight nine ten"] * 20, vocab_size=40)
    tokenizer.save(folder / "tokenizer.json")
    module = Seq2SeqModule(TINY, vocab_size=tokenizer.vocab_size, max_new_tokens=8)
    hparams = dict(module.hparams)
    hparams["transformer"] = dataclasses.replace(TINY, attention_backend=attention_backend)
    path = folder / "model.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": 1,
            "pytorch-lightning_version": lightning.__version__,
            "state_dict": module.state_dict(),
            "hyper_parameters": hparams,
        },
        path,
    )
    return path


def _export_in_a_fresh_process(checkpoint: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch_handle.export", str(checkpoint), str(output)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_checkpoint_saved_from_python_exports_in_a_fresh_process(tmp_path: Path) -> None:
    """``python -m torch_handle.export`` never imports ``torch_handle.module``, whose import once registered the
    config class as safe to unpickle."""
    run = _export_in_a_fresh_process(_python_checkpoint(tmp_path), tmp_path / "model.safetensors")
    assert run.returncode == 0, run.stderr[-3000:]
    model, _ = load_exported(tmp_path / "model.safetensors")
    assert model.config == dataclasses.replace(TINY, src_vocab_size=model.config.src_vocab_size,
                                               tgt_vocab_size=model.config.tgt_vocab_size)  # fmt: skip


def test_an_export_of_a_model_trained_with_xformers_loads_on_a_cpu(tmp_path: Path) -> None:
    exported = export(_python_checkpoint(tmp_path, "xformers"), tmp_path / "model.safetensors")
    model, tokenizer = load_exported(exported)
    assert model.config.attention_backend == "auto"
    src = torch.tensor([tokenizer.encode("one two three")])
    model(src, torch.tensor([[TINY.bos_id]]))  # runs here, on this machine's kernel


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_init_from_reads_the_weights_once(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model.init_from``: the tokenizer (read by the CLI) and the architecture come from the checkpoint's fields,
    every read checked as a load; the weights are read once, into the model."""
    from torch_handle.export import write
    from torch_handle.module import Seq2SeqModule
    from torch_handle.pretrained import trained

    path = _python_checkpoint(tmp_path)
    state = torch.load(path)["state_dict"]
    expected = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    if kind == "export":
        path = export(path, tmp_path / "model.safetensors")
    reads: list[Path] = []

    def counted(read: Callable[[Path], object]) -> Callable[[Path], object]:
        return lambda p: reads.append(Path(p)) or read(p)

    monkeypatch.setattr(write, "_lightning_state", counted(write._lightning_state))
    monkeypatch.setattr(trained, "exported_weights", counted(trained.exported_weights))
    fill = trained.fill_exported  # an export is copied into the model a tensor at a time
    monkeypatch.setattr(trained, "fill_exported", lambda m, p, *fresh: reads.append(Path(p)) or fill(m, p, *fresh))
    tokenizer = Tokenizer.from_file(trained.init_tokenizer_path(str(path)))
    model = Seq2SeqModule(vocab_size=tokenizer.vocab_size, max_new_tokens=8, init_from=str(path)).model
    assert reads == [path]
    assert model.state_dict().keys() == expected.keys()
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=0, msg=name)


def test_an_export_that_does_not_fit_the_model_is_refused_before_a_copy(tmp_path: Path) -> None:
    from torch_handle.checkpoints import CheckpointError
    from torch_handle.export import fill_exported
    from torch_handle.model import Transformer

    path = export(_python_checkpoint(tmp_path), tmp_path / "model.safetensors")
    model = Transformer(dataclasses.replace(TINY, d_ff=48))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"^{path} does not fit the model \(.*linear1.weight has shape \["):
        fill_exported(model, path)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


# --- bad exported files: one line each, from the loaders and from cli.py predict --------------------------


def _good(path: Path) -> Path:
    return export(_python_checkpoint(path.parent), path)


def _rewrite(path: Path, change: Callable[[dict[str, str], dict[str, torch.Tensor]], None]) -> None:
    """Writes ``path`` again with its metadata and tensors changed by ``change``."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    change(metadata, tensors)
    save_file(tensors, path, metadata=metadata)


def _transformer(change: Callable[[dict], None]) -> Callable[[dict[str, str], dict], None]:
    def edit(metadata: dict[str, str], tensors: dict) -> None:
        fields = json.loads(metadata["transformer"])
        change(fields)
        metadata["transformer"] = json.dumps(fields)

    return edit


def _header_only(path: Path) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[: 8 + length + 10])  # the header survives, the tensor data does not


BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "no_format": (lambda p: _rewrite(p, lambda m, t: m.pop("format")), "not written by torch_handle.export"),
    "wrong_format": (lambda p: _rewrite(p, lambda m, t: m.update(format="x/9")), "not written by torch_handle"),
    "no_transformer": (lambda p: _rewrite(p, lambda m, t: m.pop("transformer")), "no transformer config"),
    "transformer_not_json": (lambda p: _rewrite(p, lambda m, t: m.update(transformer="{d_model:")), "not JSON"),
    "transformer_not_object": (lambda p: _rewrite(p, lambda m, t: m.update(transformer="[1]")), "no transformer"),
    "unknown_field": (lambda p: _rewrite(p, _transformer(lambda f: f.update(colour=1))), "unknown fields ['colour']"),
    "missing_field": (lambda p: _rewrite(p, _transformer(lambda f: f.pop("d_model"))), "missing ['d_model']"),
    "wrong_type": (lambda p: _rewrite(p, _transformer(lambda f: f.update(d_model="16"))), "['d_model'] have the"),
    "wrong_list": (lambda p: _rewrite(p, _transformer(lambda f: f.update(suppress_ids=["0"]))), "['suppress_ids']"),
    "bad_value": (lambda p: _rewrite(p, _transformer(lambda f: f.update(num_heads=3))), "not divisible"),
    "bad_choice": (lambda p: _rewrite(p, _transformer(lambda f: f.update(position="x"))), "['position'] have"),
    "no_tokenizer": (lambda p: _rewrite(p, lambda m, t: m.pop("tokenizer")), "no valid tokenizer"),
    "bad_tokenizer": (lambda p: _rewrite(p, lambda m, t: m.update(tokenizer='{"a": 1}')), "no valid tokenizer"),
    "missing_tensor": (lambda p: _rewrite(p, lambda m, t: t.pop("decoder_norm.bias")), "missing decoder_norm.bias"),
    "extra_tensor": (lambda p: _rewrite(p, lambda m, t: t.update(extra=torch.zeros(1))), "unexpected extra"),
    "wrong_shape": (
        lambda p: _rewrite(p, lambda m, t: t.update({"decoder_norm.bias": torch.zeros(3)})),
        "has shape [3]",
    ),
    "truncated": (_header_only, "not a safetensors file"),
    "empty": (lambda p: p.write_bytes(b""), "not a safetensors file"),
    "not_safetensors": (lambda p: p.write_text("hello"), "not a safetensors file"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_exported_file_is_one_line(case: str, tmp_path: Path) -> None:
    from torch_handle.checkpoints import CheckpointError

    path = _good(tmp_path / "model.safetensors")
    damage, message = BAD[case]
    damage(path)
    with pytest.raises(CheckpointError) as error:
        load_exported(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_export_of_a_model_with_tokens_never_generated_loads(tmp_path: Path) -> None:
    """An imported model keeps the tokens it never generates (``suppress_ids``, a list: T5's, Marian's): its export,
    whichever strategy trained it, loads."""
    path = _good(tmp_path / "model.safetensors")
    _rewrite(path, _transformer(lambda f: f.update(suppress_ids=[0, 1])))
    model, _ = load_exported(path)
    assert model.config.suppress_ids == [0, 1]


@pytest.mark.slow
def test_cli_predict_refuses_bad_exported_files_in_one_line(tmp_path: Path) -> None:
    """Every damage above, through ``cli.py predict --ckpt_path`` in one process (a subprocess per case would
    cost minutes)."""
    from torch_handle.cli import main

    sources = tmp_path / "input.txt"
    sources.write_text("one two\n")
    for case, (damage, message) in BAD.items():
        folder = tmp_path / case
        folder.mkdir()
        path = _good(folder / "model.safetensors")
        damage(path)
        args = ["predict", f"--config={DEMO}", f"--ckpt_path={path}", f"--data.init_args.predict_file={sources}"]
        with pytest.raises(SystemExit) as exit_info:
            main([*args, f"--trainer.default_root_dir={folder / 'run'}", "--trainer.accelerator=cpu"])
        text = exit_info.value.code
        assert isinstance(text, str) and text.startswith("error: ") and "\n" not in text, f"{case}: {text}"
        assert message in text, f"{case}: {text}"


def test_export_of_a_missing_checkpoint_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    from torch_handle.export.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nosuch.ckpt"), str(tmp_path / "model.safetensors")])
    assert exit_info.value.code == (
        f"error: checkpoint {tmp_path / 'nosuch.ckpt'} does not exist: pass the path of an existing checkpoint"
    )  # export takes the checkpoint as its first argument: no --ckpt_path to name
    assert list(tmp_path.iterdir()) == []


KILLED_EXPORT = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default kills, as kill -9 does
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
from torch_handle.export.__main__ import main
main(sys.argv[2:])
"""


@pytest.mark.slow
def test_the_export_after_a_killed_one_leaves_no_temporary_file(tmp_path: Path) -> None:
    """An export killed mid-write (by the kernel, at half the file's size: no handler, no ``finally`` runs) leaves
    its temporary files behind, hidden; the next export into that folder removes them."""
    checkpoint = _python_checkpoint(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    half = checkpoint.stat().st_size // 2
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(half), str(checkpoint), str(out / "model.safetensors")],
        cwd=ROOT,
        env=env(PYTHONDONTWRITEBYTECODE="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-3000:]
    left = [p.name for p in out.iterdir()]
    assert left and all(name.startswith(".") for name in left)  # the killed write's, hidden: nothing looks exported
    run = _export_in_a_fresh_process(checkpoint, out / "model.safetensors")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    load_exported(out / "model.safetensors")


def test_an_export_older_than_copy_attention_loads_without_it(tmp_path: Path) -> None:
    path = _good(tmp_path / "model.safetensors")
    _rewrite(path, _transformer(lambda f: f.pop("copy_attention")))
    model = load_exported(path)[0]
    assert not model.config.copy_attention
