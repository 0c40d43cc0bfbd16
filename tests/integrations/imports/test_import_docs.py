"""docs/import.md's runnable examples, one per source, run as written (in a fresh process each,
with the demo folder moved under the test's tmp_path): each must import what it saved."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from imports_setup import ROOT, free_port

DOC = ROOT / "docs" / "import.md"
BLOCKS = re.findall(
    r"\*\*([^*]+)\*\*[^\n]*\n\n```python\n(.*?)```",
    DOC.read_text().split("## One runnable example per source", 1)[1],
    re.S,
)


def test_every_source_has_an_example() -> None:
    names = [n.split(" (")[0] for n, _ in BLOCKS]
    assert names == ["torch.save files", "Hugging Face Trainer", "Lightning", "DCP", "DeepSpeed"]


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[n.split(" (")[0] for n, _ in BLOCKS])
def test_the_example_runs(name: str, code: str, tmp_path: Path) -> None:
    code = code.replace("/tmp/dstt-import-demo", str(tmp_path)).replace(
        'MASTER_PORT="29511"', f'MASTER_PORT="{free_port()}"'
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "DS_ACCELERATOR": "cpu",
        "DS_BUILD_OPS": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = next(line for line in proc.stdout.splitlines() if line.startswith("["))
    promised = re.search(r"^print\(.*# (\[.*)$", code, re.M)  # what the doc says it prints
    assert promised is not None, proc.stdout
    assert first == promised.group(1), proc.stdout
    runs = [p for p in tmp_path.iterdir() if p.name.startswith("run-")]
    assert len(runs) == 1
    assert (runs[0] / "_dstt").is_dir()
