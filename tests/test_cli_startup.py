"""Commands that print no arrays start fast: they import no xarray, pandas, torch, zarr or
matplotlib.

``dstt ls`` used to take 1.5 s (xarray and pandas imported by ``dstt.run``) against 0.08 s
for ``--help``, and a first ``run.metrics()`` 2 s (issue 37). Timing a start-up is noisy on a
shared machine, so this checks what it costs: the modules each command leaves in
``sys.modules``, in a fresh interpreter (the timings: ``bench/firstcontact_bench.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dstt.store import save

HEAVY = ("xarray", "pandas", "torch", "matplotlib", "scipy", "zarr", "numcodecs")
CODE = f"""
import json, sys
from dstt.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("startup") / "run"
    for step in (1, 2, 3):
        save(
            path,
            step,
            {"params/l1/weight": np.full((4, 2), step, np.float32)},
            metrics={"acc": 0.5},
        )
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["ls"],
        ["ls", "--json"],
        ["verify"],
        ["index"],
        ["timeline", "list"],
        ["rollback", "--to", "2"],
        ["gc", "--keep-last", "2", "--dry-run"],
    ],
)
def test_listing_commands_import_no_array_library(run_dir: Path, argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE, *argv, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"code": 0, "heavy": []}, (argv, got)


API = {
    "import": "import dstt",
    "version": "import dstt; dstt.__version__",
    "steps": "import dstt; dstt.open(RUN).steps",
    "metrics": "import dstt; m = dstt.open(RUN).metrics(); m.column('acc'); 'acc' in m; m.names",
    "spikes": "import dstt; dstt.open(RUN).spikes('acc')",
    "store": "import dstt.store; dstt.store.Repository.open(RUN).reader().lineage('main')",
}


@pytest.mark.parametrize("what", sorted(API))
def test_open_steps_and_metrics_import_no_heavy_module(run_dir: Path, what: str) -> None:
    code = (
        f"import json, sys\nRUN = {str(run_dir)!r}\n{API[what]}\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [], what


def test_import_dstt_loads_no_numpy_and_no_metadata(run_dir: Path) -> None:
    """``import dstt`` alone: the error classes and the lazy names, nothing else."""
    code = (
        "import json, sys\nimport dstt\n"
        "print(json.dumps([m for m in ('numpy', 'importlib.metadata', 'dstt.store', "
        "'dstt.run') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_metrics_dataset_is_built_when_asked(run_dir: Path) -> None:
    """What is not numpy (``m["acc"]``, ``.sel``) builds the Dataset — and says the same."""
    import dstt

    m = dstt.open(run_dir).metrics("main")  # "main": the rollback test above moved HEAD
    assert m.names == ["acc"]
    assert "acc" in m
    assert "step" in m
    assert "nope" not in m
    assert m.steps.tolist() == [1, 2, 3]
    assert m.column("acc").tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(KeyError, match="never logged; logged: \\['acc'\\]"):
        m.column("nope")
    assert m["acc"].sel(step=2).item() == 0.5
    assert m.to_xarray()["step"].values.tolist() == [1, 2, 3]
    assert list(m.data_vars) == ["acc"]
