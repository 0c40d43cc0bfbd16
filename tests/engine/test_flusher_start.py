"""A session does not wait for its flusher process to start (issue 37, a short run's fixed cost).

Until the child says it is ready, the flusher's handle serves each request in the calling
writer thread (the same bytes and replies the child gives; a commit runs in the writer), and
the child takes over once ready; a session that ends first kills the child, which was sent
nothing. ``HeldFlusher`` is a real flusher whose child is handed its buffers only on
``release()`` — until then it cannot say ready — so which steps go where is deterministic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import dstt
from dstt.store import Repository
from dstt.store.flusher.parent import Flusher, flusher_supported
from dstt.training import session

from ._helpers import MLP, committed_steps, mlp_batch, same_bits, stored, train_step

pytestmark = pytest.mark.skipif(not flusher_supported(), reason="the flusher needs Linux memfd")


class HeldFlusher(Flusher):
    """A flusher whose child gets its shared buffers (and so can say ready) on ``release``."""

    made: ClassVar[list[HeldFlusher]] = []

    def _send_init(self) -> None:
        HeldFlusher.made.append(self)

    def release(self) -> None:
        Flusher._send_init(self)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> type[HeldFlusher]:
    import dstt.store._seam as _seam

    HeldFlusher.made = []
    monkeypatch.setattr(_seam, "Flusher", HeldFlusher)
    return HeldFlusher


@pytest.fixture
def commits_here(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps whose commit ran in this process (the others ran in the flusher)."""
    from dstt.store.commit import writer as writer_mod

    here: list[int] = []
    real = writer_mod.run_commit

    def counted(storage: Any, zf: Any, side: Any, job: Any) -> Any:
        here.append(job.step)
        return real(storage, zf, side, job)

    monkeypatch.setattr(writer_mod, "run_commit", counted)
    return here


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_steps_before_the_child_is_ready_are_written_here_then_the_child_takes_over(
    tmp_path: Path, held: type[HeldFlusher], commits_here: list[int]
) -> None:
    """Four steps while the child cannot start: written and committed here, nothing lost;
    then the child serves the next four. Every step reads back bit-exactly, and every
    update after the first stays exact across the switch (the step the child first digests
    is digested here too, against this process's copy of its parent)."""
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    after: dict[int, torch.Tensor] = {}
    with session(m, opt, run=tmp_path / "run", every=1) as s:
        for i in range(8):
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l1.weight.detach().clone()
            if i == 3:
                s.wait()  # step 4 sealed: every step so far commits now
                pipe = s._pipeline
                assert pipe is not None
                pipe.drain()
                (fl,) = held.made
                assert pipe.sink.flusher is fl
                assert not fl.ready
                assert fl.served_here == 4
                fl.release()
                assert fl.wait_ready(120)
        assert not fl.dead
    assert fl.served_here == 4  # the child wrote steps 5-8
    assert commits_here == [1, 2, 3, 4]  # and committed them
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == list(range(1, 9))
    for step, w in after.items():
        assert same_bits(stored(repo, step, "params/l1/weight"), w), step
    assert repo.verify().problems == []
    run = dstt.open(tmp_path / "run")
    ds = run.summaries()
    cols = [j for j, p in enumerate(ds["store_path"].values) if str(p).startswith("params/")]
    assert len(cols) == 4
    assert not ds["update_exact"].values[0, cols].any()  # the first step: no parent
    assert ds["update_exact"].values[1:, cols].all()
    for k in (4, 5, 6):  # the last step here, the switch, the child's own
        d = run.diff(k - 1, k, paths=[str(ds["store_path"].values[j]) for j in cols])
        row = run.summaries([k])
        for j in cols:
            want = float(d.sel(tensor=str(row["tensor"].values[j]))["delta_l2"])
            assert want > 0
            assert float(row["update_l2"].values[0, j]) == pytest.approx(want, rel=1e-5), (k, j)


def test_a_session_that_ends_before_its_flusher_is_ready_does_not_wait_for_it(
    tmp_path: Path, held: type[HeldFlusher], commits_here: list[int]
) -> None:
    """A short run: every step written and committed here, and the child, which was sent
    nothing, is killed at close (not waited for while it starts) — without a warning."""
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with session(m, opt, run=tmp_path / "run", every=1) as s:
        for i in range(3):
            train_step(m, opt, *mlp_batch(i))
            if i == 0:
                s.wait()  # step 1 copied: the flusher is made
                (fl,) = held.made
                assert fl.proc is not None
                pid = fl.proc.pid
    assert fl.served_here == 3
    assert fl.proc is None  # closed
    assert _gone(pid)
    assert commits_here == [1, 2, 3]
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2, 3]
    assert repo.verify().problems == []


