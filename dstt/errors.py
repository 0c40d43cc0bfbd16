"""The one error tree of dstt.

Every error dstt raises on purpose is a ``DsttError``; each subclass also subclasses the
builtin a caller would naturally catch (``FileNotFoundError``, ``ValueError``, ``OSError`` ...),
so ``except FileNotFoundError`` keeps working for code that does not know dstt. Messages say
what is wrong, which file or step, and what to do.

Rejected alternative: one flat ``DsttError`` with codes — callers could not catch by meaning.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "ChecksumError",
    "ConfigError",
    "CorruptRunError",
    "CurrentTimelineError",
    "DsttError",
    "FormatVersionError",
    "MetricNotFoundError",
    "MissingFileError",
    "NotARunError",
    "OutputExistsError",
    "RaceError",
    "RankError",
    "RankLostError",
    "ReadOnlyRunError",
    "ReplayError",
    "RunLockedError",
    "SchemaError",
    "SegmentError",
    "SourceError",
    "StepNotFoundError",
    "StorageError",
    "TensorNotFoundError",
    "TimelineError",
    "UnsafeObjectError",
]


class DsttError(Exception):
    """Base class of every error dstt raises on purpose."""


class NotARunError(DsttError, FileNotFoundError):
    """The path is not a dstt run (no run metadata where one was expected)."""


class _LookupMessage(KeyError):
    """A ``KeyError`` whose ``str()`` is its message (``KeyError`` quotes its argument)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StepNotFoundError(DsttError, _LookupMessage):
    """The requested step (or slot, or object of a step) is not committed on the timeline
    asked for."""


class TensorNotFoundError(DsttError, _LookupMessage):
    """No tensor (or optimizer state of it) has that name at the step, or a layer selector
    matches none; the message names the closest ones and how to list them all."""


class MetricNotFoundError(DsttError, _LookupMessage):
    """The metric was never logged on the timeline asked for."""


class TimelineError(DsttError, ValueError):
    """A timeline name is unknown, already taken or malformed."""


class CurrentTimelineError(TimelineError):
    """The timeline is the current one (what training resumes), so it cannot be deleted;
    make another one current first (``run.switch(name)``, ``dstt timeline switch NAME``)."""


class CorruptRunError(DsttError, ValueError):
    """Bytes on disk do not match what the commit manifest promised."""


class ChecksumError(CorruptRunError):
    """A chunk, object or manifest failed its crc32c check."""


class FormatVersionError(CorruptRunError):
    """A manifest or run was written by an unknown (newer) format version."""


class RunLockedError(DsttError, BlockingIOError):
    """Another writer holds the run's lock."""


class StorageError(DsttError, OSError):
    """An I/O operation on the run's storage failed (disk full, permission, device error)."""


class ReadOnlyRunError(StorageError, PermissionError):
    """The run cannot be written (read-only directory or opened for reading)."""


class CaptureError(DsttError, RuntimeError):
    """The capture engine failed to checkpoint a step (the cause is chained)."""


class ConfigError(DsttError, ValueError):
    """``dstt.session`` was given objects that cannot be captured together (an optimizer that
    holds none of the model's trainable parameters, or parameters the model does not have)."""


class SegmentError(DsttError, ValueError):
    """A flat segment a step refuses: out of byte order, overlapping one written, splitting
    an array, from another layout, or missing at the commit (``dstt.store._seam``)."""


class RaceError(CaptureError):
    """A captured tensor was modified in place while it was being copied."""


class RankError(DsttError, RuntimeError):
    """The ranks of a multi-rank run disagree: a rank prepared another step for the same slot,
    did not prepare its part in time, or a step cannot be restored into this world size."""


class RankLostError(RankError):
    """Ranks of a multi-rank run are gone (their session ended, they stopped sending their
    heartbeat, or they did not prepare a step in time); ``ranks`` names them. The step waiting
    for them is not committed; the steps every rank prepared before stay committed."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class ReplayError(DsttError, ValueError):
    """A step cannot be replayed as asked: its predecessor is not committed, or its batches
    were not recorded (the message says what to pass)."""


class UnsafeObjectError(DsttError, PermissionError):
    """Loading this object would unpickle; pass ``trusted=True`` only for runs you trust."""


class SchemaError(DsttError, ValueError):
    """A tensor's dtype or shape differs from what the run already stores under its name."""


class SourceError(DsttError, ValueError):
    """A checkpoint given to ``dstt import`` cannot be imported: not a layout the importer
    knows, a file missing or damaged, or state it cannot name (the message says which file
    and what to pass: ``step=``, ``model=``, ``trusted=True``)."""


class MissingFileError(StorageError, FileNotFoundError):
    """A file the run needs is not there."""


class DsttWarning(UserWarning):
    """Something dstt accepted but that may not do what the caller meant (an optimizer that
    leaves trainable parameters out, metrics logged where they cannot be kept); filter it
    with ``warnings.filterwarnings("error", category=dstt.errors.DsttWarning)``. A warning, not
    an error, so it stays out of ``__all__`` (the error tree)."""


class OutputExistsError(DsttError, FileExistsError):
    """A file dstt was asked to write (an export) is already there, or is a folder; pass
    ``overwrite=True`` (``--force``) to replace a file, or choose another name."""
