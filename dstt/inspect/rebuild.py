"""Rebuild a light step (``every="auto"``): restore the stored step before it, replay the rest.

:func:`rebuild_step` restores the nearest stored step *j* < *k* and re-runs steps *j+1..k*
as the loop did (recorded samples, clipping, ``optimizer.step()``, the scheduler), checking
each recomputed loss against the step's fingerprint **bit for bit**; the first that differs
ends it with a ``ReplayError`` naming where the chain broke. DDP over 2 ranks replays in one
process (each rank's samples on its own RNG, gradients averaged: a+b is the allreduce's sum);
over more, in a gloo world of that size (:mod:`.rebuild_ddp`: the real allreduce's order).
Sharded runs (FSDP2, TP, ZeRO) raise "not yet". :func:`rebuilt_commit` makes a derived commit.
Rejected: replaying backwards from the next stored step (optimizer steps do not invert).
docs/decisions.md, "Light steps"."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dstt import schema
from dstt.engine.capture.light import loss_bits, loss_of, step_loss
from dstt.engine.state.model_names import param_names
from dstt.engine.state.optimizers import optimizers_of
from dstt.engine.state.torch_state import discover, get_rng, set_rng
from dstt.engine.tensors._convert import from_plain, to_plain
from dstt.errors import ConfigError, ReplayError, StepNotFoundError

from .rebuild_ddp import WorldReplay, replay_world
from .replay_compare import _compare
from .replay_data import _step_batches
from .replay_kit import (
    LossFn,
    ReplayKit,
    _backward,
    _default_loss,
    _kit_of,
    _optimizer_step,
    _restore,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from dstt.store._internal import CommitHeader, Reader, Repository

__all__ = [
    "REBUILT_OBJECT",
    "REPLAY_KEYS",
    "Rebuilt",
    "load_factory",
    "rebuild_step",
    "rebuilt_commit",
]

#: the object that marks a rebuilt step's derived commit (never written to the run itself)
REBUILT_OBJECT = schema.REBUILT_OBJECT


@dataclass(frozen=True)
class Rebuilt:
    """A rebuilt step: ``step``, the stored step ``base`` it started from, each replayed
    step's recomputed loss (``losses``), the steps whose loss matched its fingerprint bit for
    bit (``checked``) and those that logged no loss (``unchecked``); with ``check_next``, the
    next stored step the chain reached and matched (``landed``)."""

    step: int
    base: int
    #: the stored step the chain was replayed on to and matched bit for bit (``check_next``)
    landed: int | None = None
    losses: dict[int, float] = field(default_factory=dict)
    checked: list[int] = field(default_factory=list)
    unchecked: list[int] = field(default_factory=list)
    #: a DDP run's light step: each rank's RNG state where the chain last reached (what the
    #: derived commit stores as ``rng/r<rank>``); empty for one process
    rank_rng: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def faithful(self) -> bool:
        """Every replayed step was checked against its loss fingerprint (and matched)."""
        return not self.unchecked

    def __repr__(self) -> str:
        chain = f"replayed {self.base + 1}..{self.step}" if self.step > self.base else "stored"
        note = f", {len(self.unchecked)} without a logged loss" if self.unchecked else ""
        if self.landed is not None:
            note += f"; lands on stored step {self.landed} bit for bit"
        return (
            f"Rebuilt(step {self.step} from stored step {self.base}: {chain}; "
            f"{len(self.checked)} loss(es) bit-exact{note})"
        )


def _matches(bits: str, losses: list[float], logged: Callable[[list[float]], float] | None) -> bool:
    """Does the logged loss ``bits`` equal what the loop logged: ``logged(losses)`` if given,
    else the last micro-batch's loss or, with several micro-batches, their sum or mean (in
    float64, or accumulated in float32 as a tensor sum is)?"""
    if logged is not None:
        return loss_bits(logged(losses)) == bits
    if not losses:
        return False
    candidates = {losses[-1]}
    if len(losses) > 1:
        acc = step_loss(losses)  # a framework callback's fingerprint
        n = len(losses)
        candidates |= {sum(losses), sum(losses) / n, acc, float(torch.tensor(acc) / n)}
    return any(loss_bits(c) == bits for c in candidates)


def rebuild_step(
    run: Any,
    reader: Reader,
    step: int,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    *,
    kit: ReplayKit | None = None,
    scheduler: Any = None,
    before_step: Callable[[], None] | None = None,
    loss_fn: LossFn | None = None,
    batches: Any = None,
    dataset: Any = None,
    collate: Callable[[list[Any]], Any] | None = None,
    logged: Callable[[list[float]], float] | None = None,
    check_next: bool = False,
    timeline: str | None = None,
    trusted: bool = False,
    on_step: Callable[[int, Rebuilt, ReplayKit], None] | None = None,
) -> Rebuilt:
    """Bring the live objects to step ``step`` of ``run`` (read with ``reader``): restore the
    nearest stored step before it and replay the light steps up to it (module docstring).
    ``batches`` here is a callable from sample indices to a batch (or use ``dataset``);
    ``logged(losses)``: the loss the loop logged from its micro-batches' losses (default: the
    last one, or their sum or mean), for a loop that logs e.g. an unscaled loss.
    ``check_next``: first replay on to the next stored step *m* and compare every parameter
    and optimizer-state tensor with it, bit for bit (``Rebuilt.landed``; twice the replay).
    ``on_step(i, so_far, kit)``: called at each replayed step ``i`` of the chain to ``step``
    once its loss matched, the live objects (``kit``) at ``i`` (a range rebuilt in one pass
    reads them there)."""
    k = int(step)
    kit = _kit_of(kit, model, optimizer, scheduler, before_step, loss_fn)
    timeline = timeline or run.timeline
    line = run.commits(timeline)
    stored = {int(h.step): h for h in line}
    light = run.light_steps(timeline)
    pruned = sorted(int(h.step) for h in run.commits(timeline, pruned=True) if h.pruned)
    if k not in stored and k not in light:
        raise StepNotFoundError(
            f"step {k} is neither stored nor recorded as a light step on timeline "
            f"{timeline!r}; stored steps near it: "
            f"{sorted(stored, key=lambda s: (abs(s - k), s))[:4]}{_gc_hint(pruned, k)}"
        )
    below = [s for s in stored if s <= k]
    if not below:
        raise ReplayError(
            f"no stored step at or before light step {k} on timeline {timeline!r}: a rebuild "
            f"starts from one{_gc_hint(pruned, k)}"
        )
    j = max(below)
    world = _ranks(stored[j].objects) if j != k else 1
    if world > 1:
        _check_ddp(stored[j].objects, world, k, j)
    gone = [i for i in range(j + 1, k + 1) if i not in light]
    if gone:
        raise ReplayError(
            f"rebuilding step {k} from stored step {j}: steps {gone} have no light record "
            "(pruned, or not taken on this timeline), so the chain cannot be replayed"
            f"{_gc_hint(pruned, k)}"
        )
    fn = loss_fn or _default_loss
    rank_batches = _RankBatches(run, reader, timeline, world)
    maker = batches if callable(batches) else None

    def chain(upto: int, out: Rebuilt, report: bool = False) -> None:
        """Restore step ``j`` into the live objects and replay ``j+1..upto``, checking each
        light step's loss; a stored step (``upto`` with ``check_next``) is not checked here."""
        source = _restore(kit, reader, stored[j], trusted)
        rngs = (
            [from_plain(source.object(f"{schema.RNG_OBJECT}/r{r}")) for r in range(world)]
            if world > 1
            else []
        )
        world_run = None
        if world > 2:  # a gloo world of the recorded size replays the steps (rebuild_ddp)
            world_run = world_replay(upto, rngs)
        try:
            for n, i in enumerate(range(j + 1, upto + 1)):
                if world_run is not None:
                    rngs = world_run.load(n, kit)
                    set_rng(rngs[0])  # the process goes on as rank 0
                    losses = world_run.losses[n]
                else:
                    losses = replay_one(i, rngs)
                if world > 1:
                    out.rank_rng.clear()
                    out.rank_rng.update(enumerate(rngs))
                check(i, losses, out, report)
        finally:
            if world_run is not None:
                world_run.close()

    def world_replay(upto: int, rngs: list[Any]) -> WorldReplay:
        """Steps ``j+1..upto`` replayed in a gloo world of ``world`` ranks (rebuild_ddp)."""
        per_step = []
        for i in range(j + 1, upto + 1):
            micro, build = step_micro(i)
            if build is None:
                raise ConfigError(
                    f"rebuilding DDP step {i} needs every rank's batches from their recorded "
                    "sample indices: pass dataset= (and collate=) or batches= a callable from "
                    "indices, not a list of batches"
                )
            per_step.append([micro, *(rank_batches.of(i, r, build) for r in range(1, world))])
        return replay_world(kit, fn, per_step, rngs, warm=j >= 1)

    def step_micro(i: int) -> tuple[list[Any], Callable[[Any], Any] | None]:
        micro, _, build = _step_batches(run, i, timeline, maker, dataset, collate, kit.make_batch)
        return micro, build

    def replay_one(i: int, rngs: list[Any]) -> list[float]:
        micro, build = step_micro(i)
        if world == 1:
            return _one_step(kit, micro, fn)
        assert build is not None  # DDP over 2 ranks: every rank's micro-batches, averaged
        per_rank = [micro, *(rank_batches.of(i, r, build) for r in range(1, world))]
        return _ddp_step(kit, per_rank, fn, rngs)

    def check(i: int, losses: list[float], out: Rebuilt, report: bool) -> None:
        out.losses[i] = losses[-1] if losses else float("nan")
        if i in stored:
            return
        bits = light[i]
        if bits is None:
            out.unchecked.append(i)
        elif _matches(bits, losses, logged):
            out.checked.append(i)
        else:
            before = (
                f"It is the first step after stored step {j}"
                if i == j + 1
                else f"Steps {j + 1}..{i - 1} before it replayed faithfully"
            )
            raise ReplayError(
                f"rebuilding step {k} from stored step {j}: the chain broke at step {i}: "
                f"its replayed loss {losses[-1] if losses else None!r} differs from the "
                f"recorded loss {loss_of(bits)!r} ({bits}) (bit for bit). The step did not "
                "train as recorded: a wrong sample record, another loss_fn, a clipping or "
                "scheduler step not passed (before_step=, scheduler=), or nondeterministic "
                "kernels. "
                f"{before}; the live objects are now at step {i}"
            )
        if report and on_step is not None:
            on_step(i, out, kit)

    landed = None
    if check_next and k not in stored:
        m = min((s for s in stored if s > k), default=None)
        if m is not None and all(i in light for i in range(k + 1, m)):
            probe = Rebuilt(step=m, base=j)
            chain(m, probe)
            names = param_names(kit.model)
            miss = _compare(reader, stored[m], kit.model, kit.optimizer, names, {})
            if miss is not None:
                raise ReplayError(
                    f"rebuilding step {k} from stored step {j}: the light steps' losses "
                    f"replayed bit for bit, but the chain through them lands off stored step "
                    f"{m}: {miss}. Something the loss does not show differed (the optimizer "
                    "or scheduler, clipping, RNG drawn between steps)"
                )
            landed = m
    out = Rebuilt(step=k, base=j, landed=landed)
    chain(k, out, report=True)
    return out


