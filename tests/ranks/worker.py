"""One rank of the PyTorch-native distributed tests, run as a child process.

``python worker.py PHASE ROOT OUT KINDS [ARGS]`` with RANK/WORLD_SIZE/MASTER_* set (several
ranks: a gloo process group) or unset (``single``: one plain process, no process group). The
parent (``conftest.py``) reads one JSON report per rank, ``OUT/<phase>.r<rank>.json``. One
process runs every kind of parallelism in turn (``ddp``, ``fsdp``, ``tp``, ``fsdp_tp``), each
with its own run ``ROOT/<kind>``, so the suite pays the interpreter start-up once per phase:

``train``  per kind: a reference run without dstt (N steps: losses, the full state gathered
           with ``get_state_dict(full_state_dict=True)`` at K and N); a session over a fresh
           model, K steps, closed; a second fresh model resumed from the run (``resume=True``),
           trained to N: its losses and state against the reference
``single`` one plain process, no process group: per kind, the run's logical tensors at N
           against the gathered state; a plain, unwrapped model and optimizer resumed from
           the run (reshard to 1 process) against it; two more steps committed
``grow``   per kind, the ranks resume what ``single`` committed (reshard 1 -> world): local
           shards against the one-process state; one more step committed
``crash``  per kind (one kind per process): a session that trains until killed
``after``  per kind: the ranks resume a crashed run; state against a reference trained to the
           same step without dstt, then two more steps against it
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

faulthandler.dump_traceback_later(int(os.environ.get("DSTT_TEST_HANG_S", "300")), exit=True)
torch.set_num_threads(1)  # bit-exact CPU math needs a fixed reduction order

N, K = 6, 3  # steps of the reference run; steps of the first session


class Net(torch.nn.Module):
    """Odd sizes (shards of 13 rows split 7/6 over 2 ranks), a buffer, dropout (RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 12)
        self.up = torch.nn.Linear(12, 26)
        self.down = torch.nn.Linear(26, 12)
        self.norm = torch.nn.LayerNorm(12)
        self.head = torch.nn.Linear(12, 5)
        self.drop = torch.nn.Dropout(0.1)
        self.register_buffer("scale", torch.tensor([1.0, 0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.down(self.drop(torch.relu(self.up(h))))
        return self.head(self.norm(h)) * self.scale[0]


def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)


def build(kind: str, *, plain: bool = False) -> tuple[torch.nn.Module, Any, Any]:
    """A fresh model (same init on every rank), wrapped for ``kind``, its AdamW and scheduler.
    ``plain``: no wrapping (a one-process model)."""
    rank, world = rank_world()
    torch.manual_seed(0)
    net = Net()
    model: torch.nn.Module = net
    if not plain:
        if kind == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(net)
        elif kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for m in (net.embed, net.up, net.down):
                fully_shard(m, mesh=mesh)
            fully_shard(net, mesh=mesh)
        elif kind in ("tp", "fsdp_tp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            if kind == "tp":
                tp_mesh = init_device_mesh("cpu", (world,))
            else:
                mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
                tp_mesh = mesh2["tp"]
            parallelize_module(net, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            if kind == "fsdp_tp":
                from torch.distributed.fsdp import fully_shard

                fully_shard(net, mesh=mesh2["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    # each data-parallel rank its own dropout masks from here on (tensor-parallel ranks of
    # one group draw the same: their activations are replicated)
    torch.manual_seed(100 + {"tp": 0, "fsdp_tp": rank // 2}.get(kind, rank))
    return model, opt, sched


def data_rank(kind: str) -> int:
    """Which batch a rank trains on: its data-parallel index (tensor-parallel ranks of one
    group must see the same input)."""
    rank, world = rank_world()
    return {"tp": 0, "fsdp_tp": rank // 2}.get(kind, rank) if world > 1 else 0


def train_step(model: torch.nn.Module, opt: Any, sched: Any, step: int, kind: str) -> float:
    x, y = batch(step, data_rank(kind))
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def full_state(model: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """Every logical tensor as dstt names it: ``params/...``, ``buffers/...``,
    ``optim/<state>/...`` (gathered with DCP's ``get_state_dict`` where ranks hold shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    params = set(osd["state"])  # AdamW has state for every parameter after a step
    out: dict[str, torch.Tensor] = {}
    for n, t in msd.items():
        kind = "params" if n in params else "buffers"
        out[f"{kind}/{n.replace('.', '/')}"] = t.detach().clone()
    for n, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{k}/{n.replace('.', '/')}"] = v.detach().clone()
    return out


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ (bit for bit) between two full states."""
    bad = sorted(set(a) ^ set(b))
    for n in sorted(set(a) & set(b)):
        x, y = a[n], b[n]
        if (
            x.shape != y.shape
            or x.dtype != y.dtype
            or not torch.equal(
                x.view(-1).view(torch.uint8) if x.numel() else x,
                y.view(-1).view(torch.uint8) if y.numel() else y,
            )
        ):
            bad.append(n)
    return bad


def report(out: Path, phase: str, data: dict[str, Any]) -> None:
    rank, _ = rank_world()
    tag = os.environ.get("DSTT_TEST_TAG", phase)
    (out / f"{tag}.r{rank}.json").write_text(json.dumps(data, default=str))


def phase_train(root: Path, out: Path, kinds: list[str]) -> dict[str, Any]:
    import dstt

    res: dict[str, Any] = {}
    rank, _world = rank_world()
    for kind in kinds:
        r: dict[str, Any] = res.setdefault(kind, {})
        model, opt, sched = build(kind)
        ref_losses = []
        for step in range(1, N + 1):
            ref_losses.append(train_step(model, opt, sched, step, kind))
            if step == K:
                at_k = full_state(model, opt)
        at_n = full_state(model, opt)
        if rank == 0:
            torch.save({"K": at_k, "N": at_n}, out / f"{kind}.ref.pt")
        run = root / kind
        model, opt, sched = build(kind)
        with dstt.session(model, opt, run=run, scheduler=sched, rank_timeout=120) as s:
            r["session"] = type(s).__name__
            losses = [train_step(model, opt, sched, step, kind) for step in range(1, K + 1)]
        r["first_losses_equal"] = losses == ref_losses[:K]
        model, opt, sched = build(kind)
        with dstt.session(model, opt, run=run, scheduler=sched, resume=True, rank_timeout=120) as s:
            r["resumed_at"] = s.step
            r["restored_diff"] = equal(full_state(model, opt), at_k)
            r["lr_after_resume"] = sched.get_last_lr()
            losses += [train_step(model, opt, sched, step, kind) for step in range(K + 1, N + 1)]
        r["losses_equal"] = losses == ref_losses
        r["losses"] = losses
        r["ref_losses"] = ref_losses
        r["final_diff"] = equal(full_state(model, opt), at_n)
        # a snapshot loaded into the wrapped/sharded model on every rank (each its own box)
        model, opt, sched = build(kind)
        dstt.open(run).at(K).load_into(model, opt, sched)
        r["load_into_diff"] = equal(full_state(model, opt), at_k)
        r["load_into_lr"] = sched.get_last_lr()
    return res


def phase_single(root: Path, out: Path, kinds: list[str]) -> dict[str, Any]:
    import dstt
    from dstt.store import Repository

    res: dict[str, Any] = {}
    for kind in kinds:
        r: dict[str, Any] = res.setdefault(kind, {})
        ref = torch.load(out / f"{kind}.ref.pt")["N"]
        run = dstt.open(root / kind)
        r["steps"] = list(run.steps)
        snap = run.at(N)
        got = {}
        for path in ref:
            kind_, _, rest = path.partition("/")
            if kind_ == "optim":
                state, _, name = rest.partition("/")
                got[path] = torch.from_numpy(
                    snap.to_numpy(name.replace("/", "."), state=state, native=True).copy()
                )
            else:
                got[path] = torch.from_numpy(
                    snap.to_numpy(rest.replace("/", "."), native=True).copy()
                )
        r["logical_diff"] = equal(got, ref)
        r["names"] = snap.names()
        # write-time summaries: one row per logical tensor, its stats over the whole tensor
        summ = run.summaries()
        r["summary_tensors"] = sorted(str(t) for t in summ["tensor"].values)
        r["summary_steps"] = [int(x) for x in summ["step"].values]
        errs = []
        for path, t in ref.items():
            if not path.startswith("params/"):
                continue
            name = path[len("params/") :].replace("/", ".")
            x = t.double()
            for field, want in (
                ("l2", x.norm()),
                ("maxabs", x.abs().max()),
                ("rms", x.pow(2).mean().sqrt()),
            ):
                have = float(summ[field].sel(step=N, tensor=name))
                errs.append(abs(have - float(want)) / max(float(want), 1e-30))
        r["summary_max_rel_err"] = max(errs)
        r["up_dims"] = list(snap.tensor("up.weight").dims)
        model, opt, sched = build(kind, plain=True)
        with dstt.session(model, opt, run=root / kind, scheduler=sched, resume=True) as s:
            r["session"] = type(s).__name__
            r["resumed_at"] = s.step
            r["restored_diff"] = equal(full_state(model, opt), ref)
            for step in range(N + 1, N + 3):
                train_step(model, opt, sched, step, kind)
        torch.save(full_state(model, opt), out / f"{kind}.single.pt")
        r["steps_after"] = list(dstt.open(root / kind).steps)
        r["verify_ok"] = Repository.open(root / kind).verify().ok
    return res


def phase_grow(root: Path, out: Path, kinds: list[str]) -> dict[str, Any]:
    import dstt

    res: dict[str, Any] = {}
    for kind in kinds:
        r: dict[str, Any] = res.setdefault(kind, {})
        ref = torch.load(out / f"{kind}.single.pt")
        model, opt, sched = build(kind)
        with dstt.session(
            model, opt, run=root / kind, scheduler=sched, resume=True, rank_timeout=120
        ) as s:
            r["resumed_at"] = s.step
            r["restored_diff"] = equal(full_state(model, opt), ref)
            train_step(model, opt, sched, N + 3, kind)
        r["steps_after"] = list(dstt.open(root / kind).steps)
    return res


def phase_crash(root: Path, out: Path, kinds: list[str]) -> dict[str, Any]:
    """Train until killed (the parent SIGKILLs a rank once steps have committed)."""
    import dstt

    kind = kinds[0]
    model, opt, sched = build(kind)
    with dstt.session(model, opt, run=root / f"crash-{kind}", scheduler=sched, rank_timeout=30):
        for step in range(1, 2001):
            train_step(model, opt, sched, step, kind)
            time.sleep(0.01)
    return {"finished": True}  # not reached: the parent kills the ranks first


def phase_after(root: Path, out: Path, kinds: list[str]) -> dict[str, Any]:
    """Resume a crashed run; state and two more steps against a reference without dstt."""
    import dstt

    kind = kinds[0]
    run = root / f"crash-{kind}"
    head = dstt.open(run).steps[-1]
    model, opt, sched = build(kind)
    for step in range(1, head + 1):
        train_step(model, opt, sched, step, kind)
    ref = full_state(model, opt)
    ref_losses = [train_step(model, opt, sched, step, kind) for step in (head + 1, head + 2)]
    model, opt, sched = build(kind)
    with dstt.session(model, opt, run=run, scheduler=sched, resume=True, rank_timeout=60) as s:
        r: dict[str, Any] = {
            "head": head,
            "resumed_at": s.step,
            "restored_diff": equal(full_state(model, opt), ref),
        }
        r["losses_equal"] = [
            train_step(model, opt, sched, step, kind) for step in (head + 1, head + 2)
        ] == ref_losses
    return r


def phase_misuse(root: Path, out: Path, kinds: list[str]) -> dict[str, Any]:
    """Sessions the ranks disagree on, and a session on rank 0 only: typed errors, no hang."""
    import dstt

    rank, _ = rank_world()
    r: dict[str, Any] = {}
    model, opt, _sched = build("ddp")
    try:
        with dstt.session(model, opt, run=root / "disagree", every=1 + rank, rank_timeout=30):
            pass
    except Exception as e:
        r["disagree"] = f"{type(e).__name__}: {e}"
    try:
        with dstt.session(model, opt, run=root / f"own-{rank}", rank_timeout=30):
            pass
    except Exception as e:
        r["two_runs"] = f"{type(e).__name__}: {e}"
    t0 = time.monotonic()
    if rank == 0:
        try:
            with dstt.session(model, opt, run=root / "subset", rank_timeout=3):
                pass
        except Exception as e:
            r["subset"] = f"{type(e).__name__}: {e}"
    r["subset_s"] = time.monotonic() - t0
    return r


PHASES = {
    "train": phase_train,
    "single": phase_single,
    "grow": phase_grow,
    "crash": phase_crash,
    "after": phase_after,
    "misuse": phase_misuse,
}


def main() -> None:
    phase, root, out, kinds = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    rank, world = rank_world()
    if "RANK" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = PHASES[phase](root, out, kinds.split(","))
        report(out, phase, {"ok": True, **data})
    except BaseException as e:
        report(
            out,
            phase,
            {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()},
        )
        raise
    finally:
        if "RANK" in os.environ:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    time.sleep(0)


if __name__ == "__main__":
    main()
