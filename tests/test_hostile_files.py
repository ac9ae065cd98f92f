"""Hostile and damaged checkpoint files against every entry point that reads one.

A generator plants a payload (unpickled, it creates a marker file) in every file shape an unpickler could meet: a
legacy-format pickle with a valid ``torch.save`` archive appended (a polyglot), a legacy-format ``torch.save``, a
bare pickle, an archive that pickles the payload; in a Lightning ``.ckpt``, in a ZeRO-2 folder's model states and
optimizer shard, in an FSDP (torch.distributed.checkpoint) folder's bytes item, ``meta.pt`` and ``.metadata``. Every
entry point refuses each in one line and the marker never appears; with the pre-check switched off, the loader-level
guard alone still stops every payload. Damaged folders are named damaged, not hostile, and an export whose config
claims a huge model is refused before anything of that size is built.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import tiny_config
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import torch_handle
from tests.helpers import check, cli, fit_args
from tests.one_process import cli_commands
from torch_handle import checkpoints, export
from torch_handle.checkpoints import CheckpointError, check_checkpoint
from torch_handle.export import exported as reading
from torch_handle.export import write
from torch_handle.export.__main__ import main as export_main
from torch_handle.module import Seq2SeqModule
from torch_handle.strategies import deepspeed, folders, fsdp, model_parallel

ZERO = "checkpoints/last.ckpt/checkpoint"
BYTES_ITEM = "a bytes item of checkpoints/last.ckpt/.metadata"
METADATA = "checkpoints/last.ckpt/.metadata"


class Payload:
    """Creates ``marker`` when unpickled (``builtins.open``, never a shell): what an attacker plants."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def _saved(obj: object, legacy: bool = False) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


SHAPES: dict[str, Callable[[bytes, Path], bytes]] = {
    "polyglot": lambda original, marker: _saved(Payload(marker), legacy=True) + original,
    "legacy": lambda original, marker: _saved({"state_dict": {}, "payload": Payload(marker)}, legacy=True),
    "bare_pickle": lambda original, marker: pickle.dumps(Payload(marker)),
    "pickled_payload": lambda original, marker: _saved({"state_dict": {}, "payload": Payload(marker)}),
}
"""Hostile file contents, from the bytes of the file (or item) they replace and the marker path."""

TARGETS = {
    "ckpt": ["checkpoints/last.ckpt"],
    "zero2": [f"{ZERO}/zero_pp_rank_0_mp_rank_00_optim_states.pt", f"{ZERO}/mp_rank_00_model_states.pt"],
    "fsdp": [BYTES_ITEM, "checkpoints/last.ckpt/meta.pt"],
}
CASES = [
    pytest.param(kind, target, shape, marks=[] if kind == "ckpt" else [pytest.mark.slow])  # folders: a training run
    for kind, targets in TARGETS.items()
    for target in targets
    for shape in SHAPES
]
CASES.append(pytest.param("fsdp", METADATA, "pickled_payload", marks=pytest.mark.slow))


@pytest.fixture(scope="module")
def bases(tiny_demo_run: Path, tmp_path_factory: pytest.TempPathFactory) -> _Bases:
    """Run folders of a tiny model as each strategy writes them: a ``.ckpt`` (one device), a ZeRO-2 folder and an
    FSDP sharded folder (each strategy on one CPU process, trained on first use: those cases are ``slow``)."""
    return _Bases(tiny_demo_run, tmp_path_factory.mktemp("bases"))


class _Bases(dict):
    def __init__(self, ckpt: Path, root: Path) -> None:
        super().__init__(ckpt=ckpt)
        self.root = root

    def __missing__(self, kind: str) -> Path:
        self[kind] = self.root / kind
        config = ["--config", f"configs/{kind}.yaml", "--trainer.devices", "1", "--trainer.max_steps", "2"]
        check(cli(fit_args(self[kind], *config)))
        return self[kind]