def load_factory(spec: str, path: str | None = None) -> Callable[[], Any]:
    """``FILE.py:FUNCTION`` -> the function (the file imported as a module, its folder on
    ``sys.path`` so it can import its neighbours), as ``dstt replay --script`` takes it.
    ``path``: where the session that named it found the file (tried when ``FILE`` is not
    found from here). ``ConfigError`` naming what is wrong."""
    import importlib.util
    import os
    import sys

    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name:
        raise ConfigError(f"replay= takes FILE.py:FUNCTION (e.g. train.py:make), not {spec!r}")
    if not os.path.isfile(file) and path is not None and os.path.isfile(path):
        file = path
    if not os.path.isfile(file):
        raise ConfigError(f"replay={spec!r}: no file {file!r} (from {os.getcwd()})")
    folder = os.path.dirname(os.path.abspath(file))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_spec = importlib.util.spec_from_file_location("_dstt_replay_factory", file)
    if mod_spec is None or mod_spec.loader is None:
        raise ConfigError(f"replay={spec!r}: cannot import {file!r}")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"replay={spec!r}: {file!r} has no function {name!r}")
    out: Callable[[], Any] = fn
    return out


def rebuilt_commit(
    kit: ReplayKit, rebuilt: Rebuilt, base: CommitHeader, reader: Reader, metrics: Any = None
) -> tuple[Repository, CommitHeader]:
    """The live objects of ``kit`` (at step ``rebuilt.step``) as a *derived* commit in a
    repository of their own, in memory: the arrays and objects a stored step of that run
    would hold (the same providers, the same paths and dims as ``base``), plus
    :data:`REBUILT_OBJECT` saying it was rebuilt, from which stored step, and which losses
    were checked. Every view of a stored step reads it the same way (``Snapshot``); nothing
    is written to the run. ``metrics``: what the step logged."""
    from dstt.engine.tensors._convert import flat_bytes, store_dtype
    from dstt.store._internal import MemoryStorage, Repository

    state = discover(kit.model, kit.optimizer, scheduler=kit.scheduler)
    table = reader.arrays(base)
    repo = Repository.create(MemoryStorage())
    with repo.writer() as w:
        txn = w.begin(rebuilt.step)
        try:
            for provider in (state.step_state, state.boundary_state):
                for path, t in provider.tensors().items():
                    cpu = t.detach().to("cpu").contiguous()
                    rec = table.get(path)
                    plan = txn.declare(
                        path,
                        store_dtype(cpu.dtype),
                        tuple(cpu.shape),
                        None if rec is None else rec.dims,
                    )
                    flat = flat_bytes(cpu).numpy()
                    for i in range(plan.n_chunks):
                        start, stop = plan.byte_range(i)
                        txn.put_chunk(path, i, flat[start:stop])
                objects = dict(provider.objects())
                if rebuilt.rank_rng and schema.RNG_OBJECT in objects:  # DDP: each rank's own
                    del objects[schema.RNG_OBJECT]
                    for r, rng in sorted(rebuilt.rank_rng.items()):
                        objects[f"{schema.RNG_OBJECT}/r{r}"] = to_plain(rng)
                for name, obj in objects.items():
                    try:
                        txn.put_object(name, obj)
                    except TypeError:  # not plain data: as the engine stores it
                        txn.put_object(name, obj, encoding="pickle")
            txn.put_object(
                REBUILT_OBJECT,
                {
                    "step": rebuilt.step,
                    "base": rebuilt.base,
                    "checked": [i for i in rebuilt.checked if i <= rebuilt.step],
                    "unchecked": [i for i in rebuilt.unchecked if i <= rebuilt.step],
                },
            )
            header = txn.commit(metrics)
        except BaseException:
            txn.abort()
            raise
    return repo, header


