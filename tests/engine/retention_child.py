"""Child process for the retention crash test: trains the tiny MLP with background retention.

    python retention_child.py RUN STEPS POLICY_JSON [resume]

Prints ``step <k>`` after each optimizer step (the parent SIGKILLs it somewhere, wherever the
retention thread happens to be); with ``resume`` it continues RUN and prints ``start <k>``.
"""

from __future__ import annotations

import json
import sys

import torch
from _helpers import MLP, mlp_batch  # this folder is sys.path[0] for a script

import dstt


def main(run: str, steps: int, policy: dstt.Retention, resume: bool) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = mlp_batch(0)
    with dstt.session(
        model, opt, run=run, resume=resume, retention=policy, summaries=False, copy="sync"
    ) as s:
        print(f"start {s.step}", flush=True)
        for _ in range(steps):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.log(step=s.step, loss=40.0 if s.step % 37 == 0 else float(loss.detach()))
            print(f"step {s.step}", flush=True)


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]),
        dstt.Retention(**json.loads(sys.argv[3])),
        len(sys.argv) > 4 and sys.argv[4] == "resume",
    )
