"""Replay light steps of a DDP run of any size in a gloo world of that size on localhost.

:func:`replay_world` ``torch.save``s the restored objects (so each rank unpickles its own
copy), every rank's micro-batches and RNG; ``world`` spawned ranks each wrap the model in
DDP as training did (``no_sync`` on all but a step's last micro-batch) and replay the steps,
so the real allreduce sums the gradients in the collective's own order. Rank 0 saves the
state after each step for the parent to load back. Rejected: summing the ranks' gradients
in one process beyond two ranks (a+b+c is not the allreduce's order), and emulating gloo's
order (it follows the algorithm gloo picks per size and version: not provable).
docs/decisions.md, "Light steps".
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dstt.engine.state.optimizers import optimizers_of
from dstt.engine.state.torch_state import get_rng, set_rng
from dstt.errors import ConfigError, ReplayError

if TYPE_CHECKING:
    from .replay_kit import LossFn, ReplayKit

__all__ = ["WorldReplay", "replay_world"]


class WorldReplay:
    """What a gloo world replayed: rank 0's micro-batch losses per step (``losses[n]``) and
    :meth:`load`, which puts the state after step ``n`` into the live objects."""

    def __init__(self, folder: tempfile.TemporaryDirectory[str], steps: int, world: int) -> None:
        self._folder, self.world = folder, world
        self.losses: list[list[float]] = [list(self._rec(n, 0)["losses"]) for n in range(steps)]

    def _rec(self, n: int, rank: int) -> Any:  # noqa: ANN401 - what the rank saved
        return torch.load(Path(self._folder.name) / f"s{n}.r{rank}.pt", weights_only=False)

    def load(self, n: int, kit: ReplayKit) -> list[Any]:
        """Load the state after step ``n`` into ``kit``'s objects; each rank's RNG there."""
        rec = self._rec(n, 0)
        kit.model.load_state_dict(rec["model"])
        for name, opt in optimizers_of(kit.optimizer).items():
            opt.load_state_dict(rec["optimizer"][name])
        if kit.scheduler is not None:
            kit.scheduler.load_state_dict(rec["sched"])
        return [self._rec(n, r)["rng_state"] for r in range(self.world)]

    def close(self) -> None:
        self._folder.cleanup()


def replay_world(
    kit: ReplayKit,
    loss_fn: LossFn,
    batches: list[list[list[Any]]],
    rngs: list[Any],
    *,
    warm: bool = True,
) -> WorldReplay:
    """Replay ``len(batches)`` optimizer steps of a DDP run over ``len(rngs)`` spawned gloo
    ranks, starting from ``kit``'s live objects: ``batches[n][r]`` is rank ``r``'s
    micro-batches at step ``n``, ``rngs[r]`` its RNG state; ``warm``: training's DDP had
    taken a step before the first replayed one (its buckets rebuilt in gradient-ready
    order). ``ConfigError`` if the objects cannot be pickled; ``ReplayError`` if a rank
    fails."""
    if kit.backward is not None:
        raise ConfigError(
            f"rebuilding a light step of a DDP run of {len(rngs)} ranks replays a plain loop in "
            "a spawned gloo world; a framework trainer's kit cannot travel there: pass "
            "model=, optimizer=, scheduler=, loss_fn= (and dataset=) instead of trainer="
        )
    world = len(rngs)
    job = {
        "model": kit.model,
        "optimizer": kit.optimizer,
        "sched": kit.scheduler,
        "before_step": kit.before_step,
        "loss_fn": loss_fn,
        "batches": batches,
        "rngs": rngs,
        "warm": warm,
    }
    folder = tempfile.TemporaryDirectory(prefix="dstt-rebuild-")
    blob = Path(folder.name) / "job.pt"
    buf = io.BytesIO()
    try:
        torch.save(job, buf)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        folder.cleanup()
        raise ConfigError(
            f"rebuilding a light step of a DDP run of {world} ranks replays it in {world} "
            "spawned gloo ranks, which get the model, optimizer, scheduler, loss_fn and "
            f"before_step by pickle, and one of them cannot be pickled ({e}). Pass objects "
            "whose classes and functions are defined at the top level of an importable "
            "module (no lambda or closure, e.g. a LambdaLR's function a module-level def)"
        ) from e
    blob.write_bytes(buf.getvalue())
    from torch.multiprocessing.spawn import spawn

    try:
        spawn(_rank_main, args=(world, _free_port(), str(blob)), nprocs=world)
    except Exception as e:
        folder.cleanup()
        raise ReplayError(
            f"replaying the light steps in a gloo world of {world} ranks failed: {e}. The "
            "ranks are spawned processes that import the calling script: guard its top "
            "level with `if __name__ == '__main__':`; each rank's traceback is printed above"
        ) from e
    return WorldReplay(folder, len(batches), world)


def _rank_main(rank: int, world: int, port: int, blob: str) -> None:
    """One spawned rank: restore the objects, wrap the model in DDP, replay every step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .replay_kit import ReplayKit, _optimizer_step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        job = torch.load(blob, weights_only=False)
        model, opts, sched = job["model"], optimizers_of(job["optimizer"]), job["sched"]
        kit = ReplayKit(model, job["optimizer"], sched, before_step=job["before_step"])
        ddp = DistributedDataParallel(model)
        if job["warm"]:  # training's DDP rebuilt its buckets after its first step
            _warm_up(ddp, model, job["loss_fn"], job["batches"][0][rank][0])
        set_rng(job["rngs"][rank])
        out = Path(blob).parent
        for n, step in enumerate(job["batches"]):
            mine = step[rank]
            ddp.train()
            for opt in opts.values():
                opt.zero_grad(set_to_none=True)
            losses = []
            for m, batch in enumerate(mine):
                sync = m == len(mine) - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    loss = job["loss_fn"](ddp, batch)
                    if loss.dim() > 0:
                        loss = loss.mean()
                    loss.backward()
                losses.append(float(loss.detach().float().mean()))
            _optimizer_step(kit)
            rec: dict[str, Any] = {"losses": losses, "rng_state": get_rng()}
            if rank == 0:
                rec["model"] = model.state_dict()
                rec["optimizer"] = {k: o.state_dict() for k, o in opts.items()}
                rec["sched"] = None if sched is None else sched.state_dict()
            torch.save(rec, out / f"s{n}.r{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Done, every file written and closed: leave without the interpreter's finalization, in
    # which gloo's threads abort the process now and then (SIGABRT, "terminate called without
    # an active exception", ~1 exit in 20 on torch 2.13, no Python frame left) and the parent
    # would see a failed rank. A rank that raised exits through spawn's error path as before.
    os._exit(0)


def _warm_up(ddp: torch.nn.Module, model: torch.nn.Module, loss_fn: LossFn, batch: object) -> None:
    """One forward and backward, undone (gradients, buffers), so that the next forward
    rebuilds DDP's buckets in gradient-ready order as training's did after its first step:
    gloo sums each element in an order set by its place in the bucket, so the layout must
    be training's for the allreduce to be bit for bit."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    rng = get_rng()
    ddp.train()
    loss = loss_fn(ddp, batch)
    (loss.mean() if loss.dim() > 0 else loss).backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    set_rng(rng)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
