"""A state machine against the encoder's hardest case: several steps in flight at once, each
encoded against the newest copy of every chunk (committed or not), committed in order,
aborted at random, written raw or as keyframes on request — with Adam predictions. Whatever
the interleaving, every committed step must read back bit-exactly from a fresh reader, a
step must never commit on top of a base that did not, and the run must verify clean."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dstt.errors import DsttError
from dstt.store import Repository, load
from dstt.store.codec.xor import DeltaPolicy
from dstt.store.commit.transaction import Transaction
from dstt.store.storage.memory import MemoryStorage

from .._util import put_flat_arrays
from .test_predict import M, P, V, _Adam, _same


def _note(what: str) -> None:
    if currently_in_test_context():  # hypothesis statistics; the seeded runs below skip them
        event(what)


class InflightMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.storage = MemoryStorage()
        self.repo = Repository.create(self.storage)
        self.writer = self.repo.writer(
            encoding=DeltaPolicy(keyframe_every=5), chunk_bytes=4096, inflight_bases=True
        )
        self.adam = _Adam(0, shape=(40, 30))
        self.step = 0
        self.open: list[tuple[Transaction, dict[str, np.ndarray], bool]] = []  # txn, data, done
        self.committed: dict[int, dict[str, np.ndarray]] = {}

    def teardown(self) -> None:
        try:
            self.check_all()
        finally:
            self.writer.close()

    @precondition(lambda self: len(self.open) < 3)
    @rule(raw=st.booleans(), keyframe=st.booleans())
    def begin(self, raw: bool, keyframe: bool) -> None:
        self.step += 1
        arrays, preds = self.adam.step(), self.adam.predictions()
        txn = self.writer.begin(self.step)
        txn.encode = not raw
        txn.keyframe = keyframe and not raw
        txn.predict(preds)
        self.open.append((txn, arrays, False))

    @rule(i=st.integers(0, 2))
    def write(self, i: int) -> None:
        todo = [j for j, (_, _, done) in enumerate(self.open) if not done]
        if not todo:
            return
        j = todo[i % len(todo)]
        txn, arrays, _ = self.open[j]
        put_flat_arrays(txn, {n: arrays[n] for n in (P, M, V)})  # as the engine does
        self.open[j] = (txn, arrays, True)

    @rule()
    def commit_oldest(self) -> None:
        if not self.open or not self.open[0][2]:
            return
        txn, arrays, _ = self.open.pop(0)
        try:
            txn.commit()
        except DsttError as e:  # based on a step that was aborted: refused, never committed
            assert "did not commit" in str(e)
            _note("refused: its base did not commit")
            txn.abort()
            return
        _note("committed on an in-flight base" if txn.deps else "committed")
        self.committed[txn.step] = arrays

    @rule(i=st.integers(0, 2))
    def abort_one(self, i: int) -> None:
        if self.open:
            txn, _, done = self.open.pop(i % len(self.open))
            _note(f"aborted a step {'written' if done else 'not written'}")
            txn.abort()

    @invariant()
    def committed_steps_read_back_exactly(self) -> None:
        r = self.repo.reader()
        steps = [h.step for h in r.lineage()]
        assert steps == sorted(self.committed)
        for step in steps[-3:]:  # the newest ones: the deepest chains and in-flight bases
            got = load(self.storage, step).arrays
            for name in (M, V, P):
                assert _same(got[name], self.committed[step][name]), (step, name)
        for h in r.lineage():  # every base and input is a committed slot of this lineage
            line = {x.slot for x in r.lineage()}
            for rec in r.arrays(h).values():
                for c in rec.chunks:
                    assert set(c.slots) <= line

    def check_all(self) -> None:
        for step, arrays in self.committed.items():
            got = load(self.storage, step).arrays
            assert all(_same(got[n], a) for n, a in arrays.items()), step
        assert self.repo.verify().ok


InflightMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestInflightModel = InflightMachine.TestCase


def test_long_random_interleavings() -> None:
    """Hypothesis keeps its runs short; this drives the same machine through 12 seeded runs
    of 120 random operations, weighted towards beginning and writing steps while older ones
    are still open, so chains get deep and bases are often still in flight."""
    counts = {"committed": 0, "inflight": 0, "refused": 0}
    for seed in range(12):
        rnd = random.Random(seed)
        m = InflightMachine()
        try:
            for _ in range(120):
                op = rnd.choices(["begin", "write", "commit", "abort"], [4, 4, 2, 1])[0]
                if op == "begin" and len(m.open) < 3:
                    m.begin(raw=rnd.random() < 0.15, keyframe=rnd.random() < 0.1)
                elif op == "write":
                    m.write(rnd.randrange(3))
                elif op == "commit" and m.open and m.open[0][2]:
                    txn = m.open[0][0]
                    before = len(m.committed)
                    m.commit_oldest()
                    if len(m.committed) > before:
                        counts["committed"] += 1
                        counts["inflight"] += bool(txn.deps)
                    else:
                        counts["refused"] += 1
                elif op == "abort":
                    m.abort_one(rnd.randrange(3))
                m.committed_steps_read_back_exactly()
        finally:
            m.teardown()
    # the interesting cases did happen (seeded: deterministic)
    assert counts["committed"] >= 120
    assert counts["inflight"] >= 25
    assert counts["refused"] >= 10
