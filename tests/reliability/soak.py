"""Crash soak: a training process that checkpoints every step, killed at random moments.

Shared by ``bench/crash_soak.py`` and ``tests/reliability/test_crash_soak.py``. The **child**
(``python tests/reliability/soak.py child RUN STEPS SEED [delta]``; ``plain``: the reference,
without dstt) trains ``TinyGPT`` under ``dstt.session(..., resume=True)`` and prints
``start``, ``step``, ``committed`` and ``final`` lines; the **parent** (:func:`kill_once`)
SIGKILLs it at a random moment, then checks that ``dstt verify`` passes, nothing is lost, the
head and resume point are right, and every printed loss equals the uninterrupted run's.

A SIGKILL keeps the page cache, so this proves atomicity, ordering and resume, not durability
(``tests/store/commit/test_crash.py`` cuts the power at every write); protocol in
docs/decisions.md, figures in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import random

__all__ = ["KillOutcome", "Reference", "child_env", "kill_once", "reference", "run_child_to_end"]

#: kill moments the parent draws from: a time after spawn (import, restore, session start or
#: training), just after the ``start`` line (the first steps after a restore), shortly after a
#: random ``step`` line, or shortly after a ``committed`` line
MODES = ("time", "start", "step", "commit")


# -- child ------------------------------------------------------------------------------------


def _say(line: str) -> None:
    # one write per line: atomic on a pipe, from any thread; a parent that stopped reading
    # must never fail a commit because of a print
    with contextlib.suppress(OSError):
        os.write(1, (line + "\n").encode())


def _announcing_storage(path: str) -> Any:
    from dstt.store._internal import LocalStorage
    from dstt.store.format.layout import COMMITS_PREFIX, REFS_PREFIX
    from dstt.store.format.manifest import parse_header

    class Announcing(LocalStorage):
        """A real ``LocalStorage`` that prints ``committed <step>`` after each ref write."""

        last_step = -1

        def write(self, key: str, data: Any) -> None:
            super().write(key, data)
            self._seen(key, data)

        def write_durable(self, key: str, data: Any) -> None:
            super().write_durable(key, data)
            self._seen(key, data)

        def _seen(self, key: str, data: Any) -> None:
            # a ref is written (lazily synced by the session) once its step's files and
            # header are durable: from here a SIGKILL must not lose the step
            if key.startswith(COMMITS_PREFIX + "/"):
                raw = (
                    b"".join(bytes(p) for p in data)
                    if isinstance(data, list | tuple)
                    else bytes(data)
                )
                self.last_step = parse_header(raw, key).step
            elif key.startswith(REFS_PREFIX + "/") and self.last_step >= 0:
                _say(f"committed {self.last_step}")

    return Announcing(path, create=True)


def child_main(mode: str, run: str, steps: int, seed: int, delta: bool = False) -> None:
    import torch

    import dstt
    from dstt.testing.models import SyntheticBatches, TinyGPT

    torch.set_num_threads(1)  # bit-exact CPU math needs a fixed reduction order
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 8))
    batches = SyntheticBatches(steps, seed=seed)

    def loop(s: Any, data: Any) -> None:
        _say(f"start {s.step if s else 0}")
        for x, y in data:
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if s:
                s.log(loss=loss.item())
            _say(f"step {s.step if s else sched.last_epoch} {loss.item().hex()}")

    if mode == "plain":
        loop(None, batches)
    else:
        storage = _announcing_storage(run)
        # a small host cache: most tensors span several chunk files (more files to tear)
        with dstt.session(
            model,
            opt,
            run=storage,
            scheduler=sched,
            resume=True,
            budget_bytes=1 << 14,
            writers=2,
            encoding=dstt.DeltaPolicy(raw_when_busy=False) if delta else None,
        ) as s:
            loop(s, s.data(batches))
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    _say(f"final {h.hexdigest()}")


# -- parent -----------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # the repository: children import its dstt
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONHASHSEED"] = "0"
    return env


def _cmd(mode: str, run: Path | str, steps: int, seed: int, delta: bool) -> list[str]:
    cmd = [sys.executable, __file__, mode, str(run), str(steps), str(seed)]
    return [*cmd, "delta"] if delta else cmd


@dataclass
class _Parsed:
    start: int | None = None
    losses: dict[int, str] = field(default_factory=dict)
    committed: list[int] = field(default_factory=list)
    final: str | None = None


def _parse(lines: list[str]) -> _Parsed:
    p = _Parsed()
    for line in lines:
        kind, *rest = line.split()
        if kind == "start":
            p.start = int(rest[0])
        elif kind == "step":
            p.losses[int(rest[0])] = rest[1]
        elif kind == "committed":
            p.committed.append(int(rest[0]))
        elif kind == "final":
            p.final = rest[0]
    return p


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run (no dstt): loss of every step and the final parameter hash."""

    losses: dict[int, str]
    final: str


