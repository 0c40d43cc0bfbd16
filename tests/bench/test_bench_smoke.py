"""Smoke tests of the benchmark scripts: each runs with ``--quick`` in a subprocess and writes its
JSON with the expected keys. No timing assertions — the numbers mean nothing at this size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / script),
            "--quick",
            "--json",
            str(out),
            "--dir",
            str(tmp_path),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.exists(), proc.stdout[-2000:]
    # the scripts clean up after themselves: only the JSON is left in --dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    return json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_capture_bench_quick(tmp_path: Path) -> None:
    res = run_quick("capture_bench.py", tmp_path)
    assert res["benchmark"] == "capture"
    assert res["quick"] is True
    assert set(res["sizes"]) == {"small", "large"}
    for name, size in res["sizes"].items():
        assert {"model", "disk", "disk_s_per_step", "floor_s", "modes", "targets"} <= set(size)
        assert size["disk"]["write_bytes_per_s"] > 0
        expected = {"none", "dstt", "torch_save", "dcp"} | (
            {"dstt_delta"} if name == "large" else set()
        )
        assert set(size["modes"]) == expected
        for mode, row in size["modes"].items():
            assert {
                "s_per_iter",
                "ratio_vs_none",
                "vs_floor",
                "blocked_s_per_step",
                "iter_median_s",
                "cpu_s_per_iter",
                "spread",
            } <= set(row), mode
            assert row["s_per_iter"] > 0
        assert size["modes"]["dstt"]["steps_measured"] > 0
        assert size["modes"]["dstt"]["written_bytes_per_step"] > 0
    assert "delta_below_disk_floor" in res["sizes"]["large"]["targets"]


@pytest.mark.timeout(120)
def test_delta_bench_quick(tmp_path: Path) -> None:
    res = run_quick("delta_bench.py", tmp_path)
    assert res["benchmark"] == "delta"
    assert res["quick"] is True
    classes = {
        "fp32 params",
        "fp32 exp_avg",
        "fp32 exp_avg_sq",
        "fp32 Adam state (all 3)",
        "bf16 params",
        "fp16 params",
    }
    assert res["points"]
    for point in res["points"].values():
        assert classes <= set(point)
        for c in classes:
            assert point[c]["ratio"] > 0
            assert point[c]["xor_bound_ratio"] >= 1
    assert {"fp32 params", "fp32 exp_avg", "fp32 exp_avg_sq"} <= set(res["session_classes"])
    assert {r["transform"] for r in res["variants"]} == {"xor", "sub", "zigzag"}
    for r in res["speed"].values():
        assert r["encode_gb_s"] > 0
        assert r["decode_gb_s"] > 0
        assert "encode_vs_disk" in r
    rl = res["read_latency"]
    assert rl["keyframe"]["vs_keyframe"] == 1.0
    assert "xor1" in rl["delta depth 1"]["encodings"]
    assert {"met", "fp32_adam_state_ratio_library", "best_fp32_variant"} <= set(res["targets"])


@pytest.mark.timeout(60)
def test_hotpath_bench_quick(tmp_path: Path) -> None:
    modes = ["none", "bare", "bare_guarded", "torch_save"]
    res = run_quick(
        "hotpath_bench.py",
        tmp_path,
        "--workloads",
        "lin360",
        "--threads",
        "1",
        "--modes",
        ",".join(modes),
        "--iters",
        "2",
        "--disk-mib",
        "8",
    )
    assert res["benchmark"] == "hotpath"
    assert res["quick"] is True
    assert res["repeats"] == 1
    assert res["warmup"] == 1
    assert res["iters"] == 2
    assert set(res["runs"]) == {"1"}
    assert res["runs"]["1"]["threads"] == 1
    w = res["runs"]["1"]["workloads"]
    assert set(w) == {"lin360"}
    lin = w["lin360"]
    assert {"model", "disk", "check", "modes"} <= set(lin)
    assert lin["model"]["tensors"] == 360
    assert lin["model"]["state_bytes"] > 5e6
    assert lin["disk"]["write_bytes_per_s"] > 0
    assert lin["check"]["disk_s_per_step"] > 0
    assert isinstance(lin["check"]["disk_below_iter"], bool)
    assert list(lin["modes"]) == modes
    for mode, row in lin["modes"].items():
        assert {
            "s_per_iter",
            "ratio_vs_none",
            "ratio_vs_bare",
            "blocked_s_per_step",
            "engine_cpu_s_per_step",
            "iter_median_s",
            "cpu_s_per_iter",
        } <= set(row), mode
        assert row["s_per_iter"] > 0
        assert row["ratio_vs_none"] > 0
        assert row["ratio_vs_bare"] > 0
    assert lin["modes"]["none"]["ratio_vs_none"] == 1.0
    bare = lin["modes"]["bare"]
    assert bare["tensors"] == 360
    assert bare["bytes_per_step"] >= lin["model"]["state_bytes"] - 4096
    assert bare["blocked_s_per_step"] > 0
    assert bare["copy_s"] > 0
    assert bare["write_s"] > 0
    assert bare["engine_cpu_s_per_step"] is not None
    assert lin["modes"]["torch_save"]["blocked_s_per_step"] > 0
    guarded = lin["modes"]["bare_guarded"]
    assert guarded["ratio_vs_guarded"] == 1.0
    assert bare["ratio_vs_guarded"] > 0
    assert guarded["bytes_per_step"] == bare["bytes_per_step"]


@pytest.mark.timeout(120)
def test_hotpath_profile_runs_and_names_the_engine_threads_and_steps() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "hotpath_profile.py"),
            "--workload",
            "lin360",
            "--threads",
            "1",
            "--iters",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "lin360, torch threads 1:" in out
    assert "x); blocked per step median" in out
    for row in (
        "| training (main) |",
        "| dstt-commit |",
        "| dstt-copy |",
        "| `Pipeline._copy` |",
        "| `Transaction.commit` |",
        "| `Pipeline.stage` |",
    ):
        assert row in out, row


@pytest.mark.timeout(120)
def test_import_bench_quick(tmp_path: Path) -> None:
    res = run_quick("import_bench.py", tmp_path)
    assert res["benchmark"] == "import"
    assert res["checkpoints"] == 4
    for mode in ("cold", "warm"):
        assert {"loader_s", "read_phase_s", "import_s", "import_delta_s", "ratio_import"} <= set(
            res[mode]
        )
    assert set(res["bytes_on_disk"]) == {"source", "import", "import_no_summaries", "import_delta"}
