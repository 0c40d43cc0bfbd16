"""One rank of a 2-rank FSDP2 run for the virtual-store test (a child process, gloo, CPU).

``python fsdp_virtual_worker.py RUN STEPS RESUME`` with RANK/WORLD_SIZE/MASTER_* set: a small model
whose first layer splits evenly over the ranks (12 rows: 6/6) and whose head does not (5
rows: 3/2), trained up to step ``STEPS`` under a dstt session that commits every step
(resuming the run when ``RESUME`` is 1). Without RANK set: one plain process, no process
group, no sharding (a resume of the 2-rank run on 1 process).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

faulthandler.dump_traceback_later(240, exit=True)
torch.set_num_threads(1)


def train(run: Path, steps: int, resume: bool, sharded: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dstt

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(net[0], mesh=mesh)
        fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank() if sharded else 0)
    with dstt.session(net, opt, run=run, every=1, resume=resume, rank_timeout=120) as s:
        for _ in range(s.step, steps):
            loss = net(torch.randn(4, 8, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.log(loss=float(loss.detach()))


def main() -> None:
    run, steps, resume = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    if "RANK" not in os.environ:  # one plain process resumes the run (reshard 2 -> 1)
        train(run, steps, resume, sharded=False)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(run, steps, resume, sharded=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