def _one_step(kit: ReplayKit, micro: list[Any], loss_fn: LossFn) -> list[float]:
    """One optimizer step of the plain loop on ``micro``; each micro-batch's loss."""
    kit.model.train()
    for opt in optimizers_of(kit.optimizer).values():
        opt.zero_grad(set_to_none=True)
    losses = _backward(kit, micro, loss_fn)
    _optimizer_step(kit)
    return losses


def _ddp_step(
    kit: ReplayKit, per_rank: list[list[Any]], loss_fn: LossFn, rngs: list[Any]
) -> list[float]:
    """One optimizer step of a DDP run in one process: each rank's micro-batches on its own
    RNG state (``rngs[r]``, advanced in place), then what DDP's reducer hands the optimizer:
    each rank's gradient times ``1/world``, summed over the ranks (with two ranks, the sum of
    an allreduce in any order, bit for bit). Rank 0's micro-batch losses."""
    model = kit.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    world = len(per_rank)
    total: list[torch.Tensor | None] = [None] * len(params)
    first: list[float] = []
    for r, micro in enumerate(per_rank):
        set_rng(rngs[r])
        for p in params:
            p.grad = None
        losses = _backward(kit, micro, loss_fn)
        rngs[r] = get_rng()
        first = first if r else losses
        for n, p in enumerate(params):
            if p.grad is None:
                continue
            part = torch.mul(p.grad, 1.0 / world)  # as the reducer copies it into its bucket
            acc = total[n]
            total[n] = part if acc is None else acc + part
    for p, g in zip(params, total, strict=True):
        p.grad = g
    set_rng(rngs[0])  # the process goes on as rank 0
    _optimizer_step(kit)
    return first


