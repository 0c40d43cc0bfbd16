"""What to capture: ``StateProvider``, the seam between a trainer's live state and the engine.

A provider names pieces of state and can put them back: ``tensors()`` (array path -> the
*live* tensor, copied lazily, unchanged until the engine's wait), ``objects()`` (a cheap
snapshot of plain data, taken synchronously) and ``restore(source)`` (bit-exact). Three
building blocks cover most state: ``TensorProvider``, ``ObjectProvider`` (getter/setter) and
``CompositeProvider``. Rejected alternative: one nested ``state_dict()`` per provider (the
engine could not tell a tensor to stream from a counter to serialize, and the flat array paths
inspection relies on would be lost).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from dstt.engine.tensors._convert import from_plain, store_dtype, tensor_from_numpy, to_plain
from dstt.engine.tensors.dtensors import restore_tensor
from dstt.errors import CorruptRunError, DsttWarning, SchemaError
from dstt.store._internal import (
    ArrayRecord,
    CommitHeader,
    LogicalArray,
    Prediction,
    RankInfo,
    Reader,
    check_array_path,
    decode_object,
    logical_arrays,
    read_logical,
    read_region,
)

__all__ = [
    "CompositeProvider",
    "ObjectProvider",
    "RankObject",
    "RestoreSource",
    "StateProvider",
    "StoreSource",
    "TensorProvider",
    "TensorSpec",
]


@dataclass(frozen=True)
class TensorSpec:
    """How one captured tensor is stored: array path, store dtype name, shape."""

    path: str
    dtype: str
    shape: tuple[int, ...]

    @staticmethod
    def of(path: str, t: torch.Tensor) -> TensorSpec:
        return TensorSpec(path, store_dtype(t.dtype, what=f"tensor {path!r}"), tuple(t.shape))


class RestoreSource(Protocol):
    """One committed step, as providers see it while restoring."""

    @property
    def step(self) -> int: ...

    def has_array(self, path: str) -> bool: ...

    def array(self, path: str) -> torch.Tensor:
        """The stored tensor as a CPU tensor of its stored dtype and shape."""
        ...

    def shape(self, path: str) -> tuple[int, ...]:
        """The stored tensor's (logical) shape."""
        ...

    def region(self, path: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``offsets``/``sizes`` of the stored tensor (a rank's local shard)."""
        ...

    def has_object(self, name: str) -> bool: ...

    def object(self, name: str) -> Any:  # noqa: ANN401 - a stored object
        """The stored object (tensors tagged by ``to_plain`` are *not* decoded)."""
        ...


@runtime_checkable
class StateProvider(Protocol):
    """A piece of training state the engine captures every checkpointed step."""

    def tensors(self) -> Mapping[str, torch.Tensor]: ...

    def objects(self) -> Mapping[str, Any]: ...

    def restore(self, source: RestoreSource) -> None: ...


TensorsArg = Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]


class TensorProvider:
    """A named set of live tensors; array path → tensor.

    ``tensors`` may be a mapping (fixed set) or a callable returning one (recomputed at each
    capture, e.g. optimizer state that appears after the first step). ``restore`` copies each
    stored array into the live tensor in place; dtype and shape must match exactly
    (``SchemaError`` otherwise). With ``strict=False`` a tensor missing from the step is left
    untouched instead of raising.

    ``snapshot=True`` hands the engine a clone taken at capture time instead of the live tensor
    (on the tensor's device, so on GPU it is an async kernel on the compute stream). Use it for
    small tensors that training legitimately writes between optimizer steps, such as
    BatchNorm running statistics, which the version guard would otherwise report as races.
    """

    #: ``tensors()`` returns a new mapping whenever any tensor in it changed
    stable = True

    def __init__(self, tensors: TensorsArg, *, strict: bool = True, snapshot: bool = False) -> None:
        self._get = tensors if callable(tensors) else (lambda: tensors)
        self.strict = strict
        self.snapshot = snapshot
        self._checked: set[str] = set()  # paths validated already (this runs every step)
        #: a source that hands out the same mapping object until any tensor of it changes
        #: (``ModelTensors``: ``stable = True``) is not copied again while it holds
        self._stable = bool(getattr(tensors, "stable", False))
        self._seen: Mapping[str, torch.Tensor] | None = None
        self._out: dict[str, torch.Tensor] = {}

    def _live(self) -> dict[str, torch.Tensor]:
        got = self._get()
        if self._stable and got is self._seen:
            return self._out
        out = dict(got)
        if not self._checked.issuperset(out):
            for path in out:
                check_array_path(path)
            self._checked.update(out)
        if self._stable:
            self._seen, self._out = got, out
        return out

    def tensors(self) -> Mapping[str, torch.Tensor]:
        live = self._live()
        if self.snapshot:
            return {p: t.detach().clone() for p, t in live.items()}
        return live

    def objects(self) -> Mapping[str, Any]:
        return {}

    def restore(self, source: RestoreSource) -> None:
        for path, live in self._live().items():
            if not source.has_array(path):
                if self.strict:
                    raise SchemaError(
                        f"step {source.step} has no array {path!r}, but the live model has it; "
                        "was the run written by a different model?"
                    )
                continue
            restore_tensor(source, path, live)

    def __repr__(self) -> str:
        return f"TensorProvider({len(self._live())} tensors)"


class ObjectProvider:
    """One named object captured through ``get()`` and restored through ``set(value)``.

    ``get`` must return a snapshot (a fresh value, not a live reference that training keeps
    mutating). Tensors inside the value are stored as raw bytes and come back as CPU tensors
    (or on their CUDA device when it exists). ``required=False`` tolerates steps without it.
    """

    stable = True  # (its tensors: always none)

    def __init__(
        self,
        name: str,
        get: Callable[[], Any],
        set: Callable[[Any], None] | None = None,
        *,
        required: bool = True,
    ) -> None:
        self.name = name
        self._get = get
        self._set = set
        self.required = required

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {}

    def objects(self) -> Mapping[str, Any]:
        return {self.name: to_plain(self._get())}

    def restore(self, source: RestoreSource) -> None:
        if self._set is None:
            return
        if not source.has_object(self.name):
            if self.required:
                raise SchemaError(f"step {source.step} has no object {self.name!r}")
            return
        self._set(from_plain(source.object(self.name)))

    def __repr__(self) -> str:
        return f"ObjectProvider({self.name!r})"


class RankObject(ObjectProvider):
    """An object each rank keeps for itself: ``<name>/r<rank>`` with several ranks, ``name``
    alone in a one-rank session. A resume restores the rank's own copy; a rank without one
    (more ranks than were saved; a run saved by one process) takes the one-rank copy or rank
    0's when ``fallback``. ``required``: a step holding none of them is a ``SchemaError``.
    ``always_suffix``: ``<name>/r<rank>`` in a one-rank session too (DeepSpeed's naming)."""

    def __init__(
        self,
        name: str,
        info: RankInfo,
        get: Callable[[], Any],
        set: Callable[[Any], None] | None,
        *,
        fallback: bool = True,
        required: bool = False,
        always_suffix: bool = False,
    ) -> None:
        own = f"{name}/r{info.rank}" if info.world > 1 or always_suffix else name
        super().__init__(own, get, set, required=required)
        self.base, self.fallback = name, fallback

    def restore(self, source: RestoreSource) -> None:
        if self._set is None:
            return
        for name in (self.name, *((self.base, f"{self.base}/r0") if self.fallback else ())):
            if source.has_object(name):
                self._set(from_plain(source.object(name)))
                return
        if self.required:
            raise SchemaError(f"step {source.step} has no object {self.name!r}")


class CompositeProvider:
    """Several providers as one; names must not collide. Restores in the given order."""

    def __init__(self, providers: Iterable[StateProvider] = ()) -> None:
        self.providers: list[StateProvider] = list(providers)
        self._parts: list[Mapping[str, torch.Tensor]] = []
        self._merged: dict[str, torch.Tensor] = {}

    def add(self, provider: StateProvider) -> None:
        self.providers.append(provider)
        self._parts = []

    @property
    def stable(self) -> bool:
        """Whether ``tensors()`` returns a new mapping whenever anything in it changed (every
        provider makes that promise)."""
        return all(getattr(p, "stable", False) for p in self.providers)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._merge_tensors([p.tensors() for p in self.providers])

    def objects(self) -> Mapping[str, Any]:
        return _merge([p.objects() for p in self.providers], "object")

    def capture(self) -> tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]:
        """``(tensors(), objects())`` at once: a provider with a ``capture`` method of its
        own (the optimizer state's) looks at its state once, not twice."""
        both = [
            p.capture() if hasattr(p, "capture") else (p.tensors(), p.objects())
            for p in self.providers
        ]
        return (
            self._merge_tensors([t for t, _ in both]),
            _merge([o for _, o in both], "object"),
        )

    def _merge_tensors(self, got: list[Mapping[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
        """The providers' tensors as one mapping. Where every provider is ``stable`` (it
        returns a new mapping whenever anything in it changed: the built-in ones) and each
        returned the same (or an empty) mapping again, it is last call's mapping, not
        merged again tensor by tensor; a provider without the promise (one that may refill
        its own dict in place) gets a fresh merge at every call."""
        parts = [t for t in got if t]
        if (
            len(parts) == len(self._parts)
            and all(map(operator.is_, parts, self._parts))
            and self.stable
        ):
            return self._merged
        self._parts, self._merged = parts, _merge(parts, "array")
        return self._merged

    def predictions(self) -> Mapping[str, Prediction]:
        """Predictions offered by the providers that have a ``predictions()`` method
        (optional: encoding hints for ``DeltaPolicy``, see ``dstt.store.codec.predict``)."""
        out: dict[str, Prediction] = {}
        for p in self.providers:
            get = getattr(p, "predictions", None)
            if callable(get):
                out.update(get())
        return out

    def restore(self, source: RestoreSource) -> None:
        for p in self.providers:
            p.restore(source)

    def __repr__(self) -> str:
        return f"CompositeProvider({self.providers!r})"


class StoreSource:
    """A committed step of a run as a ``RestoreSource`` (reads through a store ``Reader``).

    Trust is the caller's: ``trusted=True`` lets ``object()`` unpickle an object stored with
    pickle (user state that is not plain data); without it such an object raises
    ``UnsafeObjectError``. Only the objects a provider asks for are ever decoded, so a pickle
    no provider restores never runs, trusted or not. A resume of one's own run passes
    ``trusted=True`` (like ``torch.load`` of one's own checkpoint); replay, inspection and
    export leave it to the user.

    Arrays are the step's stored arrays and its *logical* ones (tensors several ranks wrote
    in parts, assembled from the shard maps: ``dstt.store.read.shards``): ``array`` reads a whole
    tensor, ``region`` only the box a rank holds (its local shard), from whichever parts
    overlap it.

    ``prefetch=True`` reads (and verifies) every stored array and the bytes of every object
    of the step up front, so a damaged array is refused before any live tensor is touched —
    at the cost of one host copy of the state during the resume. Objects are verified, not
    decoded: a damaged one fails only the provider that asks for it (``ChecksumError``), and
    ``unused_damage()`` warns of the damaged ones nobody asked for (a bit flip in the
    ``summaries`` no provider restores does not block a resume). Rejected alternatives:
    verifying everything, then reading it again to restore (twice the I/O of a large
    checkpoint); decoding every object up front (it unpickled objects nobody restores).
    """

    def __init__(
        self,
        reader: Reader,
        header: CommitHeader,
        *,
        prefetch: bool = False,
        trusted: bool = False,
    ) -> None:
        self._reader, self._header = reader, header
        self._trusted = trusted
        self._arrays = reader.arrays(header)
        self._logical: dict[str, LogicalArray] | None = None
        self._cached: dict[str, torch.Tensor] = {}
        self._raw: dict[str, bytes] = {}  # verified, undecoded object bytes (prefetch)
        self._damaged: dict[str, CorruptRunError] = {}
        self._asked: set[str] = set()
        if prefetch:
            for path, rec in self._arrays.items():
                self._cached[path] = tensor_from_numpy(reader.read_array(header, path), rec.dtype)
            for name in header.objects:
                try:
                    self._raw[name] = reader.read_object_bytes(header, name)
                except CorruptRunError as e:  # damaged or missing: fails only who asks
                    self._damaged[name] = e

    @property
    def reader(self) -> Reader:
        """The store ``Reader`` (for providers that read beyond whole arrays)."""
        return self._reader

    @property
    def header(self) -> CommitHeader:
        """The commit header being restored."""
        return self._header

    @property
    def trusted(self) -> bool:
        """Whether ``object()`` may unpickle (see the class docstring)."""
        return self._trusted

    @property
    def step(self) -> int:
        return int(self._header.step)

    @property
    def logical(self) -> Mapping[str, LogicalArray]:
        """The step's logical arrays (empty unless ranks wrote tensors in parts)."""
        if self._logical is None:
            self._logical = logical_arrays(self._reader, self._header, self._arrays)
        return self._logical

    def has_array(self, path: str) -> bool:
        return path in self._arrays or path in self.logical

    def _record(self, path: str) -> ArrayRecord | LogicalArray:
        rec = self._arrays.get(path) or self.logical.get(path)
        if rec is None:
            raise SchemaError(f"step {self.step} has no array {path!r}")
        return rec

    def shape(self, path: str) -> tuple[int, ...]:
        return tuple(self._record(path).shape)

    def array(self, path: str) -> torch.Tensor:
        if path not in self._arrays:
            a = self.logical.get(path)
            if a is None:
                raise SchemaError(f"step {self.step} has no array {path!r}")
            data = read_logical(self._reader, self._header, a).reshape(a.shape)
            return tensor_from_numpy(data, a.dtype)
        cached = self._cached.pop(path, None)  # each array is restored once: free as we go
        if cached is not None:
            return cached
        rec = self._arrays[path]
        return tensor_from_numpy(self._reader.read_array(self._header, path), rec.dtype)

    def region(self, path: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        dtype = str(self._record(path).dtype)
        data = read_region(self._reader, self._header, path, offsets, sizes, self.logical)
        return tensor_from_numpy(np.ascontiguousarray(data), dtype)

    def has_object(self, name: str) -> bool:
        return name in self._header.objects

    def object(self, name: str) -> Any:  # noqa: ANN401 - a stored object
        """Object ``name``, decoded now (pickled ones only with ``trusted``)."""
        self._asked.add(name)
        damage = self._damaged.get(name)
        if damage is not None:
            raise damage
        data = self._raw.get(name)
        if data is None:
            data = self._reader.read_object_bytes(self._header, name)
        rec = self._header.objects[name]
        where = f"{self._reader.storage.location}/{rec.key}"
        return decode_object(data, rec.encoding, trusted=self._trusted, where=where)

    def unused_damage(self, *, warn: bool = True) -> list[str]:
        """The objects found damaged by the prefetch that no provider asked for (sorted);
        with ``warn`` a ``DsttWarning`` names them. Call it after the restore."""
        names = sorted(set(self._damaged) - self._asked)
        if names and warn:
            warnings.warn(
                f"dstt: step {self.step} holds damaged objects no provider restores: "
                f"{', '.join(names)} ({self._damaged[names[0]]}); the restore went on "
                "without them. Run `dstt verify` on the run to see the damage",
                DsttWarning,
                stacklevel=2,
            )
        return names


def _merge(parts: Iterable[Mapping[str, Any]], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        for name, v in part.items():
            if name in out:
                raise ValueError(f"two providers capture the {what} {name!r}")
            out[name] = v
    return out
