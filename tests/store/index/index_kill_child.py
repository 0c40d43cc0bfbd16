"""Child of ``test_index``: commits one step with an index flush and SIGKILLs itself just before
its k-th write (or delete) to storage. ``python index_kill_child.py RUN K`` (K 0: no kill;
prints how many writes the commit made)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import numpy as np


def main() -> None:
    from dstt.store import LocalStorage, Repository
    from dstt.store.storage.memory import DelegatingStorage

    path, k = sys.argv[1], int(sys.argv[2])

    class KillAt(DelegatingStorage):
        n = 0

        def _op(self) -> None:
            self.n += 1
            if self.n == k:
                os.kill(os.getpid(), signal.SIGKILL)

        def write(self, key: str, data: Any) -> None:
            self._op()
            super().write(key, data)

        def write_durable(self, key: str, data: Any) -> None:
            self._op()
            super().write_durable(key, data)

        def delete(self, key: str) -> None:
            self._op()
            super().delete(key)

    st = KillAt(LocalStorage(path, durability="none"))
    with Repository(st).writer(index_every=4) as w:
        head = w.reader.head()
        step = 0 if head is None else head.step + 1
        txn = w.begin(step)
        a = np.full((4, 4), step, np.float32)
        txn.declare("params/w", "float32", a.shape)
        txn.put_chunk("params/w", 0, a.reshape(-1).view(np.uint8))
        txn.commit({"loss": float(step)})
    print(st.n, flush=True)


if __name__ == "__main__":
    main()
