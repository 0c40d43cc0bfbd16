"""The flusher process: a flat step's checksums, zip entries, digests and writes, off the GIL.

A child process (``python -m dstt.store.flusher._main``, no torch) shares the engine's step
buffers through ``memfd`` and gets one small message per step, because writer threads in the
trainer cost a GIL hand-off per C call, which at a thousand tensors slows training. It runs
at ``SCHED_IDLE`` (normal priority while the ring is short). The parent keeps every decision
(slots, parents, refs) and the index; a dead child's step is redone here (idempotent). It
starts ``DSTT_FLUSHER_START_S`` after the first step and dies with the thread that started it
(``PR_SET_PDEATHSIG``). The child's side is ``flusher/child.py``. Rejected alternatives:
``multiprocessing`` (re-imports an unguarded ``__main__``) and a C extension (a compiler on
every machine). The whole story: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import contextlib
import errno as _errno
import mmap
import os
import pickle
import struct
import subprocess
import sys
import threading
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any, NoReturn

from dstt.errors import StorageError
from dstt.store.commit.job import CommitJob, NotHandedOff

if TYPE_CHECKING:
    from collections.abc import Callable

    from dstt.analysis.summary_kernel import DigestPlan
    from dstt.store.format.flat import FlatImage, FlatLayout
    from dstt.store.format.records import CommitHeader
    from dstt.store.format.stepfile import StepState

__all__ = ["Flusher", "flusher_supported"]

_LEN = struct.Struct("<Q")
#: layouts, digest plans and commit constants the child keeps (sent once each)
_SENT_KEPT = 64


def flusher_supported() -> bool:
    """Whether this platform has what the flusher needs (Linux ``memfd_create``)."""
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux")


def _send(out: IO[bytes], obj: tuple[Any, ...]) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_LEN.pack(len(data)))
    out.write(data)
    out.flush()


def _recv(inp: IO[bytes]) -> tuple[Any, ...]:
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("flusher pipe closed")
    (n,) = _LEN.unpack(head)
    data = inp.read(n)
    if len(data) < n:
        raise EOFError("flusher pipe closed mid-message")
    msg: tuple[Any, ...] = pickle.loads(data)
    return msg


class Flusher:
    """The parent's handle: ``count`` shared buffers of ``nbytes`` and the child process."""

    def __init__(
        self,
        nbytes: int,
        count: int,
        *,
        sched: str | None = None,
        wait: bool = True,
        start_after: float = 0.0,
    ) -> None:
        """``wait``: return once the child is ready (else at once: until it is, the requests
        are served in this process, ``served_here``); ``StorageError`` if it cannot start.
        ``start_after``: start the child only after that many seconds (or ``wait_ready``),
        so a run shorter than that never pays for it; ``close`` before then starts none."""
        sched = sched or os.environ.get("DSTT_FLUSHER_SCHED", "idle")
        if not flusher_supported():
            raise OSError(_errno.ENOSYS, "the flusher needs Linux memfd_create")
        self.nbytes, self.count = nbytes, count
        self._sched = sched
        #: DSTT_FLUSHER_URGENT=0: stay at SCHED_IDLE even when the engine waits (to compare)
        self._urgent_ok = os.environ.get("DSTT_FLUSHER_URGENT", "1") != "0"
        self._fds: list[int] = []
        self.buffers: list[mmap.mmap] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._error: BaseException | None = None
        self._mu = threading.Lock()  # sending (a request and the objects it names)
        self._sent: dict[int, object] = {}  # id -> the layout/plan object sent under that id
        self._next = 0
        self._waiting: dict[int, list[Any]] = {}  # request id -> [event, reply]
        self._wait_mu = threading.Lock()
        self.dead = False
        #: the child's threads at SCHED_IDLE (``urgent`` moves them all; set at "ready")
        self.idle_threads: list[int] = []
        self._ready = threading.Event()
        self._gone_or_ready = threading.Event()
        #: digest plans whose newest copy is this process's (digested here before "ready")
        self._copies_here: dict[int, DigestPlan] = {}
        self._here_mu = threading.Lock()
        #: held from a step's ``sent`` to the end of its write here: writes go in request
        #: order, as the child's one writer thread does them
        self._here_io = threading.Lock()
        #: requests this process served itself (before the child was ready), and the
        #: images it filled (as the child keeps them: built once per layout and buffer)
        self.served_here = 0
        self._images: dict[tuple[int, int, int], FlatImage] = {}
        self._bound: dict[int, FlatImage] = {}  # buffer -> the in-place image it holds
        self._start_now = threading.Event()  # start the child (``start_after`` is up)
        self._closing = threading.Event()  # ``close`` began: start no child
        self._closed = threading.Event()  # ``close`` ended: the starter may end
        self._tried = threading.Event()  # the starter started the child (or failed to)
        self._spawn_mu = threading.Lock()
        try:
            for i in range(count):
                fd = os.memfd_create(f"dstt-step-{i}", 0)
                self._fds.append(fd)
                os.ftruncate(fd, nbytes)
                self.buffers.append(mmap.mmap(fd, nbytes))
            # the child is started by a thread that lives until ``close``: the kernel's
            # "parent" of PR_SET_PDEATHSIG (child.py) is the thread that started it
            self._starter = threading.Thread(
                target=self._start_child,
                args=(max(0.0, start_after) if not wait else 0.0,),
                name="dstt-flusher-start",
                daemon=True,
            )
            self._starter.start()
            if wait or start_after <= 0:  # started when this returns (not ready yet)
                self._tried.wait()
            if wait and not self.wait_ready():
                raise StorageError(
                    _errno.EIO, f"the flusher process did not start: {self._error or 'it exited'}"
                )
        except BaseException:
            self.close()
            raise

    @property
    def started(self) -> bool:
        """Whether the child process was started (it may not be ready yet)."""
        return self.proc is not None

    def _start_child(self, after: float) -> None:
        """Start the child after ``after`` seconds (sooner on ``wait_ready``), unless closed
        first; then stay alive until ``close``, as the child's kernel "parent"."""
        if after > 0:
            self._start_now.wait(after)
        with self._spawn_mu:
            try:
                if self._closing.is_set():
                    return
                self._spawn()
            except Exception as e:  # no fork, no interpreter: the requests stay here
                with self._wait_mu:
                    self.dead, self._error = True, e
                self._gone_or_ready.set()
                return
            finally:
                self._tried.set()
        self._closed.wait()

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        # one thread each: a BLAS/OpenMP pool in the child would spin on the cores
        # training needs (thread pools are made at import, before SCHED_IDLE applies)
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dstt.store.flusher._main", self._sched, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=self._fds,
            env=env,
            # a terminal's Ctrl-C goes to training, which drains and closes the flusher;
            # in the terminal's process group the flusher would die mid-write with a
            # traceback of its own
            process_group=0,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self._out, self._in = self.proc.stdin, self.proc.stdout
        self._child_fds = list(self._fds)  # the same numbers in the child
        for fd in self._fds:  # the child has its copies (Popen returns after its exec)
            os.close(fd)
        self._fds = []
        self._send_init()
        self._reader = threading.Thread(
            target=self._read_replies, name="dstt-flusher-replies", daemon=True
        )
        self._reader.start()

    def _send_init(self) -> None:
        """Hand the child its shared buffers; it answers "ready" once it can serve."""
        _send(self._out, ("init", [(fd, self.nbytes) for fd in self._child_fds]))

    @property
    def ready(self) -> bool:
        """Whether the child serves requests (it said "ready" and is alive); until then this
        process serves them itself."""
        return self._ready.is_set() and not self.dead

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the child is ready (True) or gone (False); None: no time limit. Starts
        it now if ``start_after`` had not come yet."""
        self._start_now.set()
        with self._wait_mu:
            if self.dead:
                return False
        self._gone_or_ready.wait(timeout)
        return self.ready

    def urgent(self, on: bool) -> None:
        """Run the child at normal priority while the engine waits for it (``on``), at
        ``SCHED_IDLE`` again once it has caught up. ``SCHED_IDLE`` uses only idle CPU, which
        a training loop on every core leaves too little of: the ring of step buffers fills
        and training blocks. Where the OS refuses (an unprivileged process whose
        ``RLIMIT_NICE`` forbids it), the child keeps its priority."""
        if self._sched != "idle" or self.proc is None or not self._urgent_ok:
            return
        policy = os.SCHED_OTHER if on else os.SCHED_IDLE
        for tid in self.idle_threads:  # per thread: Linux schedules threads
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setscheduler(tid, policy, os.sched_param(0))

    def _read_replies(self) -> None:
        """Hand each reply to the request that waits for it (requests overlap: the child
        checksums one step while the disk takes the previous one)."""
        error: BaseException | None = None
        try:
            while True:
                reply = _recv(self._in)
                if reply[0] == "ready":
                    self.idle_threads = list(reply[1])
                    self._ready.set()
                    self._gone_or_ready.set()
                    continue
                if reply[0] == "err" and reply[1] is None and not self._ready.is_set():
                    raise EOFError(f"the flusher could not start: {reply[3]}")
                with self._wait_mu:
                    slot = self._waiting.pop(reply[1], None)
                if slot is not None:
                    slot[1] = reply
                    slot[0].set()
        except (EOFError, OSError, ValueError, pickle.PickleError) as e:
            error = e
        with self._wait_mu:  # the child is gone: every waiter fails now, later ones at once
            self.dead = True
            self._error = error
            waiting, self._waiting = self._waiting, {}
        self._gone_or_ready.set()
        for slot in waiting.values():
            slot[0].set()

    def _ensure(self, kind: str, objs: list[Any]) -> list[int | None]:
        """The child's ids of ``objs`` (None stays None), sending those it lacks."""
        new = [o for o in objs if o is not None and self._sent.get(id(o)) is not o]
        if new and len(self._sent) + len(new) > _SENT_KEPT:
            # layouts keep changing: start afresh, there too (what came before is served)
            _send(self._out, ("forget",))
            self._sent.clear()
            new = [o for o in objs if o is not None]
        for o in new:
            if self._sent.get(id(o)) is not o:
                _send(self._out, (kind, id(o), o))
                self._sent[id(o)] = o
        return [None if o is None else id(o) for o in objs]

    def _call(
        self, request: Callable[[int], tuple[Any, ...]], sent: Callable[[], None] | None = None
    ) -> tuple[Any, ...]:
        """Send ``request(rid)`` (built under the send lock: the constants it names go
        first), call ``sent()`` once it is in the pipe (the child serves requests in pipe
        order), and wait for its reply; ``StorageError`` for an error reply or a dead child.
        Thread-safe; several requests may be in flight."""
        slot: list[Any] = [threading.Event(), None]
        with self._mu:
            try:
                with self._wait_mu:
                    if self.dead:
                        raise EOFError("the pipe is closed")
                    rid = self._next
                    self._next += 1
                    self._waiting[rid] = slot
                _send(self._out, request(rid))
            except (EOFError, OSError, pickle.PickleError) as e:
                self._gone(e)
        if sent is not None:
            sent()
        slot[0].wait()
        reply = slot[1]
        if reply is None:
            self._gone(self._error)
        if reply[0] == "err":
            raise StorageError(reply[2] or _errno.EIO, f"flusher: {reply[3]}")
        return tuple(reply)

    def write(
        self,
        buffer: int,
        layout: FlatLayout,
        start: int,
        path: str,
        plan: DigestPlan | None,
        token: int | None = None,
        sent: Callable[[], None] | None = None,
    ) -> tuple[list[int], bytes, dict[str, Any] | None]:
        """Fill the zip entries of ``layout`` from shared buffer ``buffer`` into the file at
        ``path`` at ``start`` (a range the parent reserved); returns each chunk's crc32c, the
        entries' central directory records and, with ``plan``, the digest columns (each
        write on its own buffer; ``token``: ``summary_kernel.digest``'s, for exact updates
        against the previous step the child digested with this plan; ``sent``: called once
        the request is in the pipe, so the caller can order digests)."""

        if not self._ready.is_set():
            return self._write_here(buffer, layout, start, path, plan, token, sent)
        if self._images:  # the child serves from now on
            with self._here_mu:
                self._images.clear()
                self._bound.clear()
        here = self._digest_handover(buffer, plan, token)

        def request(rid: int) -> tuple[Any, ...]:
            lid, pid = self._ensure("layout", [layout, plan])
            return ("flat", rid, buffer, lid, start, path, pid, token)

        reply = self._call(request, sent)
        return reply[2], reply[3], reply[4] if here is None else here

    def digest(
        self,
        buffer: int,
        plan: DigestPlan,
        token: int | None = None,
        sent: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """The digest columns of shared buffer ``buffer`` computed in the child (a step this
        process writes itself, encoded: its digest stays off this process's GIL, and its
        exact updates compare with the child's copy of the previous step)."""

        if not self._ready.is_set():
            stats = self._digest_here(buffer, plan, token)
            if sent is not None:
                sent()
            return stats
        here = self._digest_handover(buffer, plan, token)

        def request(rid: int) -> tuple[Any, ...]:
            (pid,) = self._ensure("layout", [plan])
            return ("digest", rid, buffer, pid, token)

        stats = self._call(request, sent)[2]
        return stats if here is None else here

    # -- before the child is ready: served here, the same bytes and replies -------------------
    def _write_here(
        self,
        buffer: int,
        layout: FlatLayout,
        start: int,
        path: str,
        plan: DigestPlan | None,
        token: int | None,
        sent: Callable[[], None] | None,
    ) -> tuple[list[int], bytes, dict[str, Any] | None]:
        """``write`` in this thread, as the child would: the entries filled in the shared
        buffer, the digest, the bytes written at ``start`` of ``path``."""
        from dstt.store.format.flat import FlatImage
        from dstt.store.storage.posix import pwrite_all, start_writeback

        with self._here_mu:
            self.served_here += 1
            key = (id(layout), buffer, start)
            image = self._images.get(key)
            if image is None or image.layout is not layout:
                if len(self._images) >= _SENT_KEPT:
                    self._images.clear()
                image = FlatImage(layout, start, memoryview(self.buffers[buffer]))
                self._images[key] = image
            elif image.inplace and self._bound.get(buffer) is not image:
                image.bind(memoryview(self.buffers[buffer]))  # another layout's headers
            if image.inplace:
                self._bound[buffer] = image
        crcs, _ = image.fill()
        stats = self._digest_here(buffer, plan, token) if plan is not None else None
        # taken before ``sent`` lets the next step's request go: a stalled older write
        # keeps the room a full disk has left for it (the oldest steps commit)
        with self._here_io:
            if sent is not None:
                sent()
            try:
                fd = os.open(path, os.O_WRONLY)
                try:
                    pwrite_all(fd, image.iov, start)
                    start_writeback(fd)  # the disk starts now; the commit's barrier waits
                finally:
                    os.close(fd)
            except OSError as e:
                raise StorageError(e.errno or _errno.EIO, f"flusher (here): {e}") from e
        return crcs, bytes(image.directory), stats

    def _digest_here(self, buffer: int, plan: DigestPlan, token: int | None) -> dict[str, Any]:
        """The digest of shared buffer ``buffer`` in this process; with ``token``, ``plan``
        keeps this step's copy here (``_digest_handover`` moves it to the child)."""
        from dstt.analysis.summary_kernel import digest

        stats = digest(plan, memoryview(self.buffers[buffer]), token)
        if token is not None:
            with self._here_mu:
                self._copies_here[id(plan)] = plan
        return stats

    def _digest_handover(
        self, buffer: int, plan: DigestPlan | None, token: int | None
    ) -> dict[str, Any] | None:
        """The first request the child serves with a ``plan`` whose previous step was
        digested here: digest it here too, against this process's copy (the child has none:
        its digest of this step only takes the copy the next step compares with), then let
        this process's copy go. Returns those stats (None: nothing to hand over)."""
        if plan is None or token is None:
            return None
        with self._here_mu:
            if self._copies_here.get(id(plan)) is not plan:
                return None
            del self._copies_here[id(plan)]
        from dstt.analysis.summary_kernel import digest

        stats = digest(plan, memoryview(self.buffers[buffer]), token)
        plan.drop_copy()
        return stats

    def commit(
        self,
        root: str,
        durability: str,
        zip_state: StepState,
        side_state: StepState,
        job: CommitJob,
    ) -> CommitHeader:
        """Run a step's commit (``commit/job.py``: ``run_commit``) in the child, on files this
        process started; returns its header. ``NotHandedOff`` (nothing sent) where the job
        cannot be pickled; ``StorageError`` where it failed there, or the child died (then
        ``dead``, and the job may be half done: run it here)."""
        if not self._ready.is_set():  # the child is not serving yet: commit it here
            raise NotHandedOff("the flusher process is still starting")
        consts = [job.template, job.block, job.consolidated]
        try:
            data = pickle.dumps(
                replace(job, template=None, block=None, consolidated=b""),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as e:  # an object of the step pickle refuses: commit it here
            raise NotHandedOff(str(e)) from e

        def request(rid: int) -> tuple[Any, ...]:
            return (
                "commit",
                rid,
                root,
                durability,
                zip_state,
                side_state,
                self._ensure("const", consts),
                data,
            )

        header: CommitHeader = self._call(request)[2]
        return header

    def _gone(self, cause: BaseException | None) -> NoReturn:
        with self._wait_mu:
            self.dead = True
        code = self.proc.poll() if self.proc is not None else None
        raise StorageError(
            _errno.EPIPE, f"the flusher process died (exit {code}): {cause}"
        ) from cause

    def close(self) -> None:
        """End the child: it has answered every request by now (the engine drained). One
        that never got ready was sent none: it is killed rather than waited for while it
        starts (the fixed cost of a short run); one not started yet is not started."""
        self._closing.set()
        self._start_now.set()  # (a starter still waiting ends now)
        with self._spawn_mu:
            proc, self.proc = self.proc, None
        self._gone_or_ready.set()
        if proc is not None:
            if not self._ready.is_set():
                with contextlib.suppress(OSError):
                    proc.kill()
            with contextlib.suppress(OSError, ValueError):
                _send(proc.stdin, ("exit",))  # type: ignore[arg-type]
            for stream in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a hung write
                proc.kill()
                proc.wait()
        with self._here_mu:  # (their views of the buffers)
            self._images.clear()
            self._bound.clear()
        for b in self.buffers:
            with contextlib.suppress(BufferError):  # views still exported: let gc unmap
                b.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        self._closed.set()
        starter = getattr(self, "_starter", None)
        if starter is not None and starter is not threading.current_thread():
            starter.join(timeout=5)
