"""One rank of ``test_sink_contract.py``'s two-rank sink: a real gloo rank serving the test.

Launched by the test (``tests/ranks/conftest.launch``: RANK, WORLD_SIZE, MASTER_*). It joins
a gloo process group, then serves pickled commands from stdin, one reply each on stdout:
``open`` a run (``open_ranks``: the ranks agree through the group) with a ``TransactionSink``
over this rank's ``RankWriter`` and a flusher of its own, then ``begin``/``write``/
``put_object``/``commit``/``abort`` on it, ``kill`` its flusher, ``close``, ``exit``. Rank
``r > 0`` writes the same bytes under ``rank<r>/``-prefixed names, so rank 0's commit merges
both ranks' arrays and objects.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from dstt.engine.distributed.ranks import RankInfo, open_ranks
from dstt.store._internal import FlatSegment, StepHandle, TransactionSink
from dstt.store.flusher.parent import Flusher

_LEN = struct.Struct("<Q")


def _read(inp: Any) -> Any:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return ("exit",)
    (n,) = _LEN.unpack(head)
    return pickle.loads(inp.read(n))


def _write(out: Any, obj: object) -> None:
    data = pickle.dumps(obj)
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    prefix = f"rank{rank}/" if rank else ""
    sink: TransactionSink | None = None
    flusher: Flusher | None = None
    handles: dict[int, StepHandle] = {}
    layouts: dict[tuple[Any, ...], Any] = {}
    ring = 0
    while True:
        cmd = _read(inp)
        op = cmd[0]
        try:
            value: Any = None
            if op == "exit":
                break
            if op == "open":
                rw, _ = open_ranks(
                    Path(cmd[1]), RankInfo(rank, world), resume=False, chunk_bytes=256
                )
                flusher = Flusher(1 << 16, 2)
                rw.writer.committer = flusher
                sink = TransactionSink(rw, flusher)
                handles.clear()
                layouts.clear()
            elif op == "close":
                if sink is not None:
                    sink.writer.close()  # type: ignore[attr-defined]
                if flusher is not None:
                    flusher.close()
                sink = flusher = None
            elif op == "layout":
                assert sink is not None
                arrays = cmd[1]
                layouts[arrays] = sink.layout([(prefix + p, d, s) for p, d, s in arrays])
                value = layouts[arrays] if rank == 0 else None
            elif op == "begin":
                assert sink is not None
                handles[cmd[1]] = sink.begin(cmd[2], encode=cmd[3], keyframe=cmd[4])
            elif op == "write":
                assert sink is not None
                _, hid, arrays, start, data, shared = cmd
                layout = layouts[arrays]
                if data is None:  # the segment failed to read on the test's side: here too
                    broken = memoryview(bytearray(8))
                    broken.release()
                    handles[hid].write(FlatSegment(layout, start, broken))
                elif shared and flusher is not None and not flusher.dead:
                    ring = (ring + 1) % flusher.count
                    view = np.frombuffer(flusher.buffers[ring], dtype=np.uint8, count=len(data))
                    view[:] = np.frombuffer(data, dtype=np.uint8)
                    handles[hid].write(FlatSegment(layout, start, view, shared=ring))
                else:
                    handles[hid].write(FlatSegment(layout, start, data))
            elif op == "put_object":
                handles[cmd[1]].put_object(prefix + cmd[2], cmd[3])
            elif op == "commit":
                header = handles[cmd[1]].commit(cmd[2])
                value = None if header is None else header.step
            elif op == "abort":
                handles[cmd[1]].abort()
            elif op == "kill":
                assert flusher is not None
                assert flusher.proc is not None
                flusher.proc.kill()
                flusher.proc.wait(60)
            _write(out, ("ok", value))
        except Exception as e:
            traceback.print_exc()
            try:
                err = pickle.dumps(e)
            except Exception:
                err = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
            _write(out, ("err", err))
    if sink is not None:
        sink.writer.close()  # type: ignore[attr-defined]
    if flusher is not None:
        flusher.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
