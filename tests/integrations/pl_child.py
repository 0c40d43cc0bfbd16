"""Child process for the Lightning crash test: prints ``start k``, ``step k <loss hex>`` per
step and ``final <hash of params and optimizer state>``.

    python pl_child.py MODE RUN STEPS      (MODE: fresh | resume)
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pl_setup import Recorder, ResumableLoader, loader, make_trainer, model, state_hash

from dstt.integrations.lightning import DsttCallback


def main(mode: str, run: str, steps: int) -> None:
    torch.set_num_threads(1)
    m = model()
    rec = Recorder(echo=True, pace_s=0.15 if mode == "fresh" else 0.0)
    tr = make_trainer([rec, DsttCallback(run=run, resume=(mode == "resume"))], steps=steps)
    tr.fit(m, ResumableLoader(loader()))
    print(f"final {state_hash(m, tr.optimizers[0])}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