def plant(base: Path, target: str, shape: str, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the run folder ``base`` with ``target`` made hostile: (run folder, its checkpoint, the marker)."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(base, run, ignore=shutil.ignore_patterns(".lock"))
    ckpt = run / "checkpoints" / "last.ckpt"
    if target == METADATA:
        metadata = pickle.loads((run / target).read_bytes())
        metadata.planner_data = Payload(marker)
        (run / target).write_bytes(pickle.dumps(metadata))
    elif target == BYTES_ITEM:
        _plant_in_bytes_item(ckpt, shape, marker)
    else:
        (run / target).write_bytes(SHAPES[shape]((run / target).read_bytes(), marker))
    return run, ckpt, marker


def _plant_in_bytes_item(folder: Path, shape: str, marker: Path) -> None:
    """Points the first bytes item of a torch.distributed.checkpoint folder (an optimizer hyperparameter) at a
    hostile blob appended to its shard, as an attacker edits ``.metadata``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((folder / ".metadata").read_bytes())
    index, info = next(
        (index, info)
        for index, info in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
    )
    shard = folder / info.relative_path
    with shard.open("rb") as f:
        f.seek(info.offset)
        blob = SHAPES[shape](f.read(info.length), marker)
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(blob)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _one_line(message: str, path: Path) -> None:
    assert "\n" not in message and str(path) in message, message


def _check(ckpt: Path, tmp_path: Path) -> str:
    with pytest.raises(CheckpointError) as error:
        check_checkpoint(ckpt)
    return str(error.value)


def _load(ckpt: Path, tmp_path: Path) -> str:
    with pytest.raises(CheckpointError) as error:
        torch_handle.load(ckpt)
    return str(error.value)


def _export(ckpt: Path, tmp_path: Path) -> str:
    with pytest.raises(SystemExit) as error:
        export_main([str(ckpt), str(tmp_path / "out.safetensors")])
    assert not (tmp_path / "out.safetensors").exists()
    message = str(error.value.code)
    assert message.startswith("error: "), message
    return message


def _load_from_checkpoint(ckpt: Path, tmp_path: Path) -> str:
    with pytest.raises(CheckpointError) as error:
        Seq2SeqModule.load_from_checkpoint(ckpt)
    return str(error.value)


def _trainer(ckpt: Path, tmp_path: Path) -> str:
    """A notebook's ``trainer.validate(..., ckpt_path=...)``, without the Checkpoint callback (nor any command)."""
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(CheckpointError) as error:
        trainer.validate(Seq2SeqModule(tiny_config()), dataloaders=DataLoader([]), ckpt_path=ckpt)
    return str(error.value)


ENTRY_POINTS = {
    "check_checkpoint": _check,
    "load": _load,
    "export": _export,
    "load_from_checkpoint": _load_from_checkpoint,
    "trainer": _trainer,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("kind", "target", "shape"), CASES)
def test_a_hostile_file_is_refused_in_one_line_and_runs_nothing(
    bases: _Bases, kind: str, target: str, shape: str, entry: str, tmp_path: Path
) -> None:
    _, ckpt, marker = plant(bases[kind], target, shape, tmp_path)
    message = ENTRY_POINTS[entry](ckpt, tmp_path)
    assert not marker.exists(), "the payload ran"
    _one_line(message, ckpt)
    assert "could run code" in message or "not a torch.save archive" in message, message


@pytest.mark.parametrize(("kind", "target", "shape"), CASES)
def test_the_loader_guard_alone_stops_every_payload(
    bases: _Bases, kind: str, target: str, shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With :func:`check_checkpoint` switched off, what reaches DeepSpeed's and torch.distributed.checkpoint's
    unpicklers is hostile; they load under ``unpickling_only_data`` and refuse it."""
    for module in (checkpoints, write, deepspeed, folders, fsdp, model_parallel):  # every caller of the check
        monkeypatch.setattr(module, "check_checkpoint", Path)
    _, ckpt, marker = plant(bases[kind], target, shape, tmp_path)
    with pytest.raises((CheckpointError, RuntimeError)) as error:
        export.read_model(ckpt)
    assert not marker.exists(), "the payload ran"
    if error.type is RuntimeError:  # DeepSpeed maps optimizer shards: torch.load refuses a non-archive unread
        assert "mmap can only be used with files saved with" in str(error.value) and "optim_states" in target
        return
    _one_line(str(error.value), ckpt)
    assert "weights-only loading refuses" in str(error.value)


COMMANDS = {
    "export": lambda run, ckpt, kind: ["export", str(ckpt), str(run / "out.safetensors")],
    "test": lambda run, ckpt, kind: ["test", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(run)],
    "validate": lambda run, ckpt, kind: ["validate", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(run)],
    "predict": lambda run, ckpt, kind: [
        "predict",
        "--ckpt_path",
        str(ckpt),
        "--trainer.default_root_dir",
        str(run),
        "--data.init_args.predict_file",
        str(run / "checkpoints" / "transformer.json"),
    ],  # fmt: skip
    "fit": lambda run, ckpt, kind: fit_args(
        run,
        *([] if kind == "ckpt" else ["--config", f"configs/{kind}.yaml", "--trainer.devices", "1"]),
        "--ckpt_path",
        "last",
    ),  # fmt: skip
}


POLYGLOTS = [(kind, targets[0]) for kind, targets in TARGETS.items()]
Refusals = dict[tuple[str, str], tuple[Path, subprocess.CompletedProcess]]  # (kind, command) -> (marker, result)


@pytest.fixture(scope="module")
def commands_run(bases: _Bases, tmp_path_factory: pytest.TempPathFactory) -> Refusals:
    """Every command of :data:`COMMANDS` on a polyglot where each strategy's checkpoint would be unpickled, each in
    its own copy of the run folder: (kind, command) -> (the marker, the command's result). They run in one process
    (:func:`~tests.one_process.cli_commands`): each refuses while parsing its options, before it loads anything."""
    root = tmp_path_factory.mktemp("commands")
    planted = {}
    for kind, target in POLYGLOTS:
        for name, arguments in COMMANDS.items():
            run, ckpt, marker = plant(bases[kind], target, "polyglot", root / f"{kind}-{name}")
            planted[kind, name] = marker, arguments(run, ckpt, kind)
    results = cli_commands([args for _, args in planted.values()])
    return {key: (marker, result) for (key, (marker, _)), result in zip(planted.items(), results, strict=True)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("kind", "target"), POLYGLOTS)
def test_every_command_refuses_a_polyglot_in_one_line(
    commands_run: Refusals, kind: str, target: str, command: str
) -> None:
    """``torch-handle export|test|validate|predict|fit --ckpt_path`` on the checkpoint each strategy writes, with a
    polyglot where the loader would unpickle it: one ``error:`` line, exit 1, and the marker never appears."""
    marker, result = commands_run[kind, command]
    output = result.stdout + result.stderr
    assert not marker.exists(), "the payload ran"
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert "could run code" in errors[0], errors[0]


# --- damaged, not hostile ----------------------------------------------------------------------------------


def _copy(base: Path, tmp_path: Path) -> Path:
    shutil.copytree(base / "checkpoints" / "last.ckpt", tmp_path / "last.ckpt")
    return tmp_path / "last.ckpt"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _unsave_a_rank(ckpt: Path) -> None:
    """A ZeRO-2 folder of two ranks missing the second's optimizer shard (the model states of a one-process run,
    told that two saved)."""
    states = ckpt / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(states, weights_only=False), "dp_world_size": 2}, states)  # our own file


DAMAGES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "truncated_zero_shard": ("zero2", lambda c: _truncate(c / "checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                             "is truncated or corrupt"),
    "missing_zero_rank": ("zero2", _unsave_a_rank, "holds 1 of the 2 optimizer shards"),
    "truncated_fsdp_shard": ("fsdp", lambda c: _truncate(c / "__0_0.distcp"), "is truncated"),
    "missing_fsdp_shard": ("fsdp", lambda c: (c / "__0_0.distcp").unlink(), "is missing"),
    "truncated_metadata": ("fsdp", lambda c: _truncate(c / ".metadata"), "is truncated or corrupt"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_folder_is_named_damaged_in_one_line(bases: _Bases, damage: str, tmp_path: Path) -> None:
    kind, damaging, expected = DAMAGES[damage]
    ckpt = _copy(bases[kind], tmp_path)
    damaging(ckpt)
    message = _export(ckpt, tmp_path)
    _one_line(message, ckpt)
    assert expected in message and "damaged" in message and "could run code" not in message, message


# --- an export's config cannot make us allocate ------------------------------------------------------------


@pytest.mark.parametrize("claim", [{"d_model": 65536}, {"num_encoder_layers": 10**9}], ids=["wide", "deep"])
def test_an_export_claiming_a_huge_model_is_refused_before_building_it(
    claim: dict[str, int], tiny_demo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged ``__metadata__`` config over the tiny weights (d_model 65536: tens of GB; a billion layers: hours
    on the meta device) is checked against the header's shapes and count; a Transformer of real memory is never
    built, and a deep one not even on the meta device."""
    exported = export.export(tiny_demo_run / "checkpoints" / "last.ckpt", tmp_path / "model.safetensors")
    with safe_open(exported, framework="pt") as f:
        metadata, weights = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    config = json.loads(metadata["transformer"])
    forged = tmp_path / "forged.safetensors"
    save_file(weights, forged, metadata={**metadata, "transformer": json.dumps({**config, **claim})})

    real = reading.Transformer

    def only_on_meta(config: reading.TransformerConfig) -> reading.Transformer:
        assert torch.empty(0).device.type == "meta", f"a Transformer of d_model {config.d_model} was built"
        return real(config)

    monkeypatch.setattr(reading, "Transformer", only_on_meta)
    for read in (export.exported_metadata, torch_handle.load):
        with pytest.raises(CheckpointError) as error:
            read(forged)
        _one_line(str(error.value), forged)
        assert "does not match its model config" in str(error.value)


# --- a .metadata pickle cannot reach past its allowed classes -----------------------------------------------------


def _dcp_folder_with_dotted_metadata(tmp_path: Path) -> tuple[Path, Path]:
    """A one-process distributed checkpoint whose ``.metadata`` names ``io.FileIO`` through ``pathlib`` (a protocol 4
    dotted name under an allowed module) to create ``marker``."""
    import torch.distributed.checkpoint as dcp

    folder, marker = tmp_path / "last.ckpt", tmp_path / "created"
    dcp.save({"w": torch.zeros(2), "n": 3}, checkpoint_id=folder, no_dist=True)
    path = str(marker).encode()
    hostile = b"\x80\x04cpathlib\nio.FileIO\n(X" + len(path).to_bytes(4, "little") + path + b"X\x02\x00\x00\x00wbtR."
    (folder / ".metadata").write_bytes(hostile)
    return folder, marker


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dotted_name_in_metadata_is_refused_by_the_check(tmp_path: Path) -> None:
    folder, marker = _dcp_folder_with_dotted_metadata(tmp_path)
    message = _check(folder, tmp_path)
    assert not marker.exists(), "the payload ran"
    _one_line(message, folder)
    assert "'pathlib.io.FileIO' is not checkpoint metadata" in message and "could run code" in message, message


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dotted_name_in_metadata_is_refused_by_the_guard_alone(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from torch_handle.unpickling import unpickling_only_data

    folder, marker = _dcp_folder_with_dotted_metadata(tmp_path)
    with pytest.raises(CheckpointError) as error, unpickling_only_data(folder):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=folder, no_dist=True)
    assert not marker.exists(), "the payload ran"
    _one_line(str(error.value), folder)
    assert "weights-only loading refuses ('pathlib.io.FileIO' is not checkpoint metadata)" in str(error.value)


def test_a_compressed_pickle_member_is_refused_unread(tmp_path: Path) -> None:
    """A deflated ``data.pkl`` could inflate without bound; torch.save stores its pickles, so one is refused before
    it is read, by the check and by the export's reader alike."""
    import zipfile

    from torch_handle.unpickling import archive_pickles, data_pickle

    ckpt = tmp_path / "bomb.ckpt"
    with zipfile.ZipFile(ckpt, "w", zipfile.ZIP_DEFLATED) as zipped:
        zipped.writestr("archive/data.pkl", pickle.dumps({"state_dict": {}}) + b"\0" * 1_000_000)
    assert data_pickle(ckpt) is None
    with pytest.raises(CheckpointError) as error:
        list(archive_pickles(ckpt, ckpt, ckpt))
    assert str(error.value) == (
        f"{ckpt} is truncated or corrupt (an archive that does not read: its pickle archive/data.pkl is compressed or "
        f"larger than the archive, as torch.save never writes one): checkpoint {ckpt} is damaged (an interrupted copy "
        "or save?); pass another checkpoint"
    )
    _one_line(_check(ckpt, tmp_path), ckpt)
