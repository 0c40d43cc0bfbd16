"""The README's demo runs end to end (train, inspect, roll back, resume) in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_trains_inspects_rolls_back_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--run", str(run), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "30 committed steps: 1..30" in text
    assert "verify: ok" in text
    assert "fewer bytes" in text
    assert "timeline 'main': steps 1..30" in text
    assert "-from-" in text
