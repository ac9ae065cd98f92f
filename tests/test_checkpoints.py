"""``check_checkpoint``: what passes as a checkpoint, what is refused (a planted pickle payload included), that
checking reads almost nothing, and that a sharded save killed half-way never loses the last checkpoint."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from torch_handle.checkpoints import CheckpointError, check_checkpoint, last_checkpoint, resolve_ckpt_path
from torch_handle.cli import main
from torch_handle.strategies.folders import _SafeFolders

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


def _lightning_like(path: Path) -> Path:
    """The keys Lightning writes, around a tensor big enough that reading it would show."""
    torch.save(
        {"epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6", "state_dict": {"w": torch.zeros(1 << 20)}},
        path,
    )
    return path


def test_a_lightning_checkpoint_passes(tmp_path: Path) -> None:
    path = _lightning_like(tmp_path / "model.ckpt")
    assert check_checkpoint(str(path)) == path


@pytest.mark.slow
def test_a_checkpoint_written_by_fit_passes(tiny_demo_run: Path) -> None:
    path = tiny_demo_run / "checkpoints" / "last.ckpt"
    assert check_checkpoint(path) == path


def _bare_state_dict(path: Path) -> None:
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)  # the classic mix-up: weights without the checkpoint


def _tensor(path: Path) -> None:
    torch.save(torch.arange(3), path)


def _optimizer_only(path: Path) -> None:
    torch.save({"optimizer": torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1).state_dict()}, path)


def _zip_without_pickle(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes/readme.txt", "state_dict")


def _corrupt_pickle(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00X\x0a\x00\x00\x00state_dic")  # cut mid-string


def _damaged_archive(path: Path) -> None:
    _lightning_like(path)
    data = path.read_bytes()
    path.write_bytes(data[:100] + bytes(len(data) - 200) + data[-100:])  # the zip's directory survives, not its files


NOT_CHECKPOINTS = {
    "bare_state_dict": _bare_state_dict,
    "tensor": _tensor,
    "optimizer_only": _optimizer_only,
    "zip_without_pickle": _zip_without_pickle,
    "corrupt_pickle": _corrupt_pickle,
    "damaged_archive": _damaged_archive,
}


@pytest.mark.parametrize("case", NOT_CHECKPOINTS)
def test_a_zip_archive_that_is_not_a_lightning_checkpoint_is_refused(case: str, tmp_path: Path) -> None:
    path = tmp_path / f"{case}.ckpt"
    NOT_CHECKPOINTS[case](path)
    assert zipfile.is_zipfile(path)  # the old check let all of these through
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint") as error:
        check_checkpoint(path)
    assert str(path) in str(error.value)


def test_checking_reads_only_the_pickle_and_unpickles_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-GB checkpoints are checked in milliseconds: tensor data is never read, nothing is loaded."""
    path = _lightning_like(tmp_path / "model.ckpt")
    read: list[str] = []
    original_read = zipfile.ZipFile.read

    def recording_read(self: zipfile.ZipFile, name: str, pwd: bytes | None = None) -> bytes:
        read.append(name)
        return original_read(self, name, pwd)

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("check_checkpoint must not torch.load the file")

    monkeypatch.setattr(zipfile.ZipFile, "read", recording_read)
    monkeypatch.setattr(torch, "load", no_load)
    check_checkpoint(path)
    assert [name.rsplit("/", 1)[-1] for name in read] == ["data.pkl"]


def test_cli_refuses_a_bare_state_dict_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    _bare_state_dict(path)
    with pytest.raises(SystemExit) as exit_info:
        main(["test", f"--config={DEMO}", f"--ckpt_path={path}", f"--trainer.default_root_dir={tmp_path / 'run'}"])
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    assert str(path) in message and "not a Lightning checkpoint" in message


# --- nothing we load runs code -----------------------------------------------------------------------------