def _run_to_end(what: str, cmd: list[str]) -> _Parsed:
    """Run a child process to its end (no kill); what it printed."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed: {out.stderr[-2000:]}")
    return _parse(out.stdout.splitlines())


def reference(steps: int, seed: int) -> Reference:
    p = _run_to_end("reference run", _cmd("plain", "-", steps, seed, False))
    if sorted(p.losses) != list(range(1, steps + 1)) or p.final is None:
        raise RuntimeError(f"reference run printed {sorted(p.losses)[-3:]} / {p.final}")
    return Reference(p.losses, p.final)


@dataclass
class KillOutcome:
    """What one kill left behind, and every check that failed (``problems``)."""

    mode: str
    delta: bool
    start: int  # the head the child was started on (what it must restore)
    restored: int | None  # ``start`` line of the child (None: killed before it printed)
    trained_to: int  # highest step the child printed
    announced: int  # highest step announced as committed (``start`` if none)
    head: int  # the head after the kill
    completed: bool  # the child finished all steps before the kill could land
    verify_ok: bool
    checked_losses: int  # losses compared bit-for-bit with the reference
    seconds: float
    problems: list[str] = field(default_factory=list)

    @property
    def phase(self) -> str:
        if self.completed:
            return "completed"
        if self.restored is None:
            return "start-up"
        return "training" if self.trained_to > self.start else "restored"

    def as_json(self) -> dict[str, Any]:
        return {**self.__dict__, "phase": self.phase}


def _verify_cli(run: Path) -> tuple[bool, str]:
    out = subprocess.run(
        [sys.executable, "-m", "dstt.cli", "verify", "--run", str(run), "--json"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    try:
        doc = json.loads(out.stdout)
    except ValueError:
        return False, f"exit {out.returncode}: {out.stdout[-500:]} {out.stderr[-1500:]}"
    ok = out.returncode == 0 and doc.get("ok") is True
    return ok, "" if ok else json.dumps(doc.get("problems"))[:2000]


def _lineage_steps(run: Path) -> list[int]:
    from dstt.store._internal import Repository

    if not (run / "zarr.json").exists():  # killed before the run was created
        return []
    return [h.step for h in Repository.open(run).reader().lineage() if not h.pruned]


def kill_once(
    run: Path,
    ref: Reference,
    steps: int,
    seed: int,
    rng: random.Random,
    *,
    delta: bool = False,
    mode: str | None = None,
) -> KillOutcome:
    """Start a child on ``run`` (resuming its head), SIGKILL it at a random moment, check."""
    t0 = time.monotonic()
    start = (_lineage_steps(run) or [0])[-1]
    mode = mode or rng.choices(MODES, weights=(2, 1, 4, 3))[0]
    proc = subprocess.Popen(
        _cmd("child", run, steps, seed, delta),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = None
    if mode == "time":
        deadline = time.monotonic() + rng.uniform(0.2, 4.0)
    want_step = start + rng.randint(1, 12)
    try:
        if deadline is not None:
            time.sleep(max(0.0, deadline - time.monotonic()))
        else:
            for line in proc.stdout:
                lines.append(line)
                kind, *rest = line.split()
                if mode == "start" and kind == "start":
                    time.sleep(rng.uniform(0.0, 0.1))
                    break
                if (mode == "step" and kind == "step" and int(rest[0]) >= want_step) or (
                    mode == "commit" and kind == "committed" and int(rest[0]) >= want_step
                ):
                    time.sleep(rng.uniform(0.0, 0.04 if mode == "step" else 0.01))
                    break
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        rest_out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    lines += rest_out.splitlines()
    p = _parse(lines)
    completed = proc.returncode == 0
    problems: list[str] = []
    if not completed and proc.returncode != -signal.SIGKILL:
        problems.append(f"child exited {proc.returncode}: {err[-2000:]}")
    if p.start is not None and p.start != start:
        problems.append(f"restored step {p.start}, but the head before the child was {start}")
    checked = 0
    for k, loss in sorted(p.losses.items()):
        checked += 1
        if ref.losses.get(k) != loss:
            problems.append(f"step {k}: loss {loss} differs from the reference {ref.losses.get(k)}")
            break
    if p.committed != list(range(start + 1, start + 1 + len(p.committed))):
        problems.append(f"announced commits not consecutive after {start}: {p.committed[:20]}")
    announced = p.committed[-1] if p.committed else start
    trained_to = max(p.losses, default=start)
    verify_ok, why = _verify_cli(run) if (run / "zarr.json").exists() else (True, "")
    if not verify_ok:
        problems.append(f"dstt verify failed: {why}")
    try:
        lineage = _lineage_steps(run)
    except Exception as e:  # the run could not even be read: that is the finding
        problems.append(f"reading the lineage failed: {type(e).__name__}: {e}")
        lineage = []
    head = lineage[-1] if lineage else 0
    if head not in (announced, announced + 1):
        problems.append(
            f"head {head} is neither the last announced commit {announced} nor the one after it"
        )
    if lineage != list(range(1, head + 1)):
        problems.append(f"committed steps are not 1..{head}: {lineage[:10]}...{lineage[-10:]}")
    if head > trained_to:
        problems.append(f"head {head} is ahead of the last trained step {trained_to}")
    if completed:
        if p.final != ref.final:
            problems.append(f"final parameters {p.final} differ from the reference {ref.final}")
        if head != steps:
            problems.append(f"completed, but the head is {head}, not {steps}")
    return KillOutcome(
        mode,
        delta,
        start,
        p.start,
        trained_to,
        announced,
        head,
        completed,
        verify_ok,
        checked,
        time.monotonic() - t0,
        problems,
    )


def run_child_to_end(run: Path, steps: int, seed: int, *, delta: bool = False) -> str | None:
    """Resume ``run`` and train to the end without a kill; the final parameter hash."""
    return _run_to_end("child", _cmd("child", run, steps, seed, delta)).final


def main(argv: list[str]) -> None:
    mode, run, steps, seed = argv[0], argv[1], int(argv[2]), int(argv[3])
    child_main(mode, run, steps, seed, delta=len(argv) > 4 and argv[4] == "delta")


if __name__ == "__main__":
    main(sys.argv[1:])
