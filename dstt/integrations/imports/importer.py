"""``import_checkpoints``: checkpoints already on disk become committed steps of a dstt run.

Each source (``sources.find_sources``) is read into a :class:`Checkpoint` and written as one
commit (``write.write_checkpoint``), in step order, under the run's lock. Incremental and
safe: a step already imported from that same source is skipped (re-running imports only new
checkpoints); a source at or below the head step from elsewhere is reported and skipped; an
unreadable source is reported with its reason, its transaction aborted, and the import goes
on; ``encoding=DeltaPolicy()`` stores chunks as dedup references or XOR deltas from the
previously imported step when smaller.

Rejected alternative: stopping at the first bad source — one truncated checkpoint (a job
killed while saving) would keep every later good one out of the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dstt.engine.capture.summaries import SummaryBook
from dstt.schema import IMPORT_OBJECT
from dstt.store._internal import DeltaPolicy, Repository

from .checkpoint import Checkpoint
from .sources import Source, Unknown, find_sources, reader_of
from .write import write_checkpoint

if TYPE_CHECKING:
    import torch

    from dstt.store._internal import CommitHeader, Reader

__all__ = ["ImportReport", "Imported", "Skipped", "import_checkpoints"]


@dataclass(frozen=True)
class Imported:
    """A source committed as a step."""

    step: int
    source: str
    format: str
    slot: int
    lacks: tuple[str, ...]
    bytes_read: int


@dataclass(frozen=True)
class Skipped:
    """A source not imported, and why; ``problem`` is False for one already imported."""

    source: str
    step: int | None
    reason: str
    problem: bool = True


@dataclass
class ImportReport:
    """What ``import_checkpoints`` did."""

    run: str
    imported: list[Imported] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    #: files found in a folder that are no step's checkpoint (not an error)
    ignored: list[Unknown] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No source was refused or unreadable."""
        return not any(s.problem for s in self.skipped)

    @property
    def bytes_read(self) -> int:
        return sum(i.bytes_read for i in self.imported)


Progress = Callable[[int, int, str], None]


def _imported_from(reader: Reader, header: CommitHeader | None) -> str | None:
    if header is None or header.pruned or IMPORT_OBJECT not in header.objects:
        return None
    obj = reader.read_object(header, IMPORT_OBJECT)
    return obj.get("path") if isinstance(obj, dict) else None


def import_checkpoints(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    run: str | os.PathLike[str] | Repository,
    *,
    step: int | None = None,
    model: torch.nn.Module | None = None,
    trusted: bool = False,
    encoding: DeltaPolicy | None = None,
    summaries: bool = True,
    progress: Progress | None = None,
) -> ImportReport:
    """Import checkpoints into ``run`` (created if new), each as one step; see the module
    docstring. ``sources``: checkpoint files or folders, or folders holding them. ``step``:
    the step of a single source that does not say it. ``model``: the trained model (or one
    built as in training), to name parameters exactly when the source cannot (an optimizer
    state keyed by index). ``trusted``: unpickle files that need it (only for sources you
    trust). ``encoding``: e.g. ``dstt.DeltaPolicy()``. ``summaries``: write-time statistics
    of every parameter (``run.summaries()`` and ``run.spikes()`` read them).
    ``progress(done, total, source)`` is called after each source."""
    started = time.monotonic()
    paths = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    found, unknown, ignored = find_sources([os.fspath(p) for p in paths], step=step)
    repo = run if isinstance(run, Repository) else Repository.create(run)
    report = ImportReport(str(repo.storage.location), ignored=ignored)
    report.skipped.extend(Skipped(u.path, None, u.reason) for u in unknown)
    book = SummaryBook() if summaries else None
    with repo.writer(encoding=encoding) as w:
        reader = repo.reader()
        lineage = reader.lineage()
        by_step = {h.step: h for h in lineage}
        last = lineage[-1].step if lineage else None
        for i, src in enumerate(found):
            ck = _one(src, reader, by_step, last, report, step, model, trusted)
            if ck is not None:
                history = [(s, v) for s, v in ck.history if last is None or s > last]
                try:
                    if i + 1 < len(found):  # the disk reads the next one while this is written
                        prefetch(found[i + 1].path)
                    header = write_checkpoint(w, ck, history=history, book=book)
                except Exception as e:  # aborted: reported, the import goes on
                    report.skipped.append(Skipped(src.path, ck.step, _why(e)))
                else:
                    report.imported.append(
                        Imported(
                            ck.step,
                            ck.source,
                            ck.format,
                            header.slot,
                            tuple(ck.lacks),
                            sum(ck.files.values()),
                        )
                    )
                    last = ck.step
            if progress is not None:
                progress(i + 1, len(found), src.path)
    report.seconds = time.monotonic() - started
    return report


def prefetch(path: str) -> None:
    """Ask the kernel to read ``path`` (a file, or the files of a folder) ahead, without
    waiting (``posix_fadvise(WILLNEED)``; nothing where it does not exist)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    files = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _why(e: BaseException) -> str:
    from dstt.errors import DsttError

    return str(e) if isinstance(e, DsttError) and str(e) else f"{type(e).__name__}: {e}"


def _stale(
    src: Source, k: int, reader: Reader, by_step: dict[int, CommitHeader], last: int | None
) -> Skipped | None:
    """Why a source at step ``k`` cannot be imported after ``last``, or None."""
    if last is None or k > last:
        return None
    if _imported_from(reader, by_step.get(k)) == src.path:
        return Skipped(src.path, k, "already imported", problem=False)
    return Skipped(
        src.path,
        k,
        f"step {k} is not after the run's head (step {last}): steps "
        "only grow along a timeline; import it into a new run, or roll back "
        "first (dstt rollback --to K)",
    )


def _one(
    src: Source,
    reader: Reader,
    by_step: dict[int, CommitHeader],
    last: int | None,
    report: ImportReport,
    step: int | None,
    model: torch.nn.Module | None,
    trusted: bool,
) -> Checkpoint | None:
    """The checkpoint of one source, or None (the reason filed in ``report``)."""
    if src.step is not None and (stale := _stale(src, src.step, reader, by_step, last)):
        report.skipped.append(stale)
        return None
    try:
        ck = reader_of(src.format)(
            src.path, step=src.step if step is not None else None, model=model, trusted=trusted
        )
    except Exception as e:  # a bad source is reported and skipped
        report.skipped.append(Skipped(src.path, src.step, _why(e)))
        return None
    assert isinstance(ck, Checkpoint)
    if (stale := _stale(src, ck.step, reader, by_step, last)) is not None:
        report.skipped.append(stale)
        return None
    return ck
