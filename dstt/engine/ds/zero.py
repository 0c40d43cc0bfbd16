"""ZeRO stages 1-3: capture a rank's flat fp32 partitions as they are, and map them to names.

dstt captures the live flat buffers of each group, ``zero/s<stage>w<world>/r<rank>/g<group>/
fp32`` and ``.../<state>`` (Adam moments, same shape), so each rank writes only its own
arrays; stage and world size are in the path because they decide the partition sizes. A shard
map per rank says which element ranges are which parameter (``params/...``, ``optim/<state>/
...``), so readers assemble the logical tensors lazily. Restore copies the raw buffers back on
the same world, stage and layout, and reshards from the logical tensors otherwise. Rejected
alternative: ``optimizer.state_dict()`` per step (new views and dicts on the training thread,
a layout per stage and version). Where a parameter lives per stage: docs/decisions.md,
"Module notes".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dstt import schema
from dstt.engine.tensors._convert import from_plain, to_plain
from dstt.errors import RankError, SchemaError
from dstt.schema import tensor_path
from dstt.store._internal import LogicalArray, Piece, logical_arrays, read_logical, shard_map

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.engine.distributed.ranks import RankInfo
    from dstt.engine.state.providers import RestoreSource
    from dstt.store._internal import CommitHeader, Reader

__all__ = ["ZeroState"]


@dataclass(frozen=True)
class _Slice:
    """``length`` elements of group ``group``'s flat buffer from ``src`` are parameter
    elements from ``dst``."""

    group: int
    src: int
    dst: int
    length: int


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    off, rem = divmod(t.data_ptr() - base.data_ptr(), t.element_size())
    if rem or off < 0 or off + t.numel() > base.numel():
        raise SchemaError(
            "a ZeRO parameter is not a view into its group's flat buffer; this "
            "DeepSpeed layout is not supported"
        )
    return off


class ZeroState:
    """State provider for one rank of a ZeRO stage 1, 2 or 3 optimizer."""

    def __init__(self, engine: Any, info: RankInfo) -> None:
        opt = engine.optimizer
        self.engine, self.opt, self.info = engine, opt, info
        self.inner: torch.optim.Optimizer = opt.optimizer
        self.stage = int(engine.zero_optimization_stage())
        names = {id(p): n for n, p in engine.module.named_parameters()}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.slices: dict[str, list[_Slice]] = {}
        if self.stage == 3:
            self.flats: list[torch.Tensor] = list(opt.fp32_partitioned_groups_flat)
            for g, (params, bit16) in enumerate(
                zip(opt.fp16_groups, opt.fp16_partitioned_groups_flat, strict=True)
            ):
                for p in params:
                    name = names[id(p)]
                    pn, n = int(p.ds_tensor.ds_numel), int(p.ds_numel)
                    self.shapes[name] = tuple(p.ds_shape)
                    length = max(0, min(pn, n - info.rank * pn))
                    if length:
                        off = _offset(p.ds_tensor, bit16)
                        self.slices.setdefault(name, []).append(
                            _Slice(g, off, info.rank * pn, length)
                        )
        else:
            self.flats = list(opt.single_partition_of_fp32_groups)
            for g, params in enumerate(opt.bit16_groups):
                flat, size = opt.bit16_groups_flat[g], int(opt.partition_size[g])
                lo_r, hi_r = info.rank * size, (info.rank + 1) * size
                for p in params:
                    name = names[id(p)]
                    self.shapes[name] = tuple(p.shape)
                    off = _offset(p, flat)
                    lo, hi = max(off, lo_r), min(off + p.numel(), hi_r)
                    if lo < hi:
                        self.slices.setdefault(name, []).append(
                            _Slice(g, lo - lo_r, lo - off, hi - lo)
                        )
        self.params: dict[str, Any] = {  # DeepSpeed adds ds_* attributes
            n: p for n, p in engine.module.named_parameters() if n in self.shapes
        }
        self._maps: dict[tuple[Any, ...], dict[str, Any]] = {}

    # -- naming ---------------------------------------------------------------------------
    def raw_path(self, group: int, key: str) -> str:
        i = self.info
        return f"zero/s{self.stage}w{i.world}/r{i.rank}/g{group}/{key}"

    def _state(self, g: int) -> Mapping[str, Any]:
        state: Mapping[str, Any] = self.inner.state.get(self.flats[g], {})
        return state

    def _array_keys(self, g: int) -> list[str]:
        flat = self.flats[g]
        return [
            k
            for k, v in self._state(g).items()
            if isinstance(v, torch.Tensor) and v.shape == flat.shape
        ]

    # -- capture --------------------------------------------------------------------------
    def tensors(self) -> Mapping[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for g, flat in enumerate(self.flats):
            out[self.raw_path(g, "fp32")] = flat
            st = self._state(g)
            for k in self._array_keys(g):
                out[self.raw_path(g, k)] = st[k]
        return out

    def shard_map(self) -> dict[str, Any]:
        """This rank's pieces of every logical tensor (cached per set of state keys)."""
        keys = tuple(tuple(self._array_keys(g)) for g in range(len(self.flats)))
        m = self._maps.get(keys)
        if m is None:
            arrays = []
            every = [
                ("params", "fp32"),
                *((f"optim/{k}", k) for k in dict.fromkeys(k for ks in keys for k in ks)),
            ]
            for name, slices in self.slices.items():
                for kind, key in every:
                    if key != "fp32" and any(key not in keys[s.group] for s in slices):
                        continue
                    pieces = tuple(
                        Piece(self.raw_path(s.group, key), s.src, s.dst, s.length) for s in slices
                    )
                    arrays.append(
                        LogicalArray(tensor_path(kind, name), "float32", self.shapes[name], pieces)
                    )
            m = self._maps[keys] = shard_map(arrays)
        return m

    def objects(self) -> Mapping[str, Any]:
        scalars = {
            str(g): {
                k: to_plain(v) for k, v in self._state(g).items() if k not in self._array_keys(g)
            }
            for g in range(len(self.flats))
        }
        r = self.info.rank
        return {
            f"{schema.SHARDS_OBJECT}/r{r}": self.shard_map(),
            f"{schema.ZERO_SCALARS_OBJECT}/r{r}": scalars,
        }

    # -- restore --------------------------------------------------------------------------
    def restore(self, source: RestoreSource) -> None:
        """Put the stored master weights and optimizer state into this rank's buffers (raw
        copy when the layout matches, reshard otherwise), then the model. ``source`` must be
        a ``StoreSource`` (resharding reads element ranges, not whole arrays)."""
        reader, header = getattr(source, "reader", None), getattr(source, "header", None)
        if reader is None or header is None:
            raise TypeError("ZeroState.restore needs a StoreSource (a reader and a header)")
        logical = logical_arrays(reader, header)
        if not logical:
            raise SchemaError(
                f"step {header.step} holds no ZeRO partitions (written without "
                f"ZeRO?); it cannot be resumed with ZeRO stage {self.stage}"
            )
        same = self._same_layout(source, reader.arrays(header))
        r = self.info.rank
        name = (
            f"{schema.ZERO_SCALARS_OBJECT}/r{r}"
            if source.has_object(f"{schema.ZERO_SCALARS_OBJECT}/r{r}")
            else f"{schema.ZERO_SCALARS_OBJECT}/r0"
        )
        scalars = from_plain(source.object(name))
        if len(scalars) != len(self.flats):
            raise RankError(
                f"step {header.step} has {len(scalars)} ZeRO groups; this engine "
                f"has {len(self.flats)} (another model or sub_group_size?)"
            )
        keys = list(dict.fromkeys(p.split("/")[1] for p in logical if p.startswith("optim/")))
        for g, flat in enumerate(self.flats):
            st = self.inner.state.setdefault(flat, {})
            for k in keys:
                if not isinstance(st.get(k), torch.Tensor) or st[k].shape != flat.shape:
                    st[k] = torch.zeros_like(flat)
            st.update(scalars[str(g)])
            targets = {"fp32": flat, **{k: st[k] for k in keys}}
            with torch.no_grad():
                for key, live in targets.items():
                    if same:
                        _copy(live, source.array(self.raw_path(g, key)), self.raw_path(g, key))
                    else:
                        self._reshard(live, g, key, logical, reader, header)
        self._refresh_model(logical, reader, header)

    def _same_layout(self, source: RestoreSource, table: Mapping[str, Any]) -> bool:
        """Whether this rank's stored buffers have exactly the live layout (raw copy is then
        bit-exact, padding included)."""
        name = f"{schema.SHARDS_OBJECT}/r{self.info.rank}"
        if not source.has_object(name):
            return False
        stored = source.object(name)["arrays"]
        if any(stored.get(p) != a for p, a in self.shard_map()["arrays"].items()):
            return False
        for g, flat in enumerate(self.flats):
            rec = table.get(self.raw_path(g, "fp32"))
            if rec is None or tuple(rec.shape) != tuple(flat.shape):
                return False
        return True

    def _reshard(
        self,
        live: torch.Tensor,
        g: int,
        key: str,
        logical: Mapping[str, LogicalArray],
        reader: Reader,
        header: CommitHeader,
    ) -> None:
        kind = "params" if key == "fp32" else f"optim/{key}"
        for name, slices in self.slices.items():
            path = tensor_path(kind, name)
            rec = logical.get(path)
            if rec is None:
                raise SchemaError(
                    f"step {header.step} has no {path!r}; was it written by another model?"
                )
            if rec.shape != self.shapes[name]:
                raise SchemaError(
                    f"{path!r} is stored with shape {rec.shape}, the live "
                    f"parameter has {self.shapes[name]}"
                )
            for s in slices:
                if s.group != g:
                    continue
                data = read_logical(reader, header, rec, s.dst, s.dst + s.length)
                live[s.src : s.src + s.length].copy_(torch.from_numpy(data))

    def _refresh_model(
        self, logical: Mapping[str, LogicalArray], reader: Reader, header: CommitHeader
    ) -> None:
        """Model (bit16) weights from the restored master weights, as DeepSpeed's step does."""
        with torch.no_grad():
            if self.stage == 3:
                for flat, bit16 in zip(
                    self.flats, self.opt.fp16_partitioned_groups_flat, strict=True
                ):
                    bit16.copy_(flat)
            for name, p in self.params.items():
                if self.stage == 3 and (p.numel() != p.ds_numel or p.ds_status.name != "AVAILABLE"):
                    continue  # gathered from its partitions when used
                full = read_logical(reader, header, logical[tensor_path("params", name)])
                p.data.copy_(torch.from_numpy(full).view(p.shape))

    def __repr__(self) -> str:
        return f"ZeroState(stage={self.stage}, rank={self.info.rank}, groups={len(self.flats)})"


def _copy(live: torch.Tensor, stored: torch.Tensor, path: str) -> None:
    if stored.shape != live.shape or stored.dtype != live.dtype:
        raise SchemaError(
            f"{path!r} is stored as {stored.dtype}{tuple(stored.shape)}, the live "
            f"buffer is {live.dtype}{tuple(live.shape)}"
        )
    live.copy_(stored)
