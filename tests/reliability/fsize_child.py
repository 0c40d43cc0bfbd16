"""Child of ``test_disk_full``: trains TinyGPT under a real RLIMIT_FSIZE file-size limit.

    python fsize_child.py RUN POLICY LIMIT

From step 4 on (once steps 1 and 2 are committed), the soft ``RLIMIT_FSIZE`` is ``LIMIT``
bytes (``SIGXFSZ`` ignored, so a write past it fails with ``EFBIG`` instead of killing the
process): step files and side files no longer fit. ``POLICY`` is the session's ``error_policy``:

* ``raise``: trains until the session raises; prints ``raised <type> <cause type> <errno>
  <step>``;
* ``skip``: trains on; once a "not checkpointed" warning has been seen and three more steps
  ran, the limit is lifted (space returns); trains three more steps (at least to step 16).

Always prints ``params <step> <sha256>`` after every optimizer step and ``warned <n>``,
``done <step>`` at the end.
"""

from __future__ import annotations

import hashlib
import resource
import signal
import sys
import time
import warnings

import torch

import dstt
from dstt.testing.models import SyntheticBatches, TinyGPT


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters(remove_duplicate=False)):  # as names() lists
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main(run: str, policy: str, limit: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)  # as in _helpers
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    warned, lifted_at = 0, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with dstt.session(model, opt, run=run, budget_bytes=1 << 14, error_policy=policy) as s:  # type: ignore[arg-type]
                for x, y in s.data(SyntheticBatches(64)):
                    if s.step == 3:
                        while not {1, 2} <= {m.step for m in s.metrics}:
                            time.sleep(0.001)  # commits are asynchronous: let two land first
                        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
                    warned = sum("not checkpointed" in str(w.message) for w in caught)
                    if policy == "skip" and warned and lifted_at is None:
                        lifted_at = s.step + 3
                    if lifted_at is not None and s.step == lifted_at:
                        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
                    if lifted_at is not None and s.step >= max(16, lifted_at + 3):
                        break
                    _, loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    s.log(loss=loss.item())
                    print(f"params {s.step} {digest(model)}", flush=True)
        except dstt.DsttError as e:
            cause = e.__cause__
            print(
                f"raised {type(e).__name__} {type(cause).__name__} "
                f"{getattr(cause, 'errno', None)} {s.step}",
                flush=True,
            )
        warned = sum("not checkpointed" in str(w.message) for w in caught)
    print(f"warned {warned}", flush=True)
    print(f"lifted {lifted_at}", flush=True)
    print(f"done {s.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
