"""``notebooks/finetune.ipynb`` runs headless, top to bottom, on a real checkpoint and prints a translation."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import pretrained_folder

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "finetune.ipynb"


def _stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(output.text for output in cell.get("outputs", []) if output.get("name") == "stdout")


def test_notebook_has_a_parameters_cell_reading_the_checkpoint_from_the_environment() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0].cell_type == "code"
    assert 'os.environ.get("TORCH_HANDLE_CKPT", "runs/demo/checkpoints/last.ckpt")' in tagged[0].source
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "commit it clean"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("start", ["checkpoint", "hf-folder"])
def test_notebook_fine_tunes_a_checkpoint_and_prints_a_translation(
    start: str, tiny_demo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From our demo run's checkpoint, and from a Hugging Face BART folder (``init_from``)."""
    checkpoint = tiny_demo_run / "checkpoints" / "last.ckpt" if start == "checkpoint" else pretrained_folder("bart")
    # The kernel is a child process: it inherits these. One thread, as the other tests run tiny models.
    monkeypatch.setenv("TORCH_HANDLE_CKPT", str(checkpoint))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's data folder lands in the test's tmp_path
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails

    outputs = "\n".join(_stdout(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert f"loaded {checkpoint}" in outputs
    assert "after 10 steps" in outputs  # fine-tuning ran its steps
    assert list(tmp_path.glob("finetune-data-*/train.de"))
    last = _stdout(notebook.cells[-1]).splitlines()
    assert last[0] == "source:      the old king does not see my two clever dogs"
    prefix = "translation: "
    assert last[1].startswith(prefix) and last[1].removeprefix(prefix).strip(), last