class _RankBatches:
    """The micro-batches another rank of a DDP run trained on at a step: its recorded
    sample indices (``data/batches/r<rank>``, riding with the commit after the step)."""

    def __init__(self, run: Any, reader: Reader, timeline: str, world: int) -> None:
        self.run, self.reader, self.timeline, self.world = run, reader, timeline, world
        self._seen: dict[int, dict[int, list[Any]]] = {}

    def of(self, step: int, rank: int, build: Callable[[Any], Any]) -> list[Any]:
        got = self._recorded(rank).get(step)
        if not got or any(b.indices is None for b in got):
            raise ReplayError(
                f"rebuilding DDP step {step}: rank {rank}'s samples were not recorded by "
                f"sample index (no {schema.BATCHES_OBJECT}/r{rank} for it: a run captured "
                "before every rank recorded its batches, or a loop not drawing from "
                "s.data(loader) on every rank); store every step (every=1) to reach each one"
            )
        return [build(list(b.indices)) for b in got]

    def _recorded(self, rank: int) -> dict[int, list[Any]]:
        if rank not in self._seen:
            from dstt.store._internal import Batch

            name = f"{schema.BATCHES_OBJECT}/r{rank}"
            line = self.run.commits(self.timeline)
            out: dict[int, list[Any]] = {}
            for h in self.reader.carrying(line, name):
                if name in h.objects:
                    obj = self.reader.read_object(h, name)
                    for step, fps in zip(obj["steps"], obj["batches"], strict=True):
                        out[int(step)] = [Batch.from_plain(fp) for fp in fps]
            self._seen[rank] = out
        return self._seen[rank]


