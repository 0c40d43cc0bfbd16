"""One rank of an ``every="auto"`` DDP run (``test_auto_ranks.py``): rank 1 writes through a
slowed storage, so its engine is busy where rank 0's is not; each rank reports which steps
its session stored."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import dstt
from dstt.store._internal import LocalStorage, Repository
from dstt.store.storage.memory import FaultyStorage

STEPS = 16


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if rank == 0:
            Repository.create(root)
        dist.barrier()
        storage = LocalStorage(root)
        if rank == 1:  # this rank's engine is the busy one
            storage = FaultyStorage(storage, on_write=lambda key: time.sleep(0.05))
        with dstt.session(
            model, opt, run=Repository(storage), every="auto", max_backlog=2, max_gap=3
        ) as s:
            for step in range(1, STEPS + 1):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.log(loss=loss)
        stored = sorted(m.step for m in s.metrics if m.stored)
        (out / f"auto.r{rank}.json").write_text(json.dumps({"ok": True, "stored": stored}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
