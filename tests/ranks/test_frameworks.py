"""The Hugging Face Trainer (DDP) and Lightning (``ddp``, ``ModelParallelStrategy`` with FSDP2)
on 2 real gloo ranks with ``DsttCallback`` (see ``conftest.py``): every optimizer step
committed once, and a resume through each framework's own resume path continues bit-exactly
on every rank (rank 0's losses and each rank's parameters and optimizer state against a fit
without dstt).
"""

from __future__ import annotations

from typing import Any

import pytest

import dstt

from .conftest import FRAMEWORK_CASES

pytestmark = pytest.mark.timeout(1200)


def _ok(results: dict[str, Any], tag: str) -> list[dict[str, Any]]:
    got = results[tag]
    for rank, r in enumerate(got):
        assert r["ok"], f"{tag} rank {rank}: {r.get('error')}\n{r.get('trace', '')}"
    return got


@pytest.mark.parametrize(("framework", "strategy", "steps"), FRAMEWORK_CASES)
def test_the_callback_commits_every_step_and_resumes_bit_exactly_on_every_rank(
    framework_results: dict[str, Any], framework: str, strategy: str, steps: int
) -> None:
    plain = _ok(framework_results, f"{framework}-{strategy}-plain")
    fresh = _ok(framework_results, f"{framework}-{strategy}-fresh")
    resumed = _ok(framework_results, f"{framework}-{strategy}-resume")
    half = steps // 2
    for rank in (0, 1):
        assert plain[rank]["world"] == 2
        ref = plain[rank]["losses"]
        assert fresh[rank]["losses"] == {k: v for k, v in ref.items() if int(k) <= half}
        assert resumed[rank]["start"] == half  # the framework continued its step count
        assert resumed[rank]["losses"] == {k: v for k, v in ref.items() if int(k) > half}
        assert resumed[rank]["hash"] == plain[rank]["hash"], rank  # params + optimizer state
    run = dstt.open(framework_results["root"] / f"{framework}-{strategy}")
    assert run.steps == list(range(1, steps + 1))  # every optimizer step, once
    if framework == "pl":  # each step's batch from each rank (hashed: a custom iterable)
        batches = run.batches()
        assert sorted(batches) == run.steps
        assert all(len(v) == 2 and all(b.hash for b in v) for v in batches.values())
