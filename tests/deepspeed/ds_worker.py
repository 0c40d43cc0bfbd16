"""One rank of the DeepSpeed tests, run as a child process (``python ds_worker.py PHASE ...``).

The parent (``conftest.py``) starts every rank with RANK/WORLD_SIZE/MASTER_* set, one process
per rank, and reads a JSON report per rank from ``OUT/<phase>.r<rank>.json``. One process runs
every ZeRO stage in turn, so the suite pays the interpreter/DeepSpeed start-up once per phase:

``train``   for each stage: a session over a fresh engine, K steps, sessions left open (step
            K stays in flight); then waits to be killed (SIGKILL: step K is lost)
``resume``  for each stage: a reference run without dstt (N steps, losses and gathered full
            parameters per step), then a fresh engine resumed from the run, continued to N;
            then ``engine.save_checkpoint`` / ``load_checkpoint`` through dstt's checkpoint
            engine; rank 0 also inspects the run with ``dstt.open``
``world1``  one rank resumes the runs the two ranks wrote (reshard 2 -> 1), and inspects them
``ckexit``  for each stage: ``DsttCheckpointEngine.attach``, two ``save_checkpoint`` calls with a
            step between them, then a normal exit WITHOUT ``close()`` (``test_ds_checkpoint``)
``ckload``  for each stage: a fresh engine ``load_checkpoint``s what ``ckexit`` left (``latest``)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

import faulthandler

import torch

faulthandler.dump_traceback_later(int(os.environ.get("DSTT_TEST_HANG_S", "600")), exit=True)

torch.set_num_threads(1)  # bit-exact CPU math needs a fixed reduction order


class Net(torch.nn.Module):
    """Odd sizes, so ZeRO partitions split parameters across ranks and pad the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 13)
        self.l2 = torch.nn.Linear(13, 5)
        self.norm = torch.nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.l2(torch.relu(self.l1(x))))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)


def make_engine(stage: int) -> Any:
    import deepspeed

    torch.manual_seed(0)
    net = Net()
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.5 * k))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=sched, config=cfg)
    return engine


