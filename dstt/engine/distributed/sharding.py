"""Which part of each captured tensor this rank writes, under PyTorch-native parallelism.

A rank *holds* one box of each logical tensor (a plain tensor whole, a DTensor its local
shard at DTensor's global offsets) and writes it only if it is that box's *writer*: the ranks
exchange their boxes once (``RankChannel``, no collective) and all compute the same
assignment, largest boxes first to the least-loaded holder (DCP's ``dedup_save_plans`` rule),
so replicated bytes are written once. A whole box is stored under the tensor's path, any other
under ``dtensor/w<world>/r<writer>/<path>`` with a shard map; restore reads the live box from
whatever boxes are stored, so other placements reshard. Rejected alternatives: gathering full
tensors to rank 0 (a collective and a full copy on the training path) and writers from mesh
coordinates alone (a sub-mesh cannot see the ranks that repeat it). More, pipeline stages
included: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.engine.state.providers import CompositeProvider, RestoreSource, StateProvider
from dstt.engine.tensors._convert import store_dtype
from dstt.engine.tensors.dtensors import held_box, local_view
from dstt.errors import CaptureError, SchemaError
from dstt.schema import LAYOUT_OBJECT
from dstt.store._internal import DTENSOR_PREFIX, Box, Encoded, LogicalArray, shard_map, shard_source

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    import torch

    from .ranks import RankChannel, RankInfo

__all__ = [
    "DTENSOR_PREFIX",
    "Held",
    "OwnedTensors",
    "RankShare",
    "RankZeroObjects",
    "StageLayout",
    "assign_writers",
    "check_layout",
    "owners",
]


class StageLayout:
    """Do the ranks hold the same parameters (data, fully sharded, tensor parallel: one
    optimizer structure, stored once) or different ones (pipeline stages: one per rank)?

    ``decide`` runs once on every rank at open (a message round through the channel);
    ``params`` is then None, or each rank's sorted parameter names (pipeline stages)."""

    def __init__(self, info: RankInfo) -> None:
        self.info = info
        self.params: list[list[str]] | None = None

    @property
    def staged(self) -> bool:
        return self.params is not None

    def decide(self, channel: RankChannel, names: Iterable[str]) -> None:
        every = channel.gather(
            "layout", sorted(names), what="parameter names (the pipeline layout)"
        )
        self.params = every if any(e != every[0] for e in every) else None

    def objects(self, objects: Mapping[str, Any]) -> Mapping[str, Any]:
        """What this rank stores of ``objects`` (state of its stage, or every rank's alike)."""
        if self.staged:
            return {f"{name}/r{self.info.rank}": v for name, v in objects.items()}
        return objects if self.info.rank == 0 else {}

    def source(self, source: RestoreSource) -> RestoreSource:
        """``source`` as this rank's providers read it (its own objects, when staged)."""
        return _OwnObjects(source, self.info.rank) if self.staged else source

    def layout_objects(self) -> Mapping[str, Any]:
        if not self.staged or self.info.rank != 0:
            return {}
        return {LAYOUT_OBJECT: Encoded.of({"world": self.info.world, "params": self.params})}


def check_layout(source: RestoreSource, live: list[list[str]] | None, *, world: int) -> None:
    """Refuse, before anything is restored, a step whose pipeline layout (``parallel/layout``:
    which parameters each rank held) is not this session's (``live``; None: every rank holds
    the same parameters, or one process)."""
    stored = source.object(LAYOUT_OBJECT) if source.has_object(LAYOUT_OBJECT) else None
    if stored is None and live is None:
        return
    if stored is None:
        raise SchemaError(
            f"step {source.step} was written by ranks that all held the same parameters, but "
            f"this session's {world} ranks hold different ones (pipeline stages): resume a "
            "pipeline-parallel run only from a run it wrote"
        )
    saved = [list(p) for p in stored["params"]]
    if live != saved:
        where = (
            "one process (or ranks holding the same parameters)"
            if live is None
            else f"{world} ranks holding {[len(p) for p in live]} parameters each"
        )
        raise SchemaError(
            f"step {source.step} was written by a pipeline of {len(saved)} stages (rank r held "
            f"parameters {[[*p[:2], '...'] if len(p) > 2 else p for p in saved]}); this session "
            f"has {where}. Resume it on the same pipeline layout (same world size, the same "
            "stages on the same ranks); read it with dstt.open(run), which sees every stage's "
            "tensors under their own names"
        )