def _layout() -> tuple[Any, Any]:
    from dstt.engine.capture.summaries import flat_digest_plan
    from dstt.store.format.flat import FlatLayout
    from dstt.store.format.layout import plan_chunks

    specs = [((3, 5), "float32"), ((7,), "float16"), ((300, 40), "float32"), ((9,), "float32")]
    arrays = [
        (f"params/l{i}/w", dt, plan_chunks(shape, np.dtype(dt).itemsize, 16 << 20))
        for i, (shape, dt) in enumerate(specs)
    ]
    layout = FlatLayout.build(arrays)
    plan = flat_digest_plan(
        [(a.path, a.dtype, a.offset, a.nbytes // np.dtype(a.dtype).itemsize) for a in layout.arrays]
    )
    return layout, plan


def _fill(fl: Flusher, layout: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    buf = fl.buffers[0]
    for a in layout.arrays:
        n = a.nbytes // np.dtype(a.dtype).itemsize
        buf[a.offset : a.offset + a.nbytes] = rng.standard_normal(n).astype(a.dtype).tobytes()


def test_a_write_served_here_gives_the_bytes_and_replies_the_child_gives(
    tmp_path: Path,
) -> None:
    """The handle's own service is the child's: the same file bytes, checksums, directory
    records and digests; the child's first digest of a plan digested here is this process's
    (compared with its copy of the previous step), and the child's next one compares with
    the copy it took then."""
    layout, plan = _layout()
    fl = HeldFlusher(max(layout.nbytes, 1), 2, wait=False)
    try:
        assert not fl.ready
        size = layout.nbytes + 4096
        paths = [tmp_path / f"s{i}.zip" for i in range(4)]
        for p in paths:
            p.write_bytes(bytes(size))
        replies = []
        for token, p in enumerate(paths):
            if token == 2:  # the child serves tokens 2 and 3
                fl.release()
                assert fl.wait_ready(120)
            _fill(fl, layout, seed=token % 2)  # tokens 0, 2 alike; 1, 3 alike
            replies.append(fl.write(0, layout, 0, str(p), plan, token))
        assert fl.served_here == 2
        assert not fl.dead
    finally:
        fl.close()
    (c0, d0, s0), (c1, d1, s1), (c2, d2, s2), (c3, d3, s3) = replies
    assert (c0, d0) == (c2, d2)  # here and there alike
    assert (c1, d1) == (c3, d3)
    assert paths[0].read_bytes() == paths[2].read_bytes()
    assert paths[1].read_bytes() == paths[3].read_bytes()
    assert None not in (s0, s1, s2, s3)
    assert s0["prev_token"] == -1
    assert s1["prev_token"] == 0
    assert s2["prev_token"] == 1  # the switch: digested here against token 1's copy
    assert s3["prev_token"] == 2  # the child's own copy, taken at token 2
    np.testing.assert_array_equal(s1["upd_sumsq"], s2["upd_sumsq"])  # 1 -> 0 is 0 -> 1
    np.testing.assert_array_equal(s1["upd_sumsq"], s3["upd_sumsq"])
    assert (s1["upd_sumsq"] > 0).all()
    for k in ("sumsq", "maxabs", "probe"):
        np.testing.assert_array_equal(s0[k], s2[k])
        np.testing.assert_array_equal(s1[k], s3[k])


def test_a_flusher_that_waits_is_ready_when_made() -> None:
    """``wait=True`` (the default, for the store's own callers and tests): ready at once, its
    threads known for ``urgent``."""
    fl = Flusher(1 << 16, 2)
    try:
        assert fl.ready
        assert fl.idle_threads
        assert fl.proc is not None
        pid = fl.proc.pid
    finally:
        fl.close()
    assert _gone(pid)


SESSION_IMPORTS = """
import json, sys
import torch
import dstt
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with dstt.session(model, opt, run=sys.argv[1]):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print(json.dumps([m for m in sys.argv[2:] if m in sys.modules]))
"""


def test_a_plain_session_imports_neither_the_multi_rank_sessions_nor_numcodecs(
    tmp_path: Path,
) -> None:
    """A session's start is part of a short run's fixed cost: a plain one loads no
    DeepSpeed or multi-rank machinery, and no numcodecs (~0.1 s: every codec registers on
    import) unless it encodes deltas."""
    import json
    import subprocess
    import sys

    unused = ["dstt.training.deepspeed", "dstt.training.distributed", "dstt.engine.ds.zero"]
    unused += ["dstt.engine.ds.deepspeed", "numcodecs"]
    got = subprocess.run(
        [sys.executable, "-c", SESSION_IMPORTS, str(tmp_path / "run"), *unused],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert json.loads(got.stdout.splitlines()[-1]) == []
    assert Repository.open(tmp_path / "run").reader().head() is not None


def test_the_factory_still_picks_the_deepspeed_session_for_a_deepspeed_class() -> None:
    from dstt.training.factory import _deepspeed_engine

    fake = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    assert _deepspeed_engine(fake())
    assert not _deepspeed_engine(torch.nn.Linear(2, 2))
    other = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "mylib.engine"})
    assert not _deepspeed_engine(other())


def test_a_short_session_never_starts_its_flusher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commits_here: list[int]
) -> None:
    """The default delay: a run that ends before ``DSTT_FLUSHER_START_S`` has every step
    written and committed here and starts no process at all (the fixed cost of a short
    run: the child's interpreter and imports, ~0.1-0.2 s of CPU)."""
    import dstt.store._seam as _seam

    made: list[Flusher] = []

    class Seen(Flusher):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(_seam, "Flusher", Seen)
    monkeypatch.setenv("DSTT_FLUSHER_START_S", "600")
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with session(m, opt, run=tmp_path / "run", every=1) as s:
        for i in range(3):
            train_step(m, opt, *mlp_batch(i))
            if i == 0:
                s.wait()
                (fl,) = made
                assert not fl.started
    assert not fl.started
    assert not fl.dead
    assert fl.served_here == 3
    assert commits_here == [1, 2, 3]
    assert not fl._starter.is_alive()  # close ended the thread that would have started it
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2, 3]
    assert repo.verify().problems == []


