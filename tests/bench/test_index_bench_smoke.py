"""Smoke test of bench/index_bench.py (issue 14): a 100-step run with ``--quick``, its JSON has
every figure and target. No timing assertions — the numbers mean nothing at this size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_index_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "index_bench.py"),
            "--quick",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # cleaned up
    res = json.loads(out.read_text())
    assert res["benchmark"] == "index"
    assert res["quick"] is True
    assert res["repeats"] >= 3
    (run,) = res["runs"].values()
    assert run["steps"] == 100
    assert run["index_files"] >= 1
    for k in ("open_s", "metrics_s", "spikes_s", "summaries_s", "trajectory_s", "raw_ceiling_s"):
        assert run[k] > 0, k
    assert res["layer"]["tensors"] == 1000
    assert res["layer"]["layer_s"] > 0
    assert set(res["targets"]) == {
        "open_below_0.1s",
        "metrics_below_1s",
        "spikes_below_1s",
        "summaries_below_1s",
        "layer_below_0.05s",
        "trajectory_at_least_half_the_ceiling",
    }
