"""Child process for the crash test: trains TinyGPT and prints one line per step.

    python train_child.py MODE RUN STEPS SEED

MODE ``plain`` trains without dstt (the reference), ``fresh`` checkpoints every step into a new
run, ``resume`` continues RUN with ``resume=True``. Lines: ``start <step>``, then
``step <k> <loss as float.hex>`` after each optimizer step, then ``final <sha256 of params>``.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from dstt.testing.models import SyntheticBatches, TinyGPT
from dstt.training import session


def main(mode: str, run: str, steps: int, seed: int) -> None:
    torch.set_num_threads(1)  # bit-exact CPU math needs a fixed reduction order
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 8))
    batches = SyntheticBatches(steps, seed=seed)

    def loop(s, data) -> None:
        print(f"start {s.step if s else 0}", flush=True)
        for x, y in data:
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            k = s.step if s else int(sched.last_epoch)
            if s:
                s.log(loss=loss.item())
            print(f"step {k} {loss.item().hex()}", flush=True)

    if mode == "plain":
        loop(None, batches)
    else:
        with session(model, opt, run=run, scheduler=sched, resume=(mode == "resume")) as s:
            loop(s, s.data(batches))
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    print(f"final {h.hexdigest()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
