"""``check_checkpoint``: what passes as a checkpoint, what is refused, and that checking reads almost nothing."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from cli import main
from torch_handle.checkpoints import CheckpointError, check_checkpoint

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
