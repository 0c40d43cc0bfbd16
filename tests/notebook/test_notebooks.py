"""Every notebook under notebooks/ runs top to bottom (its cells hold the asserts).

Executed with nbclient in a kernel of *this* interpreter: a kernelspec written to a temporary
``JUPYTER_PATH`` points at ``sys.executable``, so the test needs no ``ipykernel install`` and
cannot pick up some other Python's ``python3`` kernel. Runs go to ``DSTT_NOTEBOOK_DIR`` (the
test's tmp_path). Rejected alternative: ``pytest --nbmake`` — one more plugin whose kernel
choice follows the notebook's metadata, i.e. whatever ``python3`` means on the machine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
KERNEL = "dstt-test-python"
BUDGET_S = 60  # each notebook must run in well under a minute on 2 CPU cores


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "dstt test",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    out = tmp_path / "runs"
    out.mkdir()
    monkeypatch.setenv("DSTT_NOTEBOOK_DIR", str(out))
    return out


def test_there_are_notebooks() -> None:
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "loss_spike.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, kernel_env: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{path.name} is committed with outputs; clear them"
    )
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=120, resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell and traceback
    elapsed = time.perf_counter() - t0
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    assert any(kernel_env.iterdir()), "the notebook wrote no run into DSTT_NOTEBOOK_DIR"
    assert elapsed < BUDGET_S, f"{path.name} took {elapsed:.0f} s"