def test_a_flusher_starts_once_its_delay_is_up_and_takes_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commits_here: list[int]
) -> None:
    """A run longer than the delay gets its child without asking: it starts by itself and
    serves the steps after it is ready; every step reads back bit-exactly."""
    import time

    monkeypatch.setenv("DSTT_FLUSHER_START_S", "0.2")
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    after: dict[int, torch.Tensor] = {}
    with session(m, opt, run=tmp_path / "run", every=1) as s:
        for i in range(6):
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l1.weight.detach().clone()
            if i == 2:
                s.wait()
                pipe = s._pipeline
                assert pipe is not None
                fl = pipe.sink.flusher
                assert fl is not None
                deadline = time.monotonic() + 120
                while not fl.ready and time.monotonic() < deadline:  # no wait_ready: by itself
                    time.sleep(0.01)
                assert fl.ready
                pipe.drain()
                before = fl.served_here
        assert not fl.dead
    assert fl.served_here == before  # steps 4-6: the child's
    assert commits_here == list(range(1, before + 1))
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == list(range(1, 7))
    for step, w in after.items():
        assert same_bits(stored(repo, step, "params/l1/weight"), w), step


def test_wait_ready_starts_a_delayed_child_at_once_and_close_starts_none() -> None:
    fl = Flusher(1 << 16, 2, wait=False, start_after=600)
    try:
        assert not fl.started
        assert fl.wait_ready(120)  # (tests and the store's own callers: now)
        assert fl.proc is not None
        pid = fl.proc.pid
    finally:
        fl.close()
    assert _gone(pid)
    idle = Flusher(1 << 16, 2, wait=False, start_after=600)
    idle.close()
    assert not idle.started
    assert not idle._starter.is_alive()


def test_a_bad_flusher_delay_is_refused_when_the_session_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dstt.errors import ConfigError

    monkeypatch.setenv("DSTT_FLUSHER_START_S", "soon")
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with (
        pytest.raises(ConfigError, match="DSTT_FLUSHER_START_S must be a number"),
        session(m, opt, run=tmp_path / "run", every=1),
    ):
        pass
