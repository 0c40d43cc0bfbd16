"""Commands that print no arrays start fast: they import no xarray, pandas or torch.

``dstt ls`` used to take 1.5 s (xarray and pandas imported by ``dstt.run``) against 0.08 s
for ``--help``. Timing a start-up is noisy on a shared machine, so this checks what it
costs: the modules each command leaves in ``sys.modules``, in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dstt.store import save

HEAVY = ("xarray", "pandas", "torch", "matplotlib", "scipy")
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
