"""A 2-rank FSDP2 run (real spawned gloo ranks on CPU) as one virtual Zarr store: the evenly
split tensors are one logical array each, read by plain xarray in a process that imports
neither dstt nor torch, bit for bit against ``dstt.open(run).trajectory``; the unevenly split
head is left out and listed; re-running after a resume appends without rewriting, and after a
resume on one process (another chunk grid) drops the sharded tensors with their references."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from virtual_helpers import read_plain, same_bytes

import dstt

WORKER = Path(__file__).with_name("fsdp_virtual_worker.py")
ROOT = Path(__file__).resolve().parents[2]
EVEN = {"0.weight": "params/0/weight", "0.bias": "params/0/bias"}
UNEVEN = ("params/2/weight", "params/2/bias", "optim/exp_avg/2/weight")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsdp2(run: Path, steps: int, logs: Path, *, resume: bool = False, world: int = 2) -> None:
    """``world`` ranks train ``run`` up to step ``steps`` (``world=1``: one plain process,
    no process group, no sharding)."""
    port, procs = free_port(), []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
            env["MASTER_PORT"] = str(port)
        log = logs / f"w{world}.r{rank}.{steps}.log"
        with open(log, "wb") as f:
            cmd = [sys.executable, str(WORKER), str(run), str(steps), str(int(resume))]
            procs.append((log, subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)))
    try:
        codes = [p.wait(timeout=300) for _, p in procs]
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world, "\n".join(log.read_text() for log, _ in procs)


def check(run_dir: Path, refs: Path) -> None:
    """The no-dstt reader sees every even tensor and the loss exactly as dstt does."""
    run = dstt.open(run_dir)
    got = read_plain(refs, [*EVEN.values(), "optim/exp_avg/0/weight"])
    assert got["steps"] == [h.step for h in run.commits()]
    want_loss = np.asarray(run.metrics()["loss"].values, dtype=np.float64)
    assert got["loss"] == want_loss.tolist()
    for name, path in EVEN.items():
        assert same_bytes(got[path], run.trajectory(name).values), name
    exp_avg = run.trajectory("0.weight", state="exp_avg").values
    assert same_bytes(got["optim/exp_avg/0/weight"], exp_avg)


def test_an_fsdp2_run_reads_as_one_store_bit_for_bit(tmp_path: Path) -> None:
    run_dir, refs = tmp_path / "run", tmp_path / "run.refs.json"
    fsdp2(run_dir, 3, tmp_path)
    run = dstt.open(run_dir)
    table = run.arrays(run.commits()[-1])
    assert any(p.startswith("dtensor/w2/r1/params/0/") for p in table), "stored as boxes"
    rep = run.virtual(refs)
    assert rep.steps == (1, 2, 3)
    assert not rep.left_out_steps
    for path in UNEVEN:
        assert "chunked differently" in rep.left_out_arrays[path], path
    assert not set(EVEN.values()) & set(rep.left_out_arrays)
    stored = json.loads(refs.read_text())["refs"]
    assert not any(k.startswith("run/dtensor") for k in stored), "boxes are not arrays"
    # each step's weight is two chunks, one in each rank's step file
    urls = {stored[f"run/params/0/weight/c/0/{j}/0"][0] for j in (0, 1)}
    assert len(urls) == 2
    check(run_dir, refs)

    before = {k: v for k, v in stored.items() if isinstance(v, list)}
    fsdp2(run_dir, 5, tmp_path, resume=True)
    rep = dstt.open(run_dir).virtual(refs)
    assert rep.added == (4, 5)
    assert rep.steps == (1, 2, 3, 4, 5)
    after = json.loads(refs.read_text())["refs"]
    assert all(after[k] == v for k, v in before.items()), "old references rewritten"
    check(run_dir, refs)

    # one plain process resumes it: the weight is one stored array of 12 rows a chunk now,
    # not the ranks' 6-row boxes: no chunk grid holds both, so it goes, with its references
    fsdp2(run_dir, 6, tmp_path, resume=True, world=1)
    rep = dstt.open(run_dir).virtual(refs)
    assert rep.added == (6,)
    assert "changed at step 6" in rep.left_out_arrays["params/0/weight"]
    after = json.loads(refs.read_text())["refs"]
    assert not [k for k in after if k.startswith("run/params/0/weight/")]
