"""Rebuild a light step (``every="auto"``): restore the stored step before it, replay the rest.

A light step's tensors were never written (the engine was busy); its record is its sample
indices (``data/batches``) and its loss fingerprint (``light/steps``, :mod:`dstt.engine.light`).
:func:`rebuild_step` restores the nearest stored step *j* < *k* into the given live objects
(the providers a resume uses: model, optimizer state and hyperparameters, scheduler, RNG),
then re-executes steps *j+1..k* as the plain loop did — zero the gradients, forward/backward
on each recorded micro-batch, ``before_step()`` (clipping), ``optimizer.step()``, then
``scheduler.step()`` when a scheduler is given — and compares each step's recomputed loss
with its fingerprint **bit for bit** (the loss of its last micro-batch, or their sum or mean;
``logged=`` says how the loop derived what it logged). The first step that differs ends
the rebuild with a ``ReplayError`` naming it: that link of the chain is unfaithful (a wrong
sample record, another loss, clipping not passed, nondeterministic kernels), and so is every
step after it. A step that logged no loss cannot be checked; :class:`Rebuilt` lists those.
The live objects end at step *k* (or at the broken step); nothing is written to the run.

The pieces of one replayed step (the live objects, the batches from their indices, the loss)
are :mod:`dstt.inspect.replay`'s, so a rebuild and ``run.replay`` run a step the same way.
Rejected alternative: replaying from the *next* stored step backwards — optimizer steps do not
invert; and caching rebuilt steps as derived commits is left for later (the state is in the
caller's objects, and a second rebuild costs at most ``max_gap`` steps).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dstt import schema
from dstt.engine.light import loss_bits, step_loss
from dstt.engine.model_names import param_names
from dstt.engine.optimizers import optimizers_of
from dstt.engine.providers import StoreSource
from dstt.engine.torch_state import discover
from dstt.errors import ConfigError, ReplayError, StepNotFoundError

from .replay import LossFn, ReplayKit, _compare, _default_loss, _kit_of, _step_batches

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
            f"{timeline!r}; stored steps near it: {_near(stored, k)}{_gc_hint(pruned, k)}"
        )
    below = [s for s in stored if s <= k]
    if not below:
        raise ReplayError(
            f"no stored step at or before light step {k} on timeline {timeline!r}: a rebuild "
            f"starts from one{_gc_hint(pruned, k)}"
        )
    j = max(below)
    if j != k and _ranks(stored[j].objects) > 1:
        raise ReplayError(
            f"light step {k} is of a run of several ranks ({_ranks(stored[j].objects)} wrote "
            f"stored step {j}: DDP, FSDP2 or tensor parallel); rebuilding its light steps is "
            "not supported yet: a rebuild replays one process, and each rank's step trained "
            "on its own samples with gradients reduced across ranks. The stored steps open "
            f"as usual (run.at({j})); store every step (every=1) to reach each one"
        )
    gone = [i for i in range(j + 1, k + 1) if i not in light]
    if gone:
        raise ReplayError(
            f"rebuilding step {k} from stored step {j}: steps {gone} have no light record "
            "(pruned, or not taken on this timeline), so the chain cannot be replayed"
            f"{_gc_hint(pruned, k)}"
        )
    fn = loss_fn or _default_loss

    def chain(upto: int, out: Rebuilt, report: bool = False) -> None:
        """Restore step ``j`` into the live objects and replay ``j+1..upto``, checking each
        light step's loss; a stored step (``upto`` with ``check_next``) is not checked here."""
        state = discover(kit.model, kit.optimizer, scheduler=kit.scheduler)
        source = StoreSource(reader, stored[j], prefetch=True, trusted=trusted)
        state.step_state.restore(source)
        state.boundary_state.restore(source)
        for i in range(j + 1, upto + 1):
            micro, _, _ = _step_batches(
                run,
                i,
                timeline,
                batches if callable(batches) else None,
                dataset,
                collate,
                kit.make_batch,
            )
            losses = _one_step(kit, micro, fn)
            out.losses[i] = losses[-1] if losses else float("nan")
            if i in stored:
                continue
            bits = light[i]
            if bits is None:
                out.unchecked.append(i)
            elif _matches(bits, losses, logged):
                out.checked.append(i)
            else:
                raise ReplayError(
                    f"rebuilding step {k} from stored step {j}: the chain broke at step {i}: "
                    f"its replayed loss {losses[-1] if losses else None!r} differs from the "
                    f"recorded loss {_loss_text(bits)} (bit for bit). The step did not train as "
                    "recorded: a wrong sample record, another loss_fn, a clipping or scheduler "
                    "step not passed (before_step=, scheduler=), or nondeterministic kernels. "
                    f"{_before(j, i)}; the live objects are now at step {i}"
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
    from dstt.engine._convert import flat_bytes, store_dtype
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
                for name, obj in provider.objects().items():
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
    model = kit.model
    model.train()
    opts = optimizers_of(kit.optimizer).values()
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    losses: list[float] = []
    for b in micro:
        if kit.backward is not None:
            loss = kit.backward(b)
        else:
            loss = loss_fn(model, b)
            if loss.dim() > 0:
                loss = loss.mean()
            loss.backward()
        losses.append(float(loss.detach().float().mean()))
    if kit.before_step is not None:
        kit.before_step()
    for opt in opts:
        opt.step()
    if kit.scheduler is not None:
        kit.scheduler.step()
    return losses


def _ranks(objects: Any) -> int:
    """How many ranks wrote a commit: its per-rank objects are named ``<name>/r<rank>``."""
    ranks = {n.rpartition("/r")[2] for n in objects if "/r" in n}
    return max((int(r) + 1 for r in ranks if r.isdigit()), default=1)


def _before(j: int, i: int) -> str:
    """What replayed faithfully before the broken step ``i`` of a chain from stored ``j``."""
    if i == j + 1:
        return f"It is the first step after stored step {j}"
    return f"Steps {j + 1}..{i - 1} before it replayed faithfully"


def _loss_text(bits: str) -> str:
    from dstt.engine.light import loss_of

    return f"{loss_of(bits)!r} ({bits})"


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


def _near(stored: dict[int, Any], k: int) -> list[int]:
    return sorted(stored, key=lambda s: (abs(s - k), s))[:4]


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