def _check_ddp(objects: Any, world: int, k: int, j: int) -> None:
    """Refuse, with the reason, a light step of a multi-rank run whose ranks each held a
    shard of the state (FSDP2, tensor or pipeline parallel, ZeRO): not rebuilt yet."""
    sharded = sorted(
        {
            n.partition("/r")[0]
            for n in objects
            if n.startswith((f"{schema.SHARDS_OBJECT}/", "zero/", "deepspeed/"))
            or n == schema.LAYOUT_OBJECT
        }
    )
    if sharded:
        raise ReplayError(
            f"light step {k} is of a run whose {world} ranks each held a shard of the state "
            f"(stored step {j} has {', '.join(sharded)}: FSDP2, tensor or pipeline parallel, "
            "or ZeRO); rebuilding its light steps is not supported yet (only DDP's, whose "
            f"ranks hold the same state). The stored steps open as usual (run.at({j})); "
            "store every step (every=1) to reach each one"
        )


def _ranks(objects: Any) -> int:
    """How many ranks wrote a commit: its per-rank objects are named ``<name>/r<rank>``."""
    ranks = {n.rpartition("/r")[2] for n in objects if "/r" in n}
    return max((int(r) + 1 for r in ranks if r.isdigit()), default=1)


def _gc_hint(pruned: list[int], k: int) -> str:
    """Why a light step may have lost its record or its base: gc pruned commits around it."""
    if not pruned:
        return ""
    around = [s for s in pruned if abs(s - k) <= 32][:8]
    return (
        f" (gc pruned stored steps {around or pruned[:8]} near it: a light step's record "
        "rides with the next stored commit and its rebuild starts from the one before, so "
        "pruning them strands it; keep them with Retention(keep_steps=...) or keep_last)"
    )


#: what ``dstt.open(run, replay={...})`` may hold: ``run.rebuild``'s objects and keywords
#: (those of :func:`rebuild_step` a caller passes, and a framework's ``trainer``/``module``)
REPLAY_KEYS: tuple[str, ...] = (
    "trainer",
    "module",
    *(
        name
        for name in inspect.signature(rebuild_step).parameters
        if name not in ("run", "reader", "step", "kit", "check_next", "timeline", "on_step")
    ),
)