class Payload:
    """Creates ``marker`` when unpickled: what an attacker plants in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def _evil_ckpt(folder: Path, marker: Path) -> Path:
    path = folder / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 0, "payload": Payload(marker)}, path)
    return path


def _evil_zero2(folder: Path, marker: Path) -> Path:
    """A ZeRO-2 folder as DeepSpeed writes it, with a payload in a rank's optimizer shard (which DeepSpeed loads
    with ``weights_only=False`` once the model states parse)."""
    path = folder / "last.ckpt"
    (path / "checkpoint").mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    model_states = {
        "module": {"model.w": torch.zeros(2)},
        "buffer_names": [],
        "param_shapes": [{"model.w": torch.Size([2])}],
        "shared_params": {},
        "ds_version": "0.19.8",
        "state_dict": {},
    }
    torch.save(model_states, path / "checkpoint" / "mp_rank_00_model_states.pt")
    shard = path / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "payload": Payload(marker)}}, shard)
    return path


def _evil_fsdp(folder: Path, marker: Path) -> Path:
    """An FSDP sharded folder (torch.distributed.checkpoint) with a payload in its ``.metadata`` pickle."""
    import pickle

    import torch.distributed.checkpoint as dcp

    path = folder / "last.ckpt"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": {"w": torch.zeros(2)}, "step": 3}, checkpoint_id=path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.planner_data = Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


def _escaping_tag(folder: Path, marker: Path) -> Path:
    """A DeepSpeed folder whose ``latest`` tag leads out of it, to a real checkpoint elsewhere."""
    _evil_zero2(folder / "elsewhere" / "x", marker)
    path = folder / "run" / "checkpoints" / "last.ckpt"
    (path / "checkpoint").mkdir(parents=True)
    (path / "latest").write_text("../../x")
    return path


PLANTED = {"ckpt": _evil_ckpt, "zero2": _evil_zero2, "fsdp": _evil_fsdp, "latest_tag": _escaping_tag}


@pytest.mark.parametrize("layout", PLANTED)
def test_export_refuses_a_planted_payload_in_one_line(layout: str, tmp_path: Path) -> None:
    from torch_handle.export.__main__ import main as export_main

    marker = tmp_path / "marker"
    path = PLANTED[layout](tmp_path, marker)
    with pytest.raises(SystemExit) as error:
        export_main([str(path), str(tmp_path / "out.safetensors")])
    message = str(error.value.code)
    assert message.startswith("error: ") and "\n" not in message and str(path) in message
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(("layout", "config"), [("ckpt", None), ("zero2", "zero2"), ("fsdp", "fsdp")])
def test_fit_refuses_to_resume_from_a_planted_payload_in_one_line(
    layout: str, config: str | None, tmp_path: Path
) -> None:
    """``fit --ckpt_path last`` (and an explicit path) is checked before Lightning or DeepSpeed loads anything."""
    marker = tmp_path / "marker"
    root = tmp_path / "run"
    (root / "checkpoints").mkdir(parents=True)
    path = PLANTED[layout](root / "checkpoints", marker)
    strategy = [] if config is None else [f"--config={ROOT / 'configs' / f'{config}.yaml'}"]
    ckpt_path = str(path) if layout == "ckpt" else "last"
    with pytest.raises(SystemExit) as error:
        main(["fit", f"--config={DEMO}", *strategy, f"--ckpt_path={ckpt_path}", f"--trainer.default_root_dir={root}"])
    message = str(error.value.code)
    assert message.startswith("error: ") and "\n" not in message and "could run code" in message
    assert not marker.exists(), "the payload ran"


# --- a sharded save killed between its two renames ---------------------------------------------------------


class _FolderSave:
    """A sharded strategy's save, reduced to one process: each save writes a folder of two files."""

    is_global_zero = True

    def broadcast(self, obj: object) -> object:
        return obj

    def barrier(self, name: str) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict, filepath: Path, storage_options: object = None) -> None:
        Path(filepath).mkdir()
        (Path(filepath) / "latest").write_text("checkpoint")
        (Path(filepath) / "checkpoint").mkdir()
        torch.save(
            {"state_dict": {}, "global_step": checkpoint["global_step"]},
            Path(filepath) / "checkpoint" / "mp_rank_00_model_states.pt",
        )


class _Saver(_SafeFolders, _FolderSave):
    pass


def _step(path: Path) -> int:
    return torch.load(path / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=True)["global_step"]


class Killed(BaseException):
    """The process dies here: nothing after the raising line runs (not an Exception: no handler catches it)."""


def _kill_before_the_second_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if str(src).endswith(".partial"):
            monkeypatch.setattr(os, "replace", real_replace)
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_a_save_killed_between_its_renames_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    last = tmp_path / "last.ckpt"
    _Saver().save_checkpoint({"global_step": 2}, last)
    _kill_before_the_second_rename(monkeypatch)
    with pytest.raises(Killed):
        _Saver().save_checkpoint({"global_step": 4}, last)
    assert not last.exists()  # the window

    resolved = resolve_ckpt_path("last", tmp_path, fit=True)  # what `cli.py fit --ckpt_path last` resumes from
    assert resolved == str(last) and _step(last) == 2
    assert last_checkpoint(tmp_path) == last

    _Saver().save_checkpoint({"global_step": 6}, last)  # the next save works and leaves nothing hidden behind
    assert _step(last) == 6
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_run_that_saves_again_after_a_kill_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run restarted without resuming must not delete both hidden copies when it saves, even if it dies too."""
    last = tmp_path / "last.ckpt"
    _Saver().save_checkpoint({"global_step": 2}, last)
    _kill_before_the_second_rename(monkeypatch)
    with pytest.raises(Killed):
        _Saver().save_checkpoint({"global_step": 4}, last)

    def dies_while_writing(*args: object) -> None:
        raise Killed

    monkeypatch.setattr(_FolderSave, "save_checkpoint", dies_while_writing)
    with pytest.raises(Killed):
        _Saver().save_checkpoint({"global_step": 6}, last)
    assert _step(last_checkpoint(tmp_path)) == 2
