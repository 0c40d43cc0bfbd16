"""One rank of the rank-fault tests (``test_rank_faults.py``), run as a child process.

``python faults_worker.py CASE RUN OUT`` with RANK/WORLD_SIZE/MASTER_* set (a gloo group of
2). Each rank trains its own small model (no collective in the step, so a rank that stops
does not hold the other in a collective) under ``dstt.session(..., every=1)``:

``raise``  rank 1 raises at the start of step 5 (steps 1-4 finished by both); rank 0 trains
           on to step 8
``kill``   rank 1, right after its optimizer step 5 (its copy of step 5 in flight), waits
           until steps 1-4 are committed (so a loaded machine cannot leave them in flight)
           and SIGKILLs itself; rank 0 trains on to step 8
``alone``  only rank 0 opens a session (rank 1 waits on the gloo barrier and then exits)

Rank 0 writes ``OUT/<case>.json``: the error its session raised (type and message), the
seconds from rank 1's fault to the end of its ``with`` block, and the committed steps.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dstt

RANK_TIMEOUT = 12.0


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def KILLED_AT(run: Path) -> Path:
    return run.parent / "killed_at"


def until_committed(run: Path, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(dstt.open(run).steps) >= n:
                return
        except dstt.DsttError:
            pass  # no commit yet
        time.sleep(0.05)
    raise TimeoutError(f"steps 1-{n} not committed in {timeout} s")


def train(case: str, run: Path, rank: int) -> dict[str, Any]:
    model, opt = build()
    out: dict[str, Any] = {"error": None}
    fault_at: float | None = None
    try:
        with dstt.session(model, opt, run=run, every=1, rank_timeout=RANK_TIMEOUT) as s:
            for step in range(1, 9):
                if rank == 1 and case == "raise" and step == 5:
                    raise RuntimeError("rank 1 fails at the start of step 5")
                x = torch.randn(8, 16)
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                s.log(loss=float(step))
                if rank == 1 and case == "kill" and step == 5:
                    until_committed(run, 4)  # its part of step 4 was sealed by this step
                    KILLED_AT(run).write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == 0 and step == 5:
                    fault_at = time.monotonic()
                time.sleep(0.05)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        chain = [e, e.__cause__]
        out["lost"] = any(isinstance(c, dstt.RankLostError) for c in chain)
        out["rank_error"] = isinstance(e, dstt.RankError)
    if fault_at is not None:
        out["after_fault_s"] = time.monotonic() - fault_at
    if KILLED_AT(run).exists():  # the kill came later than rank 0's step 5: count from it
        out["after_fault_s"] = time.time() - float(KILLED_AT(run).read_text())
    return out


def main() -> None:
    case, run, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    try:
        if case == "alone":
            res: dict[str, Any] = {"error": None}
            if rank == 0:
                model, opt = build()
                t0 = time.monotonic()
                try:
                    with dstt.session(model, opt, run=run, start_timeout=2):
                        pass
                except Exception as e:
                    res["error"] = f"{type(e).__name__}: {e}"
                    res["rank_error"] = isinstance(e, dstt.RankError)
                res["start_s"] = time.monotonic() - t0
        else:
            res = train(case, run, rank)
        if rank == 0:
            res["steps"] = list(dstt.open(run).steps) if (run / "zarr.json").exists() else []
            (out / f"{case}.json").write_text(json.dumps(res))
    except BaseException:
        (out / f"{case}.r{rank}.trace").write_text(traceback.format_exc())
        raise
    finally:
        if rank == 0 or case != "kill":
            os._exit(0)  # skip the group's teardown: its peer may be gone


if __name__ == "__main__":
    main()
