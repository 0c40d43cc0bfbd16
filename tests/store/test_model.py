"""Stateful property test: commit / rollback / switch / rename / delete / gc / power cuts
against a plain model.

The model is a few dicts: commits (id → step, value, parent, timeline), timelines (name → head
id), the current timeline and the set of pruned commits. Ids are the slots the store returned
for successful commits — the model decides on its own which commits a timeline sees, which a
gc prunes and what survives a power cut.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dstt.errors import CurrentTimelineError, StepNotFoundError, TimelineError
from dstt.store import Repository
from dstt.store.format.layout import HEAD_KEY, commit_key, ref_key
from dstt.store.storage.memory import MemoryStorage

from .commit.test_crash import CutAt, PowerCut, torn_crash


@dataclass(frozen=True)
class MCommit:
    step: int
    value: int
    parent: int | None
    timeline: str


def arrays_of(value: int) -> dict[str, np.ndarray]:
    return {
        "params/w": np.array([value, value + 0.5, -value], dtype=np.float32),
        "params/b": np.array([value, 1 - value], dtype=np.float32).astype(ml_dtypes.bfloat16),
    }


# a commit is 4 writes in format 2 (step file, side file, header, ref), a rollback 2, a
# switch 1, a gc one per tombstone and one per deleted file: small k hits them all
cuts = st.none() | st.tuples(st.integers(1, 6), st.booleans(), st.booleans())


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mem = MemoryStorage()
        Repository.create(self.mem)
        self.commits: dict[int, MCommit] = {}
        self.timelines: dict[str, int | None] = {"main": None}
        #: each rollback timeline's fork point (gc never prunes it)
        self.forks: dict[str, int] = {}
        self.current = "main"
        self.pruned: set[int] = set()
        self.rng = random.Random(0)

    # -- model helpers ---------------------------------------------------------------------
    def lineage(self, timeline: str) -> list[int]:
        out, c = [], self.timelines[timeline]
        while c is not None:
            out.append(c)
            c = self.commits[c].parent
        return out[::-1]

    def head_step(self, timeline: str) -> int:
        head = self.timelines[timeline]
        return -1 if head is None else self.commits[head].step

    def live(self) -> list[tuple[str, int]]:
        return [
            (tl, self.commits[c].step)
            for tl in sorted(self.timelines)
            for c in self.lineage(tl)
            if c not in self.pruned
        ]

    def run(self, op: Any, cut: tuple[int, bool, bool] | None) -> set[str] | None:
        """Run ``op(storage)``; with a cut, lose power at that write and keep the crashed store.

        Returns the keys whose write happened (``None``: no cut, everything happened).
        """
        if cut is None:
            op(self.mem)
            return None
        k, after, torn = cut
        wrapped = CutAt(self.mem, k, after=after)
        try:
            op(wrapped)
            done = set(wrapped.keys)
        except PowerCut:
            done = set(wrapped.keys[: k if after else k - 1])
        self.mem = torn_crash(self.mem, self.rng) if torn else self.mem.crash()
        return done

    # -- rules -------------------------------------------------------------------------------
    @rule(data=st.data(), value=st.integers(-1000, 1000), inc=st.integers(1, 3), cut=cuts)
    def commit(self, data: st.DataObject, value: int, inc: int, cut: Any) -> None:
        tl = data.draw(st.sampled_from(sorted(self.timelines)), label="timeline")
        step = self.head_step(tl) + inc
        result: dict[str, Any] = {}

        def op(storage: Any) -> None:
            with Repository(storage).writer(chunk_bytes=8) as w:
                txn = w.begin(step, timeline=tl)
                for path, a in arrays_of(value).items():
                    plan = txn.declare(
                        path, "float32" if a.dtype == np.float32 else "bfloat16", a.shape
                    )
                    flat = a.view(np.uint8)
                    for i in range(plan.n_chunks):
                        start, stop = plan.byte_range(i)
                        txn.put_chunk(path, i, flat[start:stop])
                txn.put_object("v", {"value": value, "t": (value, tl)})
                result["h"] = txn.commit({"value": value})

        done = self.run(op, cut)
        if done is not None and ref_key(tl) not in done:
            event("commit: power cut before the ref moved")
            return  # nothing is visible
        h = result.get("h")
        if h is None:  # the ref was written, then the power went: find the new head
            event("commit: power cut right after the ref moved")
            h = Repository(self.mem).reader().head(tl)
        assert h.step == step
        assert h.parent == self.timelines[tl]
        assert h.slot not in self.commits
        self.commits[h.slot] = MCommit(step, value, self.timelines[tl], tl)
        self.timelines[tl] = h.slot

    @precondition(lambda self: self.timelines[self.current] is not None)
    @rule(data=st.data())
    def commit_not_after_head_is_refused(self, data: st.DataObject) -> None:
        step = data.draw(st.integers(0, self.head_step(self.current)), label="step")
        with Repository(self.mem).writer() as w:
            txn = w.begin(step)
            with pytest.raises(ValueError, match="not after the head"):
                txn.commit()

    @precondition(lambda self: any(c not in self.pruned for c in self.commits))
    @rule(data=st.data(), cut=cuts)
    def rollback(self, data: st.DataObject, cut: Any) -> None:
        tl, step = data.draw(st.sampled_from(self.live()), label="rollback to")
        target = next(c for c in self.lineage(tl) if self.commits[c].step == step)
        default = f"{tl}-from-{step}"
        if default in self.timelines or len(default) > 64:
            # a second rollback to the same step (or a name too long): an error asking for a
            # name, and nothing written (no silent "-from-<step>.2")
            with pytest.raises(TimelineError, match="name"):
                Repository(self.mem).rollback(step, timeline=tl)
            event("rollback: default name taken")
            return
        result: dict[str, Any] = {}

        def op(storage: Any) -> None:
            result["ref"] = Repository(storage).rollback(step, timeline=tl)

        done = self.run(op, cut)
        if "ref" in result:
            name = result["ref"].name
        else:  # cut: a new ref, if written, is the one timeline the model does not know
            refs = set(Repository(self.mem).reader().timelines)
            new = refs - set(self.timelines)
            assert len(new) <= 1
            if not new:
                event("rollback: power cut before the ref")
                return
            name = new.pop()
            event("rollback: power cut after the ref")
        assert name not in self.timelines
        assert result.get("ref") is None or result["ref"].head == target
        self.timelines[name] = target
        self.forks[name] = target
        if done is None or HEAD_KEY in done:
            self.current = name

    @rule(data=st.data(), cut=cuts)
    def switch(self, data: st.DataObject, cut: Any) -> None:
        tl = data.draw(st.sampled_from(sorted(self.timelines)), label="switch to")
        done = self.run(lambda storage: Repository(storage).switch(tl), cut)
        if done is None or HEAD_KEY in done:
            self.current = tl

    @rule(data=st.data(), new=st.sampled_from(["a", "b", "main"]), cut=cuts)
    def rename(self, data: st.DataObject, new: str, cut: Any) -> None:
        old = data.draw(st.sampled_from(sorted(self.timelines)), label="rename")
        if new in self.timelines:
            r = Repository(self.mem).reader()
            if old == new or replace(r.ref(old), name=new) != r.ref(new):
                with pytest.raises(TimelineError):
                    Repository(self.mem).rename_timeline(old, new)
                return
            event("rename: finishing an interrupted one")  # new is old's twin: allowed
        done = self.run(lambda storage: Repository(storage).rename_timeline(old, new), cut)
        # in order: the new ref, HEAD (if it named old), the old ref's delete; a cut may stop
        # anywhere, leaving both names on the same head
        if done is None or ref_key(new) in done:
            self.timelines[new] = self.timelines[old]
            if old in self.forks:
                self.forks[new] = self.forks[old]
            if self.current == old and (done is None or HEAD_KEY in done):
                self.current = new
            if done is None or f"delete {ref_key(old)}" in done:
                del self.timelines[old]
                self.forks.pop(old, None)
        event(f"rename: {'whole' if done is None or old not in self.timelines else 'cut'}")

    @rule(data=st.data(), cut=cuts)
    def delete(self, data: st.DataObject, cut: Any) -> None:
        name = data.draw(st.sampled_from(sorted(self.timelines)), label="delete")
        if name == self.current:
            with pytest.raises(CurrentTimelineError):
                Repository(self.mem).delete_timeline(name)
            return
        done = self.run(lambda storage: Repository(storage).delete_timeline(name), cut)
        if done is None or f"delete {ref_key(name)}" in done:
            del self.timelines[name]
            self.forks.pop(name, None)
            # its own commits are gone for good (gc may hand their slots to new commits)
            reachable = {c for tl in self.timelines for c in self.lineage(tl)}
            self.commits = {c: m for c, m in self.commits.items() if c in reachable}
            self.pruned &= reachable
        event(f"delete: {'whole' if done is None else 'cut'}")

    @rule(
        keep_last=st.none() | st.integers(1, 4), keep_every=st.none() | st.integers(1, 5), cut=cuts
    )
    def gc(self, keep_last: int | None, keep_every: int | None, cut: Any) -> None:
        result: dict[str, Any] = {}

        def op(storage: Any) -> None:
            result["report"] = Repository(storage).gc(keep_last=keep_last, keep_every=keep_every)

        done = self.run(op, cut)
        newly: set[int] = set()
        if keep_last is not None or keep_every is not None:
            keep: set[int] = set()
            for tl, head in self.timelines.items():
                live = [c for c in self.lineage(tl) if c not in self.pruned]
                if keep_last:
                    keep |= set(live[max(0, len(live) - keep_last) :])
                if keep_every:
                    keep |= {c for c in live if self.commits[c].step % keep_every == 0}
                if head is not None:
                    keep.add(head)
            keep |= set(self.forks.values())  # fork points are never pruned
            reachable = {c for tl in self.timelines for c in self.lineage(tl)}
            newly = {c for c in reachable if c not in self.pruned and c not in keep}
        if done is not None and "report" not in result:
            # power cut: exactly the commits whose tombstone was written are pruned (gc
            # tombstones before it deletes anything, and deletes only what no live commit
            # reads, so every other commit must still read back whole)
            newly = {c for c in newly if commit_key(c) in done}
            # raw steps' tombstones are written, then made durable by one barrier: a cut
            # before it may lose any of them (each header is whole either way)
            r = Repository(self.mem).reader()
            newly = {c for c in newly if r.header(c).pruned}
            event(f"gc: power cut after {len(newly)} tombstones")
        else:
            event(f"gc pruned {'some' if newly else 'none'}")
            want = sorted((self.commits[c].timeline, self.commits[c].step) for c in newly)
            assert sorted(result["report"].pruned_steps) == want
        self.pruned |= newly

    @rule(torn=st.booleans())
    def crash_and_reopen(self, torn: bool) -> None:
        """Every finished operation was durable: a power cut now loses nothing."""
        self.mem = torn_crash(self.mem, self.rng) if torn else self.mem.crash()

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def matches_model(self) -> None:
        repo = Repository.open(self.mem)
        r = repo.reader()
        assert r.current_timeline == self.current
        assert set(r.timelines) == set(self.timelines)
        for tl in self.timelines:
            line = r.lineage(tl)
            model = self.lineage(tl)
            assert [h.slot for h in line] == model
            assert [(h.step, h.pruned) for h in line] == [
                (self.commits[c].step, c in self.pruned) for c in model
            ]
            if line:
                assert not line[-1].pruned  # heads are never pruned
            for h in line:
                c = self.commits[h.slot]
                if h.pruned:
                    with pytest.raises(StepNotFoundError, match="pruned"):
                        r.find(h.step, tl)
                    continue
                assert r.find(h.step, tl) == h
                for path, want in arrays_of(c.value).items():
                    assert r.read_array(h, path).tobytes() == want.tobytes()
                assert r.read_object(h, "v") == {"value": c.value, "t": (c.value, c.timeline)}
                assert h.metrics == {"value": c.value}
        rep = repo.verify()
        assert rep.ok, rep.problems


StoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreModel = StoreMachine.TestCase
