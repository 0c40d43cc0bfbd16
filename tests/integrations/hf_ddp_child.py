"""One rank of the Trainer's time-travel loop under DDP (2 gloo ranks, torchrun's environment).

    python hf_ddp_child.py MODE RUN OUT STEPS [CORRUPT]     (MODE: fresh | resume)

``CORRUPT``: comma-separated dataset indices replaced by random tokens. Writes
``OUT/<MODE>.r<rank>.json``: the losses per global step and the step the Trainer started at.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
faulthandler.dump_traceback_later(int(os.environ.get("DSTT_TEST_HANG_S", "300")), exit=True)
torch.set_num_threads(1)

PER_STEP = 16  # samples per optimizer step: 2 ranks x 2 micro-batches x 4; one epoch in all


def main(mode: str, run: str, out: str, steps: int, corrupt: tuple[int, ...]) -> dict[str, Any]:
    from hf_setup import PatternData, Recorder, default_args, tiny_gpt2
    from transformers import Trainer

    from dstt.integrations.transformers import DsttCallback

    rec = Recorder()
    cb = DsttCallback(run=run, resume=mode == "resume")
    tr = Trainer(
        model=tiny_gpt2(),
        args=default_args(out, max_steps=steps, ddp_backend="gloo"),
        train_dataset=PatternData(steps * PER_STEP, corrupt=corrupt),
        callbacks=[rec, cb],
    )
    try:
        tr.train(resume_from_checkpoint=cb.resume_from() if mode == "resume" else None)
    finally:
        cb.close()
    return {"losses": rec.losses, "start": rec.start, "world": tr.args.world_size}


if __name__ == "__main__":
    mode, run, out, steps = sys.argv[1:5]
    corrupt = tuple(int(i) for i in sys.argv[5].split(",") if i) if len(sys.argv) > 5 else ()
    rank = int(os.environ["RANK"])
    try:
        res = {"ok": True, **main(mode, run, str(Path(out) / "trainer"), int(steps), corrupt)}
    except BaseException as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    Path(out, f"{mode}.r{rank}.json").write_text(json.dumps(res))