def train_step(engine: Any, step: int) -> float:
    x, y = batch(step, engine.global_rank)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def full_params(engine: Any) -> dict[str, list[float]]:
    """Gathered full parameters (what every rank would see unpartitioned)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {
            n: p.detach().float().reshape(-1).tolist() for n, p in engine.module.named_parameters()
        }


def _committed(run: Path) -> list[int]:
    import dstt

    try:
        return dstt.open(run).steps
    except Exception:  # the run may not exist yet
        return []


def phase_train(root: Path, stages: list[int], k: int, out: dict[str, Any]) -> None:
    import dstt

    keep = []
    for stage in stages:
        engine = make_engine(stage)
        s = dstt.session(engine, run=root / f"z{stage}")
        s.start()
        keep.append((engine, s))
        losses = []
        for i in range(k):
            losses.append(train_step(engine, i))
            s.log(loss=losses[-1])
        # step k commits once step k+1's wait sealed it: steps 1..k-1 commit in the
        # background, step k stays in flight (staged, never sealed) and dies with the kill
        deadline = time.monotonic() + 120
        while s.step - 1 not in _committed(root / f"z{stage}"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {stage}: step {s.step - 1} never committed")
            time.sleep(0.02)
        out[str(stage)] = {"losses": losses, "step": s.step}
    _report(out)
    time.sleep(3600)


def phase_resume(root: Path, stages: list[int], n: int, out: dict[str, Any]) -> None:
    import dstt

    rank = int(os.environ["RANK"])
    for stage in stages:
        res: dict[str, Any] = out.setdefault(str(stage), {})
        ref_engine = make_engine(stage)
        ref_losses, ref_params = [], {}
        for i in range(n):
            ref_losses.append(train_step(ref_engine, i))
            ref_params[i + 1] = full_params(ref_engine)
        res["ref"] = ref_losses
        engine = make_engine(stage)
        with dstt.session(engine, run=root / f"z{stage}", resume=True) as s:
            res["resumed_at"] = r = s.step
            res["global_steps"] = engine.global_steps
            res["lr"] = engine.get_lr()[0]
            res["resumed"] = [train_step(engine, i) for i in range(r, n)]
            for _ in res["resumed"]:
                pass
        res.update(checkpoint_engine_roundtrip(root / f"ck{stage}", stage))
        if rank == 0:
            run = dstt.open(root / f"z{stage}")
            res["steps"] = run.steps
            bad = []
            for step in run.steps:
                tree = run.at(step).layer("l1")
                got = tree["l1"].to_dataset()
                for var in ("weight", "bias"):
                    want = ref_params[step][f"l1.{var}"]
                    if got[var].values.reshape(-1).tolist() != want:
                        bad.append((step, var))
                st = run.at(step).tensor("l2.weight", state="exp_avg").values
                if st.shape != (5, 13):
                    bad.append((step, "exp_avg shape"))
            res["inspect_bad"] = bad
            res["names"] = run.at(run.steps[-1]).names()
        _report(out)


def checkpoint_engine_roundtrip(ckdir: Path, stage: int) -> dict[str, Any]:
    """``save_checkpoint`` through dstt, one more step, then ``load_checkpoint`` into a fresh
    engine and the same step again: the losses must be equal."""
    from dstt.engine.ds.ds_checkpoint import DsttCheckpointEngine

    engine = make_engine(stage)
    ce = DsttCheckpointEngine.attach(engine)
    for i in range(2):
        train_step(engine, i)
    engine.save_checkpoint(str(ckdir), tag="t2")
    latest = ckdir / "latest"
    before = latest.exists()  # must not move before the tag is durable
    after_save = train_step(engine, 2)  # DeepSpeed commits the tag here
    engine.save_checkpoint(str(ckdir), tag="t3")
    ce.close()  # commits t3, waits for both tags
    latest_now = latest.read_text() if latest.exists() else None
    fresh = make_engine(stage)
    DsttCheckpointEngine.attach(fresh)
    path, _ = fresh.load_checkpoint(str(ckdir), tag="t2")
    loaded = train_step(fresh, 2)
    fresh.checkpoint_engine.close()
    return {
        "ck_latest_before": before,
        "ck_latest": latest_now,
        "ck_after_save": after_save,
        "ck_loaded": loaded,
        "ck_path": str(path),
        "ck_global_steps": fresh.global_steps,
    }


def bf16_resume(run: Path) -> dict[str, Any]:
    """ZeRO-2 with bf16 weights: 3 steps, a new session resumes, 3 more; against 6 in one go."""
    import dstt

    def bf16_engine() -> Any:
        import deepspeed

        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10**9,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2},
        }
        return deepspeed.initialize(model=net, optimizer=opt, config=cfg)[0]

    def step(engine: Any, i: int) -> float:
        x, y = batch(i, 0)
        loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
        engine.backward(loss)
        engine.step()
        return float(loss.item())

    engine = bf16_engine()
    ref = [step(engine, i) for i in range(6)]
    engine = bf16_engine()
    with dstt.session(engine, run=run):
        first = [step(engine, i) for i in range(3)]
    engine = bf16_engine()
    with dstt.session(engine, run=run, resume=True) as s:
        rest = [step(engine, i) for i in range(s.step, 6)]
    dtype = str(dstt.open(run).at(3).tensor("l1.weight").dtype)
    return {"ref": ref, "got": first + rest, "view_dtype": dtype}


def phase_world1(root: Path, stages: list[int], out: dict[str, Any]) -> None:
    import dstt

    for stage in stages:
        res: dict[str, Any] = out.setdefault(str(stage), {})
        run = dstt.open(root / f"z{stage}")
        head = run.steps[-1]
        engine = make_engine(stage)
        with dstt.session(engine, run=root / f"z{stage}", resume=True) as s:
            res["resumed_at"] = s.step
            now = full_params(engine)
            snap = run.at(head)
            res["params_equal"] = all(
                snap.tensor(n).values.reshape(-1).tolist() == v for n, v in now.items()
            )
            res["loss"] = train_step(engine, s.step)
        res["head"] = head
        _report(out)
    # ZeRO stages restore into each other through the logical tensors (3 -> 1 here)
    head = dstt.open(root / "z3").steps[-1]
    engine = make_engine(1)
    with dstt.session(engine, run=root / "z3", resume=True) as s:
        snap = dstt.open(root / "z3").at(head)
        out["cross_stage_3_1"] = s.step == head and all(
            snap.tensor(n).values.reshape(-1).tolist() == v for n, v in full_params(engine).items()
        )
    out["bf16"] = bf16_resume(root / "bf16")
    _report(out)
    # a stage-0 run cannot resume under ZeRO (and back): a typed error, not a crash
    from dstt.errors import RankError

    for stored, live in ((0, 2), (2, 0)):
        engine = make_engine(live)
        try:
            with dstt.session(engine, run=root / f"z{stored}", resume=True):
                pass
            out[f"mismatch_{stored}_{live}"] = "no error"
        except RankError as e:
            out[f"mismatch_{stored}_{live}"] = f"RankError: {e}"
    _report(out)


def phase_ckexit(root: Path, stages: list[int], out: dict[str, Any]) -> None:
    """The README's pattern, as a new user writes it: attach, save, exit (no ``close()``)."""
    from dstt.engine.ds.ds_checkpoint import DsttCheckpointEngine

    for stage in stages:
        engine = make_engine(stage)
        DsttCheckpointEngine.attach(engine)
        ckdir = root / f"z{stage}"
        train_step(engine, 0)
        engine.save_checkpoint(str(ckdir), tag="t1")
        at1 = full_params(engine)
        train_step(engine, 1)  # DeepSpeed commits t1 here
        engine.save_checkpoint(str(ckdir), tag="t2")  # nothing commits t2 but the exit
        out[str(stage)] = {"params": full_params(engine), "params1": at1}
    if os.environ["WORLD_SIZE"] == "1":  # a save that raises half-way is never committed
        engine = make_engine(0)
        DsttCheckpointEngine.attach(engine)
        ckdir = root / "raised"
        train_step(engine, 0)
        engine.save_checkpoint(str(ckdir), tag="t1")
        train_step(engine, 1)
        try:  # dstt cannot store complex tensors: the first file's save raises
            engine.save_checkpoint(
                str(ckdir), tag="t2", client_state={"z": torch.zeros(20, dtype=torch.complex64)}
            )
        except Exception as e:
            out["raised"] = type(e).__name__
        train_step(engine, 2)  # on main, this step committed the half-saved t2
        engine.save_checkpoint(str(ckdir), tag="t3")
    _report(out)