class _OwnObjects:
    """A restore source whose objects are this rank's own copies (``<name>/r<rank>``)."""

    def __init__(self, source: RestoreSource, rank: int) -> None:
        self._source, self._rank = source, rank

    @property
    def step(self) -> int:
        return self._source.step

    def has_array(self, path: str) -> bool:
        return self._source.has_array(path)

    def array(self, path: str) -> torch.Tensor:
        return self._source.array(path)

    def shape(self, path: str) -> tuple[int, ...]:
        return self._source.shape(path)

    def region(self, path: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        return self._source.region(path, offsets, sizes)

    def has_object(self, name: str) -> bool:
        return self._source.has_object(f"{name}/r{self._rank}")

    def object(self, name: str) -> Any:  # noqa: ANN401 - a stored object
        return self._source.object(f"{name}/r{self._rank}")


# -- the plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """One box of a logical tensor held by a rank."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return self.sizes == self.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes)  # relative sizes are all the plan needs

    def wire(self) -> list[Any]:
        return [self.path, self.dtype, list(self.shape), list(self.offsets), list(self.sizes)]

    @staticmethod
    def unwire(v: Sequence[Any]) -> Held:
        return Held(str(v[0]), str(v[1]), tuple(v[2]), tuple(v[3]), tuple(v[4]))


def assign_writers(held: Sequence[Sequence[Held]]) -> dict[tuple[str, tuple[int, ...]], int]:
    """``held[r]``: the boxes rank ``r`` holds → the writer of each distinct box, by
    ``(path, offsets)``. Every rank computes the same answer from the same input. A tensor
    held with different dtypes or shapes, or whose boxes overlap or leave a gap, is a
    ``CaptureError`` naming it."""
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    boxes: dict[tuple[str, tuple[int, ...]], Held] = {}
    kinds: dict[str, tuple[str, tuple[int, ...]]] = {}
    for rank, items in enumerate(held):
        for h in items:
            kind = (h.dtype, h.shape)
            if kinds.setdefault(h.path, kind) != kind:
                raise CaptureError(
                    f"{h.path!r} is {kinds[h.path]} on one rank and {kind} on "
                    f"rank {rank}: the ranks capture different models"
                )
            key = (h.path, h.offsets)
            seen = boxes.setdefault(key, h)
            if seen.sizes != h.sizes:
                raise CaptureError(
                    f"ranks hold boxes of {h.path!r} at {h.offsets} with "
                    f"different sizes ({seen.sizes}, {h.sizes})"
                )
            holders.setdefault(key, []).append(rank)
    by_path: dict[str, list[Held]] = {}
    for h in boxes.values():
        by_path.setdefault(h.path, []).append(h)
    for path, hs in by_path.items():
        shape = kinds[path][1]
        total = sum(math.prod(h.sizes) for h in hs)
        overlap = any(
            Box("", a.offsets, a.sizes).overlap(b.offsets, b.sizes) is not None
            for i, a in enumerate(hs)
            for b in hs[:i]
        )
        if overlap or total != math.prod(shape):
            raise CaptureError(
                f"the ranks' parts of {path!r} ({len(hs)} distinct boxes, {total} of "
                f"{math.prod(shape)} elements{', overlapping' if overlap else ''}) do not make "
                "up the tensor: a rank that holds part of it does not run the session, or its "
                "placements are not supported"
            )
    load = [0] * len(held)
    out: dict[tuple[str, tuple[int, ...]], int] = {}
    for key in sorted(boxes, key=lambda k: (-boxes[k].nbytes, k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        out[key] = rank
        load[rank] += boxes[key].nbytes
    return out


def owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Rank that writes each replicated array: largest first to the least loaded rank (the
    DeepSpeed session's rule for its replicated tensors)."""
    load = [0] * world
    out: dict[str, int] = {}
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[path] = r
        load[r] += sizes[path]
    return out


# -- providers ------------------------------------------------------------------------------
class RankShare:
    """This rank's share of a provider's logical tensors (see the module docstring).

    ``inner`` hands out logical tensors (plain or DTensors) by path, and should be *stable*
    (the same mapping object while nothing changed: the built-in providers are). Its objects
    are state every rank holds alike (``optim/state``), written by rank 0; each rank adds its
    shard map. Restore goes to ``inner``, whose providers read their live boxes with
    ``dtensors.restore_tensor``.
    """

    stable = True

    def __init__(
        self,
        inner: StateProvider,
        info: RankInfo,
        channel: RankChannel,
        layout: StageLayout | None = None,
    ) -> None:
        self.inner, self.info, self.channel = inner, info, channel
        self.layout = layout or StageLayout(info)
        self._seen: Mapping[str, torch.Tensor] | None = None
        self._key: tuple[Any, ...] | None = None
        self._mine: list[tuple[str, str]] = []  # (stored path, logical path) this rank writes
        self._out: dict[str, torch.Tensor] = {}
        self._map: Encoded | None = None
        self._plans = 0

    @property
    def plans(self) -> int:
        """How many plans were made (each a message round between the ranks)."""
        return self._plans

    def tensors(self) -> Mapping[str, torch.Tensor]:
        got = self.inner.tensors()
        if got is self._seen and getattr(self.inner, "stable", False):
            return self._out
        held = self._held(got)
        key = tuple(held)
        if key != self._key:
            self._plan(held)
            self._key = key
        self._out = {stored: local_view(got[path]) for stored, path in self._mine}
        self._seen = got
        return self._out

    def _held(self, got: Mapping[str, torch.Tensor]) -> list[Held]:
        out = []
        for path, t in got.items():
            box = held_box(t)
            if box is not None:
                out.append(
                    Held(path, store_dtype(t.dtype, what=f"tensor {path!r}"), tuple(t.shape), *box)
                )
        return out

    def _plan(self, held: list[Held]) -> None:
        every = self.channel.gather(
            f"plan/{self._plans}",
            [h.wire() for h in held],
            what="captured tensors (a plan of who writes what)",
        )
        self._plans += 1
        boxes = [[Held.unwire(v) for v in items] for items in every]
        writer = assign_writers(boxes)
        sharded = {h.path for items in boxes for h in items if not h.whole}
        r, w = self.info.rank, self.info.world
        mine: list[tuple[str, str]] = []
        arrays: list[LogicalArray] = []
        for h in held:
            if writer[(h.path, h.offsets)] != r:
                continue
            if h.path not in sharded:
                mine.append((h.path, h.path))
                continue
            stored = shard_source(w, r, h.path)
            mine.append((stored, h.path))
            arrays.append(
                LogicalArray(h.path, h.dtype, h.shape, boxes=(Box(stored, h.offsets, h.sizes),))
            )
        self._mine = mine
        self._map = Encoded.of(shard_map(arrays)) if sharded else None

    def objects(self) -> Mapping[str, Any]:
        out = dict(self.layout.objects(self.inner.objects()))
        out.update(self.layout.layout_objects())
        if self._map is not None:
            out[f"{schema.SHARDS_OBJECT}/r{self.info.rank}"] = self._map
        return out

    def capture(self) -> tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]:
        tensors = self.tensors()
        return tensors, self.objects()

    def predictions(self) -> Mapping[str, Any]:
        return {}

    def restore(self, source: RestoreSource) -> None:
        self.inner.restore(self.layout.source(source))

    def __repr__(self) -> str:
        return f"RankShare({self.inner!r}, rank={self.info.rank}/{self.info.world})"


class OwnedTensors:
    """Replicated tensors of several providers; ``tensors()`` yields this rank's share only
    (``rank0``: rank 0 owns them all). Objects come from rank 0 only; ``restore`` reads every
    array (all ranks hold them all). The DeepSpeed session's replicated state."""

    def __init__(self, providers: Iterable[Any], info: RankInfo, *, rank0: bool = False) -> None:
        self.inner = CompositeProvider(providers)
        self.info, self.rank0 = info, rank0

    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self.rank0:
            return self.inner.tensors() if self.info.rank == 0 else {}
        every = self.inner.tensors()
        mine = owners({p: t.numel() * t.element_size() for p, t in every.items()}, self.info.world)
        return {p: t for p, t in every.items() if mine[p] == self.info.rank}

    def objects(self) -> Mapping[str, Any]:
        return self.inner.objects() if self.info.rank == 0 else {}

    def restore(self, source: RestoreSource) -> None:
        self.inner.restore(source)


class RankZeroObjects:
    """``inner``'s objects from rank 0 only (state every rank holds alike) — or, with a
    ``layout`` that finds pipeline stages, each rank's own; its tensors as they are."""

    def __init__(
        self, inner: StateProvider, info: RankInfo, layout: StageLayout | None = None
    ) -> None:
        self.inner, self.info = inner, info
        self.layout = layout or StageLayout(info)
        self.stable = bool(getattr(inner, "stable", False))

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self.inner.tensors()

    def objects(self) -> Mapping[str, Any]:
        return self.layout.objects(self.inner.objects())

    def restore(self, source: RestoreSource) -> None:
        self.inner.restore(self.layout.source(source))

    def __repr__(self) -> str:
        return f"RankZeroObjects({self.inner!r})"
