"""A DeepSpeed ``CheckpointEngine`` that writes ``engine.save_checkpoint()`` into a dstt run.

Decoupled (DeepSpeed calls ``commit`` at the next ``engine.step()``), which is the DataStates
contract: ``save`` stages a file's tensors for the lazy copy and leaves a JSON stub at
``path``; ``commit`` waits only for the host copies; rank 0 commits the tag once every rank's
part is durable and only then writes ``<save_dir>/latest``; ``load`` rebuilds the state dict
from the run. Tensors a session would capture are stored under the model's names, the rest
under ``files/<file>/<keys>``. Rejected alternatives: a non-decoupled engine (DeepSpeed writes
``latest`` before the tag is durable) and ``torch.save`` files from a background thread (no
checksums, no atomic global commit, no lazy inspection). The whole protocol:
docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pickle
import re
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from dstt import schema
from dstt.engine.capture.pipeline import Pipeline
from dstt.engine.distributed.ranks import DEFAULT_RANK_TIMEOUT, RankWriter, dist_info, open_ranks
from dstt.engine.tensors._convert import tensor_from_numpy
from dstt.errors import CaptureError, RaceError, RankError
from dstt.store._internal import DEFAULT_CHUNK_BYTES, Repository, fsync_dir

from ._ds_tags import _Save, _TagWriter
from ._statedict import SessionPaths, flatten, rebuild, segment
from .deepspeed import session_tensors

__all__ = ["DsttCheckpointEngine"]

STUB_FORMAT = 1


def _durable_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


class DsttCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # deepspeed is untyped
    """``engine.save_checkpoint``/``load_checkpoint`` through dstt (see the module docstring).

    Use ``DsttCheckpointEngine.attach(engine, run=None)`` after ``deepspeed.initialize``
    (DeepSpeed has no engine registry; replacing ``engine.checkpoint_engine`` is the seam).
    The last tag commits at the latest when the interpreter exits (``atexit``; until then the
    engine is kept alive); ``close()`` or ``engine.destroy()`` commits it at once.
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        run: str | os.PathLike[str] | None = None,
        budget_bytes: int = 256 << 20,
        writers: int = 4,
        rank_timeout: float = DEFAULT_RANK_TIMEOUT,
    ) -> None:
        super().__init__(config_params)
        self.name = "DsttCheckpointEngine"
        self.run = None if run is None else Path(run)
        self.budget_bytes, self.writers, self.rank_timeout = budget_bytes, writers, rank_timeout
        self.engine: Any = None
        self._rw: RankWriter | None = None
        self._pipe: Pipeline | None = None
        self._saves: dict[int, _Save] = {}
        self._pending: _Save | None = None
        self._staged: _Save | None = None  # the newest tag, until a flush saw it committed
        self._last_step = -1
        self._lock = threading.Lock()
        self._exit_pid: int | None = None  # the process whose exit flushes (``atexit``)
        self._naming_failed = False

    @classmethod
    def attach(
        cls, engine: Any, run: str | os.PathLike[str] | None = None, **kw: Any
    ) -> DsttCheckpointEngine:
        """Make ``engine`` save and load through a new ``DsttCheckpointEngine``."""
        old = getattr(engine, "checkpoint_engine", None)
        if old is not None and old.is_decoupled():
            old.cleanup()
        ce = cls(run=run, **kw)
        ce.engine = engine
        engine.checkpoint_engine = ce
        original = engine.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            try:
                out = original(*args, **kwargs)
            except BaseException as e:
                ce._drop_pending(f"save_checkpoint raised {type(e).__name__}: {e}")
                raise
            if ce._pending is not None:
                ce._pending.complete = True
            return out

        engine.save_checkpoint = save_checkpoint
        return ce

    # -- CheckpointEngine -------------------------------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        if self._pending is not None:  # two saves without a step between them
            self.commit(self._pending.info)
        self._open(info.save_dir)
        assert self._rw is not None
        step = (
            int(self.engine.global_steps)
            if self.engine is not None
            else int(re.sub(r"\D", "", str(info.tag)) or 0)
        )
        step = max(step, self._last_step + 1)
        self._last_step = step
        save = _Save(info, step, self._rw.writer.reader.current_timeline, names=self._names())
        with self._lock:
            self._saves[step] = save
        self._pending = self._staged = save

    def save(self, state_dict: Any, path: str) -> None:
        save, pipe = self._pending, self._pipe
        if save is None or pipe is None:
            raise CaptureError("save() outside create()/commit(); use engine.save_checkpoint")
        fid = segment(Path(path).name.removesuffix(".pt"), set())
        tensors: dict[str, torch.Tensor] = {}
        names = save.names
        skeleton = flatten(
            state_dict,
            f"{schema.FILES_OBJECT}/{fid}",
            tensors,
            None if names is None else names.place,
        )
        if names is not None:  # a tensor in two files (or twice in one) is written once
            tensors = {p: t for p, t in tensors.items() if p not in names.staged}
            names.staged.update(tensors)
        f = pipe.stage(save.step, tensors, {f"{schema.FILES_OBJECT}/{fid}": pickle.dumps(skeleton)})
        save.flights.append(f)
        assert self.run is not None
        stub = {
            "dstt_checkpoint": STUB_FORMAT,
            "run": os.path.relpath(self.run, Path(path).parent),
            "step": save.step,
            "timeline": save.timeline,
            "tag": str(save.info.tag),
            "file": fid,
        }
        tmp = f"{path}.tmp.{os.getpid()}"
        Path(tmp).write_text(json.dumps(stub))
        os.rename(tmp, path)  # made durable by the committer before the tag commits
        save.stubs.append(path)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        save, pipe = self._pending, self._pipe
        self._pending = None
        if save is None or pipe is None:
            return True
        err: RaceError | None = None
        for f in save.flights:  # the only wait on the training thread: host copies
            pipe.wait_copied(f)
            races = pipe.check(f) if not f.dead else []
            if races and err is None:
                err = RaceError(
                    f"checkpoint {save.info.tag}: tensors were modified in place "
                    "while being copied: " + ", ".join(r.path for r in races[:5])
                )
        save.total = len(save.flights) + 1
        shards = save.names.shard_map() if save.names is not None else None
        assert self._rw is not None
        objects = (
            {} if shards is None else {f"{schema.SHARDS_OBJECT}/r{self._rw.info.rank}": shards}
        )
        final = pipe.stage(save.step, {}, objects)  # commits the tag's transaction
        final.add_metrics({"tag": str(save.info.tag)})
        save.flights.append(final)
        for f in save.flights:
            if err is None:
                pipe.seal(f, {})
            else:
                pipe.abort(f, err)
        if err is not None:
            raise err
        self._surface()
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        try:
            stub = json.loads(Path(path).read_text())
            if stub.get("dstt_checkpoint") != STUB_FORMAT:
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            return torch.load(path, map_location=map_location, weights_only=False)
        self.flush()
        repo = Repository.open(Path(path).parent / stub["run"])
        reader = repo.reader()
        header = reader.find(int(stub["step"]), stub["timeline"])
        skeleton = pickle.loads(reader.read_object(header, f"{schema.FILES_OBJECT}/{stub['file']}"))
        table = reader.arrays(header)

        def read(apath: str) -> torch.Tensor:
            t = tensor_from_numpy(reader.read_array(header, apath), table[apath].dtype)
            # a device moves the tensor; torch.load's callables/dicts keep it on the CPU
            return t.to(map_location) if isinstance(map_location, str | torch.device) else t

        return rebuild(skeleton, read)

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        if self._pending is None:
            return None
        return dataclasses.replace(self._pending.info, save_latest=False)  # we write latest

    def is_decoupled(self) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False

    def cleanup(self) -> None:
        self.close()

    # -- ours -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Commit the pending tag and wait until every tag is durable and visible (and
        ``latest`` moved) — on every rank, so a ``load`` right after sees the tag."""
        last = self._pending
        if last is not None:
            self.commit(last.info)
        if self._pipe is not None:
            self._pipe.drain()
        self._surface()
        rw = self._rw
        if rw is not None and rw.info.rank != 0 and self._staged is not None:
            self._wait_visible(rw, self._staged)
        self._staged = None

    def _wait_visible(self, rw: RankWriter, save: _Save) -> None:
        """Ranks other than 0: poll the store until rank 0 has committed ``save``."""
        deadline = time.monotonic() + self.rank_timeout
        latest = os.path.join(save.info.save_dir, "latest")
        while True:
            head = rw.repo.reader().head(save.timeline)
            at = -1 if head is None else int(head.step)
            done = at >= save.step
            if done and save.info.save_latest and at == save.step:
                try:  # rank 0 writes latest right after the commit
                    done = Path(latest).read_text() == str(save.info.tag)
                except OSError:
                    done = False
            if done:
                return
            if time.monotonic() > deadline:
                raise RankError(
                    f"rank 0 did not commit checkpoint {save.info.tag!r} within "
                    f"{self.rank_timeout:.0f} s"
                )
            time.sleep(0.005)

    def close(self) -> None:
        """Flush, then stop the threads and release the run (idempotent). Runs by itself at
        a normal interpreter exit; call it (or ``engine.destroy()``) to commit earlier."""
        if self._exit_pid is not None:
            atexit.unregister(self._at_exit)
            self._exit_pid = None
        try:
            self.flush()
        finally:
            pipe, rw = self._pipe, self._rw
            self._pipe = self._rw = None
            if pipe is not None:
                pipe.close()
            if rw is not None:
                rw.close()

    def _at_exit(self) -> None:
        """Interpreter exit: commit the last complete tag and wait until it is durable; a tag
        cut short (or of an engine not attached with ``attach``) is dropped, loudly."""
        if self._exit_pid != os.getpid():  # a forked child inherited the handler
            return
        save = self._pending
        if save is not None and not save.complete:
            self._drop_pending(
                "the process exited before save_checkpoint returned"
                if self.engine is not None
                else "the engine was not attached with "
                "DsttCheckpointEngine.attach and close() was not called"
            )
        try:
            self.close()
        except BaseException as e:
            sys.stderr.write(
                f"dstt: the last checkpoint may not be committed: {type(e).__name__}: {e}\n"
            )
            raise

    def _drop_pending(self, why: str) -> None:
        """Never commit the pending tag (its files are incomplete)."""
        save, pipe = self._pending, self._pipe
        self._pending = None
        if save is None or pipe is None:
            return
        sys.stderr.write(f"dstt: checkpoint {save.info.tag!r} was not committed: {why}\n")
        err = CaptureError(f"checkpoint {save.info.tag!r} was dropped: {why}")
        for f in save.flights:
            pipe.abort(f, err, reported=True)
        with self._lock:
            self._saves.pop(save.step, None)
        if self._staged is save:
            self._staged = None

    def _names(self) -> SessionPaths | None:
        """The session names of this tag's tensors (None without an attached engine)."""
        if self.engine is None or self._naming_failed:
            return None
        assert self._rw is not None
        try:
            return SessionPaths(*session_tensors(self.engine, self._rw.info))
        except Exception as e:  # naming is for inspection; the checkpoint must still save
            self._naming_failed = True
            warnings.warn(
                f"dstt: checkpoint arrays keep DeepSpeed's file paths (the engine's "
                f"state could not be named: {type(e).__name__}: {e})",
                RuntimeWarning,
                stacklevel=3,
            )
            return None

    def _open(self, save_dir: str) -> None:
        if self._rw is not None:
            return
        if self.run is None:
            self.run = Path(save_dir) / "dstt"
        chunk = min(DEFAULT_CHUNK_BYTES, max(4096, self.budget_bytes // 4))
        rw, head = open_ranks(
            self.run, dist_info(), resume=True, chunk_bytes=chunk, timeout=self.rank_timeout
        )
        self._last_step = int(head.step) if head is not None else -1
        rw.before_commit.append(self._make_stubs_durable)
        rw.after_commit.append(self._write_latest)
        self._rw = rw
        self._exit_pid = os.getpid()
        atexit.register(self._at_exit)
        self._pipe = Pipeline(
            _TagWriter(rw, self._saves),
            budget_bytes=self.budget_bytes,
            writers=self.writers,
            summaries=False,
            min_slab_bytes=chunk,
        )

    def _make_stubs_durable(self, txn: Any) -> None:
        """Committer thread, before this rank's part (or rank 0's commit): stubs durable."""
        with self._lock:
            save = self._saves.get(txn.step)
            if save is not None and txn.rank != 0:  # rank 0 still needs it for ``latest``
                del self._saves[txn.step]
        stubs = save.stubs if save is not None else []
        for p in stubs:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for d in {os.path.dirname(p) for p in stubs}:
            fsync_dir(d)

    def _write_latest(self, header: Any) -> None:
        with self._lock:
            save = self._saves.pop(header.step, None)
        if save is not None and save.info.save_latest:
            _durable_write(os.path.join(save.info.save_dir, "latest"), str(save.info.tag).encode())

    def _surface(self) -> None:
        pipe = self._pipe
        failed = pipe.take_errors() if pipe is not None else []
        if failed:
            f = failed[0]
            raise CaptureError(
                f"checkpoint step {f.step} was not saved: {type(f.error).__name__}: {f.error}"
            ) from f.error