def phase_ckload(root: Path, stages: list[int], out: dict[str, Any]) -> None:
    from dstt.engine.ds.ds_checkpoint import DsttCheckpointEngine

    for stage in stages:
        engine = make_engine(stage)
        ce = DsttCheckpointEngine.attach(engine)
        path, _ = engine.load_checkpoint(str(root / f"z{stage}"))
        out[str(stage)] = {
            "path": str(path),
            "global_steps": engine.global_steps,
            "params": full_params(engine),
        }
        ce.close()
    _report(out)


_OUT: Path | None = None
_PHASE = ""


def _report(out: dict[str, Any]) -> None:
    assert _OUT is not None
    rank = os.environ.get("RANK", "0")
    tmp = _OUT / f"{_PHASE}.r{rank}.json.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(_OUT / f"{_PHASE}.r{rank}.json")


def main() -> None:
    global _OUT, _PHASE
    _PHASE, root, _OUT = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    stages = [int(x) for x in sys.argv[4].split(",")]
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out: dict[str, Any] = {}
    try:
        if _PHASE == "train":
            phase_train(root, stages, int(sys.argv[5]), out)
        elif _PHASE == "resume":
            phase_resume(root, stages, int(sys.argv[5]), out)
        elif _PHASE == "world1":
            phase_world1(root, stages, out)
        elif _PHASE == "ckexit":
            phase_ckexit(root, stages, out)
        elif _PHASE == "ckload":
            phase_ckload(root, stages, out)
    except BaseException:
        out["error"] = traceback.format_exc()
        _report(out)
        sys.stderr.write(out["error"])
        sys.stderr.flush()
        os._exit(1)  # the other ranks may be blocked in a collective: do not wait for them
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
