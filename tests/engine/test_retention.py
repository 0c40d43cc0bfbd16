"""Retention (issue 18): a run of any length keeps bounded tensor bytes, every spike's window.

The main test trains 2,000 steps, a checkpoint every iteration, with background retention and
two injected loss spikes, and checks during and after training that the step files stay within
the policy's bound, that every step of each spike window is still there and readable, that the
pruned steps' metrics and summaries stay, and that the run resumes. The others: the same
policy offline (``Run.gc(retention=...)``, ``dstt gc``), fork points, ``dstt log``, and a
SIGKILL while the background gc runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt.cli import main as cli_main
from dstt.errors import ConfigError
from dstt.store import Repository

from ._helpers import MLP, mlp_batch, same_bits

SPIKES = (700, 1500)
POLICY = dstt.Retention(keep_last=60, keep_every=250, spike_window=5, every_commits=50)


def step_files(run: Path) -> dict[int, int]:
    """Bytes of the step files on disk, per slot."""
    out: dict[int, int] = {}
    for name in os.listdir(run / "steps"):
        if ".tmp." in name:
            continue
        slot = int(name.split(".")[0])
        out[slot] = out.get(slot, 0) + os.path.getsize(run / "steps" / name)
    return out


def train(
    s: dstt.Session,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    n: int,
    spikes: tuple[int, ...] = (),
    check: object = None,
) -> None:
    x, y = mlp_batch(0)  # one batch: a smooth loss curve, so the only spikes are injected
    for _ in range(n):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        s.log(step=s.step, loss=50.0 if s.step in spikes else float(loss.detach()))
        if callable(check):
            check(s)


def test_retention_bounds_bytes_and_keeps_every_spike_window(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    during: list[tuple[int, int, int]] = []
    threads: set[str] = set()

    def check(s: dstt.Session) -> None:
        threads.update(t.name for t in threading.enumerate())
        if s.step % 400 == 0:
            s._retainer.wait_idle()  # type: ignore[union-attr]
            sizes = step_files(run)
            during.append((s.step, len(sizes), sum(sizes.values())))

    t0 = time.perf_counter()
    with dstt.session(model, opt, run=run, retention=POLICY, copy="sync") as s:
        train(s, model, opt, 2000, SPIKES, check)
    wall = time.perf_counter() - t0
    runs = s.retention_runs
    gc_s = [d for _, d in runs]
    print(
        f"\n2,000 steps in {wall:.1f} s; {len(runs)} gcs, {sum(gc_s):.2f} s in all, "
        f"median {np.median(gc_s) * 1e3:.0f} ms, max {max(gc_s) * 1e3:.0f} ms (off the "
        f"training thread); step files during training: {during}"
    )
    assert "dstt-retention" in threads  # gc ran on its own thread while training
    assert len(runs) >= 2000 // POLICY.every_commits  # 40 in the background + the final one

    r = dstt.open(run)
    steps = r.steps
    sizes = step_files(run)
    per_step = max(sizes.values())
    bound = POLICY.bound(2000, spikes=len(SPIKES))  # 60 + 8 + 2 x 11 + 1 = 91
    assert len(steps) <= bound
    assert sum(sizes.values()) <= bound * per_step
    assert len(sizes) == len(steps)  # no step file of a pruned step is left
    # while training, at most every_commits more (the steps since the last gc) + the steps
    # the last gc did not see committed yet (the backlog, max_backlog=16) + the one in flight
    for at, n, nbytes in during:
        live = POLICY.bound(at, spikes=sum(sp < at for sp in SPIKES))
        assert n <= live + POLICY.every_commits + 16 + 1, (at, n)
        assert nbytes <= n * per_step, (at, n)

    # every step of each spike window is on disk and readable (the cause's update included)
    windows = [(lo, hi) for _, lo, hi in runs[-1][0].spike_windows]
    assert windows == [(sp - 5, sp + 5) for sp in SPIKES]
    for lo, hi in windows:
        for k in range(lo, hi + 1):
            assert k in steps
            snap = r.at(k)
            assert np.isfinite(snap.to_numpy(snap.names()[0])).all()

    # pruned steps keep their metrics and summaries; the gcs are reported as metrics
    ds = r.metrics()
    assert ds.sizes["step"] == 2000
    assert int(ds["pruned"].sum()) == 2000 - len(steps)
    assert float(ds["loss"].sel(step=700)) == 50.0
    assert bool(ds["pruned"].sel(step=100))
    pruned = ds["retention/pruned_steps"].values
    counts = [len(rep.pruned_steps) for rep, _ in runs]
    assert sum(counts) == 2000 - len(steps)
    # each gc is reported by the next commit: all but those finishing after the last one
    assert sum(counts) - sum(counts[-2:]) <= np.nansum(pruned) <= sum(counts)
    assert np.nansum(ds["retention/freed_bytes"].values) > 0
    summ = r.summaries()
    assert bool(summ["pruned"].sel(step=123))
    assert np.isfinite(summ["l2"].sel(step=123).values).all()
    assert r.spikes(top=0)[0].step == 700  # found in the metrics, pruned steps included
    assert dstt.open(run).repo.verify().ok

    # resume from the head, bit-exactly, and keep pruning
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model2 = MLP()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.01)
    with dstt.session(model2, opt2, run=run, resume=True, retention=POLICY, copy="sync") as s2:
        assert s2.step == 2000
        assert all(same_bits(model2.state_dict()[k], v) for k, v in final.items())
        train(s2, model2, opt2, 60)
    assert dstt.open(run).steps[-1] == 2060
    assert 1990 not in dstt.open(run).steps


def test_same_policy_offline_and_in_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with dstt.session(model, opt, run=run, summaries=False, copy="sync") as s:
        train(s, model, opt, 300, (150,))
    r = dstt.open(run)
    r.rollback(40, name="side")  # 40 becomes a fork point of the timeline "side"
    with dstt.session(model, opt, run=run, resume=True, summaries=False, copy="sync") as s:
        train(s, model, opt, 30)
    pol = dstt.Retention(keep_last=10, keep_every=100, spike_window=3, spike_baseline=20)
    rep = dstt.open(run).gc(retention=pol, dry_run=True)
    assert rep.spike_windows == (("main", 147, 153),)
    assert (
        code := cli_main(
            [
                "gc",
                str(run),
                "--keep-last",
                "10",
                "--keep-every",
                "100",
                "--spike-window",
                "3",
                "--spike-baseline",
                "20",
                "--json",
            ]
        )
    ) == 0, code
    out = json.loads(capsys.readouterr().out)
    assert out["spike_windows"] == [{"timeline": "main", "first": 147, "last": 153}]
    r = dstt.open(run)
    assert [h.step for h in r.commits("main")] == [40, 100, *range(147, 154), 200, *range(291, 301)]
    assert r.steps == [40, *range(61, 71)]  # "side": the fork point 40 stays
    assert r.repo.verify().ok
    # dstt log lists the pruned steps too (from the index), marked, with their metrics
    assert cli_main(["log", str(run), "--timeline", "main", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc) == 300
    assert doc[0]["step"] == 300
    assert not doc[0]["pruned"]
    by_step = {d["step"]: d for d in doc}
    assert by_step[120]["pruned"]
    assert "loss" in by_step[120]["metrics"]
    assert cli_main(["log", str(run), "--timeline", "main", "-n", "200"]) == 0
    text = capsys.readouterr().out
    assert "(pruned)" in text.splitlines()[-1]
    assert "(pruned)" not in text.splitlines()[0]


def test_a_session_policy_must_keep_spike_windows_reachable(tmp_path: Path) -> None:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ConfigError, match="keep_last >= every_commits"):
        dstt.session(
            model,
            opt,
            run=tmp_path / "r",
            retention=dstt.Retention(keep_last=20, spike_window=5, every_commits=50),
        )
    with pytest.raises(ValueError, match="keep_every"):
        dstt.Retention(keep_every=0)
    with pytest.raises(ValueError, match="not both"):
        Repository.create(tmp_path / "g").gc(keep_last=3, retention=dstt.Retention(keep_last=3))


CHILD = Path(__file__).with_name("retention_child.py")
CHILD_POLICY = {
    "keep_last": 8,
    "keep_every": 10,
    "spike_window": 2,
    "every_commits": 5,
    "spike_baseline": 10,
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_sigkill_during_background_retention_leaves_a_consistent_run(tmp_path: Path) -> None:
    """The child gcs every 5 steps; killed at random steps, the run must verify, keep its
    spike windows and resume; a last uninterrupted session then ends within the bound."""
    run = tmp_path / "run"
    rng = random.Random(18)
    resume = False
    for _ in range(3):
        with subprocess.Popen(
            [
                sys.executable,
                str(CHILD),
                str(run),
                "400",
                json.dumps(CHILD_POLICY),
                *(["resume"] if resume else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        ) as proc:  # closes its pipes
            kill_after = rng.randint(15, 60)
            seen = 0
            assert proc.stdout is not None
            for line in proc.stdout:
                seen += line.startswith("step")
                if seen >= kill_after:
                    proc.send_signal(signal.SIGKILL)
                    break
            proc.wait(timeout=60)
            err = proc.stderr.read() if proc.stderr else ""
        assert proc.returncode == -signal.SIGKILL, err
        rep = dstt.open(run).repo.verify()
        assert rep.ok, rep.problems
        resume = True
    out = subprocess.run(
        [sys.executable, str(CHILD), str(run), "20", json.dumps(CHILD_POLICY), "resume"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    r = dstt.open(run)
    assert r.repo.verify().ok
    pol = dstt.Retention(**CHILD_POLICY)
    ds = r.metrics()
    windows = pol.spikes(ds["step"].values, ds["loss"].values)
    head = r.steps[-1]
    assert {(sp - 2, sp + 2) for sp in range(37, head - 2, 37)} <= set(windows)
    assert len(r.steps) <= pol.bound(head, spikes=len(windows))
    for lo, hi in windows:  # each spike's window survived the kills
        assert all(k in r.steps for k in range(lo, min(hi, head) + 1)), (lo, hi)
