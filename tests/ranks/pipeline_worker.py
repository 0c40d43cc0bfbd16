"""One rank of a 2-stage ``torch.distributed.pipelining`` run (``test_pipeline.py``).

``python pipeline_worker.py PHASE RUN OUT`` with RANK/WORLD_SIZE/MASTER_* set (gloo, 2 ranks).
Each rank keeps its stage of a 4-layer model (torchtitan's way: the full model with the
other stages' layers deleted, so parameters keep their full-model names), its own AdamW and
LR scheduler; ``ScheduleGPipe`` with 2 micro-batches.

``ref``      8 steps without dstt: losses (last stage) and every parameter/state tensor
``first``    a session over steps 1-6
``resume``   ``resume=True`` from step 6 to 8: losses and tensors (against ``ref``)
``relayout`` ``resume=True`` with other stages (rank 0 holds layer 0 only): must be refused

Each rank writes ``OUT/<phase>.r<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import dstt

STEPS, FIRST = 8, 6
STAGES = {"default": {0: ("0", "1"), 1: ("2", "3")}, "other": {0: ("0",), 1: ("1", "2", "3")}}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(8, 8) for i in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def build(rank: int, world: int, layout: str) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = Net()
    for k in list(model.layers):
        if k not in STAGES[layout][rank]:
            del model.layers[k]
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, t: (o - t).square().mean())
    return model, opt, sched, schedule


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS)]


def step(rank: int, schedule: Any, opt: Any, sched: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    loss = float("nan")
    if rank == 0:
        schedule.step(x)
    else:
        out: list[torch.Tensor] = []
        schedule.step(target=y, losses=out)
        loss = float(sum(float(v) for v in out))
    opt.step()
    sched.step()
    return loss


def tensors(model: torch.nn.Module, opt: Any) -> dict[str, list[float]]:
    out = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim/{k}/{names[id(p)]}"] = torch.as_tensor(v).flatten().tolist()
    return out


def main() -> None:
    phase, run, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    res: dict[str, Any] = {"ok": True}
    try:
        data = batches()
        layout = "other" if phase == "relayout" else "default"
        model, opt, sched, schedule = build(rank, world, layout)
        if phase == "ref":
            res["losses"] = [step(rank, schedule, opt, sched, *data[i]) for i in range(STEPS)]
            res["tensors"] = tensors(model, opt)
        elif phase == "first":
            with dstt.session(model, opt, run=run, scheduler=sched, rank_timeout=60):
                for i in range(FIRST):
                    step(rank, schedule, opt, sched, *data[i])
        else:
            try:
                with dstt.session(
                    model, opt, run=run, scheduler=sched, resume=True, rank_timeout=60
                ) as s:
                    res["resumed_at"] = s.step
                    res["losses"] = [
                        step(rank, schedule, opt, sched, *data[i]) for i in range(s.step, STEPS)
                    ]
                res["tensors"] = tensors(model, opt)
            except dstt.DsttError as e:
                res["error"] = f"{type(e).__name__}: {e}"
    except BaseException:
        res = {"ok": False, "trace": traceback.format_exc()}
    (out / f"{phase}.r{rank}.json").write_text(json.dumps(res))
    dist.barrier()  # rank 0 hosts the store: it must not exit while rank 1 still reads it
    os._exit(0)


if __name__ == "__main__":
    main()
