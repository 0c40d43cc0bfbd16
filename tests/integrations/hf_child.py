"""Child process for the Trainer crash test: prints ``start k``, ``step k <loss hex>`` per
step and ``final <hash of params and optimizer state>``.

    python hf_child.py MODE RUN OUT STEPS      (MODE: plain | fresh | resume)
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_setup import Recorder, state_hash, tiny_gpt2, trainer

from dstt.integrations.transformers import DsttCallback


def main(mode: str, run: str, out: str, steps: int) -> None:
    torch.set_num_threads(1)  # bit-exact CPU math needs a fixed reduction order
    model = tiny_gpt2()
    cbs: list = [Recorder(echo=True, pace_s=0.15 if mode == "fresh" else 0.0)]
    cb = None
    if mode != "plain":
        cb = DsttCallback(run=run, resume=(mode == "resume"))
        cbs.append(cb)
    tr = trainer(model, out, cbs, max_steps=steps)
    tr.train(resume_from_checkpoint=cb.resume_from() if mode == "resume" else None)
    print(f"final {state_hash(model, tr.optimizer.optimizer)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
