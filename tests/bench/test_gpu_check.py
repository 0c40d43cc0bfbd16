"""``bench/gpu_check.py`` stays runnable: its CPU dry run (tiny Llama models, every mode, the
resume check, the pytest part on the real GPU selection) end to end in a subprocess, the time
guard skipping with notes, and the pieces a GPU run depends on (the Llama presets' sizes, the
iteration sizing, the schedule's reserve, the preflight). No timing assertions: on the CPU
the numbers mean nothing."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dstt.testing.llama import LLAMA_1B, LLAMA_125M, LlamaConfig, TinyLlama

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--out", str(out), "--work", str(work), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads((out / "gpu_check.json").read_text()), work


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


@pytest.mark.timeout(180)
def test_dry_run_measures_every_mode_resumes_bit_exactly_and_prints_the_table(
    tmp_path: Path,
) -> None:
    proc, res, work = _run(tmp_path)
    g = _script()
    assert res["dry"] is True
    assert res["preflight"]["problems"] == {}
    assert "error" not in res, res.get("traceback")
    # the pytest part ran the real selection (skipped without CUDA, passed with it)
    pt = res["pytest"]
    assert "tests/engine/test_gpu.py" in pt["files"]
    assert pt["rc"] == 0
    assert pt["counts"].get("failed", 0) == 0
    assert pt["counts"].get("errors", 0) == 0
    assert pt["counts"].get("skipped", 0) + pt["counts"].get("passed", 0) >= 3
    assert (tmp_path / "out" / "pytest.txt").read_text().count("test_gpu.py") >= 1
    assert not res["notes"], res["notes"]  # nothing skipped for time
    assert set(res["parts"]) == set(g.DRY.parts)
    for name, part in res["parts"].items():
        want = g.DRY.parts[name]
        rounds = sum(1 for s in g.DRY.schedule if s.part == name)
        assert len(part["rounds"]) == rounds
        for row in part["rounds"]:
            for mode in g.MODES:
                r = row[mode]
                assert "error" not in r, (name, mode, r)
                assert "skipped" not in r, (name, mode, r)
                assert len(r["iter_s"]) == want.iters
                assert all(t > 0 for t in r["iter_s"])
                assert r["gpu_peak_over_base"] is None  # the CPU has no device memory
        model = part["model"]
        assert model["params"] > 0
        assert model["state_bytes"] > 12 * model["params"] * 0.99
        summary = part["summary"]
        assert set(summary) == set(g.MODES)
        for mode, s in summary.items():
            assert s["rounds"] == rounds, (name, mode)
            for key in (
                "s_per_iter",
                "ratio",
                "blocked_s_per_iter",
                "blocked_frac",
                "drain_s",
                "host_rss_added",
            ):
                assert _finite(s[key]), (name, mode, key, s[key])
            assert s["s_per_iter"] > 0
            assert s["ratio"] > 0
            assert s["blocked_frac"] >= 0
            assert s["gpu_added_vs_none"] is None
            if mode != "none":  # a checkpoint of at least the model's state was written
                assert s["ckpt_bytes"] >= model["state_bytes"], (name, mode)
        assert summary["none"]["ratio"] == 1.0
        assert summary["none"]["ckpt_bytes"] is None
        assert summary["torch_save"]["blocked_frac"] > 0
        assert summary["dcp"]["blocked_frac"] > 0
        d = summary["dstt"]
        assert d["lane"] == "flat"
        assert d["flusher"] is True
        assert d["errors"] == []
        assert d["committed"] == want.iters // want.every
        assert d["host_buffer_bytes"] >= 2 * model["state_bytes"]
        assert _finite(d["hooks_frac"])
        assert d["hooks_frac"] > 0
        # retention kept the disk bounded: only the last keep_last steps are left
        assert d["step_files_at_end"] == want.keep_last, (name, d)
        dcp = summary["dcp"]
        assert dcp["backend"] == "gloo"
        assert dcp["variant"]
    rs = res["resume"]
    assert rs["restored_step"] == 3
    assert rs["differed_before"] > 0
    assert rs["restored_bit_exact"] is True
    assert rs["continued_bit_exact"] is True
    assert rs["kernels_deterministic"] is True
    t = res["targets"]
    assert t["part"] == g.DRY.threshold_part
    assert t["resume_bit_exact"] is True
    for key in (
        "blocked_le_5pct",
        "hooks_le_5pct",
        "dstt_le_dcp",
        "dstt_le_torch_save",
        "disk_binds",
    ):
        assert isinstance(t[key], bool), key
    # the table, and nothing left behind but the results
    out = proc.stdout
    assert "| part | mode | s/iter | x none | blocked ms/iter |" in out
    for name in g.DRY.parts:
        for mode in g.MODES:
            assert f"| {name} | {mode} | " in out, (name, mode)
    assert "resume (tiny): restored bit-exact True, continued step bit-exact True" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.json", "pytest.txt"]
    assert list(work.iterdir()) == []


@pytest.mark.timeout(120)
def test_out_of_time_skips_with_notes_and_still_reports(tmp_path: Path) -> None:
    proc, res, work = _run(tmp_path, "--budget-s", "1", "--pytest", "none")
    g = _script()
    assert res["pytest"] == {"skipped": "--pytest none"}
    assert res["parts"] == {}
    assert "resume" not in res
    assert len(res["notes"]) == len(g.DRY.schedule)
    assert all(n.startswith("skipped ") and "s left" in n for n in res["notes"])
    assert "note: skipped tiny/every1 round 0" in proc.stdout
    assert res["targets"] == {"part": g.DRY.threshold_part}
    assert list(work.iterdir()) == []


def test_llama_presets_have_the_sizes_the_check_promises() -> None:
    for cfg, low, high in ((LLAMA_125M, 120e6, 140e6), (LLAMA_1B, 1.0e9, 1.2e9)):
        with torch.device("meta"):
            m = TinyLlama(cfg)
        n = sum(p.numel() for p in m.parameters())
        assert n == cfg.params()
        assert low <= n <= high
    assert (LLAMA_125M.d, LLAMA_125M.layers, LLAMA_125M.vocab) == (768, 12, 32000)
    assert (LLAMA_1B.d, LLAMA_1B.layers, LLAMA_1B.vocab) == (2048, 16, 32000)


def test_tiny_llama_with_grouped_query_attention_learns() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab=64, d=32, layers=2, heads=4, kv_heads=2, ffn=64, seq=16)
    m = TinyLlama(cfg)
    assert not any("cos" in k or "sin" in k for k in m.state_dict())  # not model state
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    tokens = torch.randint(64, (4, 17))
    losses = []
    for _ in range(20):
        logits, loss = m(tokens[:, :-1], tokens[:, 1:])
        assert logits.shape == (4, 16, 64)
        assert loss is not None
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(ValueError, match="rotary table"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaConfig(d=32, heads=4, kv_heads=3)


def test_iteration_sizing_lets_the_disk_keep_up_within_the_cap() -> None:
    g = _script()
    spec = g.ModelSpec("m", "LLAMA_125M", batch=8, target_every=1, max_iter_s=1.5)
    accum = g.choose_accum(spec, micro_s=0.04, opt_s=0.01, disk_s=0.5)
    assert accum * 0.04 + 0.01 >= g.HEADROOM * 0.5 > (accum - 1) * 0.04 + 0.01
    assert g.choose_accum(spec, micro_s=0.04, opt_s=0.01, disk_s=30.0) == 37  # the cap
    assert g.choose_accum(spec, micro_s=0.04, opt_s=0.01, disk_s=0.0) == 1
    every10 = g.ModelSpec("m", "LLAMA_1B", batch=4, target_every=10, max_iter_s=1.0)
    assert g.choose_accum(every10, micro_s=0.1, opt_s=0.0, disk_s=5.0) == 7  # 1.3 x 5 / 10


def test_reserve_keeps_time_only_for_later_slots_as_important_or_more() -> None:
    g = _script()
    sched = g.FULL.schedule
    costs = {
        ("125M/every1", 2): 50.0,
        ("resume", 0): 20.0,
        ("1B/every10", 0): 100.0,
        ("1B/every1", 0): 120.0,
        ("1B/every10", 1): 100.0,
    }

    def est(slot: object) -> float:
        return costs.get((slot.part, slot.round), 40.0)  # type: ignore[attr-defined]

    first = next(i for i, s in enumerate(sched) if s.part == "125M/every1" and s.round == 0)
    third = next(i for i, s in enumerate(sched) if s.part == "125M/every1" and s.round == 2)
    assert g.reserve(sched, first, est) == 20.0  # the resume check ranks with round 0
    assert g.reserve(sched, third, est) == 20.0 + 100.0 + 120.0
    assert g.reserve(sched, len(sched) - 1, est) == 0.0


def test_preflight_names_what_is_missing_and_the_run_stops_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    g = _script()
    assert g.check_requirement("surely-not-a-module-xyz>=1") == "missing"
    assert g.check_requirement("numpy>=999").startswith("too old")
    assert g.check_requirement("numpy>=1") is None
    pre = g.preflight()
    assert pre["problems"] == {}
    assert "pip_download" not in pre
    # as on a bare GPU machine: zarr and pytest-timeout absent
    real = g.check_requirement
    monkeypatch.setattr(
        g,
        "check_requirement",
        lambda r: "missing" if r.startswith(("zarr", "pytest-timeout")) else real(r),
    )
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # main() extends it
    assert g.main(["--dry", "--out", str(tmp_path)]) == 2
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    pre = res["preflight"]
    assert list(pre["problems"]) == [r for r in g._requirements()[0] if r.startswith("zarr")]
    assert list(pre["test_tool_problems"]) == ["pytest-timeout>=2.3"]
    want = " ".join(f"'{r}'" for r in [*pre["problems"], "pytest-timeout>=2.3"])
    assert pre["pip_download"].endswith(want)
    assert "--only-binary=:all:" in pre["pip_download"]
    assert pre["pip_install"].endswith(want)
    out = capsys.readouterr().out
    assert pre["pip_download"] in out
    assert "preflight failed" in out
    assert "parts" in res
    assert res["parts"] == {}  # nothing ran
