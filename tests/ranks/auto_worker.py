"""One rank of an ``every="auto"`` run over two spawned gloo ranks (``test_auto_ranks.py``):
DDP or FSDP2 over a map-style dataset split by a ``DistributedSampler`` (each rank records
its own samples), dropout (each rank its own RNG) and an LR scheduler. With ``auto``, rank 1
writes through a slowed storage, so its engine is busy where rank 0's is not; ``1``: the
every=1 reference. Each rank reports which steps its session stored. The test builds the
same objects in one process from :func:`plain` to rebuild the light steps."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STEPS = 16
WORLD = 2
BATCH = 4
DATA = torch.utils.data.TensorDataset(
    torch.randn(STEPS * BATCH * WORLD, 8, generator=torch.Generator().manual_seed(1)),
    torch.randn(STEPS * BATCH * WORLD, 4, generator=torch.Generator().manual_seed(2)),
)


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def decay(k: int) -> float:
    """The LR schedule (a module-level function: a 3-rank rebuild pickles the scheduler)."""
    return 1.0 / (1.0 + 0.3 * k)


def plain() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model (same init on every rank), its Adam and LR scheduler, unwrapped."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    return net, opt, sched


def main() -> None:
    import dstt
    from dstt.store._internal import LocalStorage, Repository
    from dstt.store.storage.memory import FaultyStorage

    root, out, kind, every = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        net, _, _ = plain()
        if kind == "ddp":
            model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(net)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
        torch.manual_seed(100 + rank)  # each rank its own dropout masks
        random.seed(100 + rank)  # and every RNG a step stores seeded, so that two runs
        np.random.seed(100 + rank)  # (the reference and the auto one) store the same
        sampler = torch.utils.data.DistributedSampler(DATA, world, rank, shuffle=False)
        loader = torch.utils.data.DataLoader(DATA, batch_size=BATCH, sampler=sampler)
        if rank == 0:
            Repository.create(root)
        dist.barrier()
        storage: Any = LocalStorage(root)
        options: dict[str, Any] = {"every": 1}
        if every == "auto":
            options = {"every": "auto", "max_backlog": 2, "max_gap": 3}
            if rank == 1:  # this rank's engine is the busy one
                storage = FaultyStorage(storage, on_write=lambda key: time.sleep(0.05))
        with dstt.session(model, opt, run=Repository(storage), scheduler=sched, **options) as s:
            t0 = time.perf_counter()
            for batch in s.data(loader):
                loss = loss_fn(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                s.log(loss=loss)
            step_s = (time.perf_counter() - t0) / STEPS  # a training step, capture included
        stored = sorted(m.step for m in s.metrics if m.stored)
        report = {"ok": True, "stored": stored, "step_s": step_s}
        (out / f"{kind}{every}.r{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
