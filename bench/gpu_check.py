"""The CUDA path, checked in one run on a machine with one GPU (issue 32).

Everything lazy capture promises on a GPU — copies on a side CUDA stream into pinned host
buffers, overlapping the next forward/backward, blocking only before the optimizer update — is
measured here, in one script that fits ~8 minutes of wall time:

1. **preflight**: which of dstt's dependencies (``pyproject.toml``) fail to import, printed as
   the exact ``pip download`` line to bring them as wheels (exit code 2 when any is missing);
2. **the GPU tests**: ``pytest -m gpu`` on every test file that carries the marker; the
   summary is printed, the whole output kept in ``<out>/pytest.txt``;
3. **the capture benchmark** on Llama-style models built from configs
   (``dstt.testing.llama``: ~134 M parameters and ~1.1 B, random init, AdamW, bf16 autocast):
   ``none`` / ``dstt`` / ``torch_save`` / ``dcp`` (``torch.distributed.checkpoint.async_save``)
   in the same run, interleaved in rounds (the mode order rotated by one per round), at 125M
   with a checkpoint every iteration and at 1B every 10 iterations and every iteration, with
   ``dstt.Retention`` keeping the disk bounded;
4. **a bit-exact resume on the device**: 3 captured steps, a differently seeded model resumed
   from them compared bit for bit (parameters, AdamW state, scheduler), then one more step on
   both (math attention, deterministic kernels) compared again — beside a control, the same
   step taken twice from the same state, which says whether the kernels are deterministic;
5. everything as JSON (``<out>/gpu_check.json``, rewritten after every stage so a run cut
   short keeps what it measured) and one table on stdout.

What each mode does per iteration (an iteration is one optimizer step of ``accum`` micro-batches):

* ``none``       nothing: every ratio's baseline;
* ``dstt``       ``dstt.session(model, opt, run=..., every=N, budget_bytes=2 x state + margin,
                 retention=Retention(keep_last=K, every_commits=1))``: the budget lets the whole
                 step take the flat lane (one batched side-stream copy into a pinned ring of
                 two step buffers); blocked time is ``StepMetrics.blocked_s`` and, stricter,
                 the wall time spent inside dstt's optimizer hooks (measured by hooks
                 registered before and after the session's);
* ``torch_save`` ``torch.save({"model", "optim"})`` to a tmp file, fsync, rename, directory
                 fsync, on the training thread (blocked: all of it);
* ``dcp``        ``dcp.async_save`` on a one-rank process group (``cuda:nccl,cpu:gloo`` on the
                 GPU, falling back to ``gloo``; ``gloo`` on the CPU), with DCP's best staging
                 where the installed torch has it (``DefaultStager``: pinned memory, async
                 staging on its own stream, non-blocking copies; else
                 ``FileSystemWriter(cache_staged_state_dict=True)``), two folders alternating;
                 as DCP's docs do, the previous save's future is awaited before the next save
                 and its staging before the next optimizer step (blocked: those waits plus the
                 ``async_save`` call). The group exists only during this mode: with a group
                 initialized ``dstt.session`` would take the distributed path.

Timing: each iteration is bracketed by a synchronize of the *compute* stream
(``torch.cuda.current_stream().synchronize()``), not ``torch.cuda.synchronize()``: a
device-wide sync would also wait for the copies dstt and DCP run on their own streams and so
charge every iteration the copy they overlap — the thing being measured. ``s/iter`` is the
mean over the timed iterations (a mean, so every-10 runs count their checkpoint iterations);
the final drain (session close, last future) is reported apart. The warmup is ``every + 1``
iterations so the first checkpoint's one-off setup (buffers allocated and pinned, the
flusher started) and its wait are never timed. Ratios are medians of per-round ratios to the
same round's ``none``. Memory: host RSS peak during the mode minus RSS before it (the dstt
flusher's RSS apart; its shared buffers are mapped in both), GPU
``max_memory_allocated`` above the mode's start, and its excess over ``none``'s peak.

Iteration size: where the disk cannot write a checkpoint within an iteration, every engine
waits for the disk and the ratio measures the disk, not the overlap. So ``accum`` is chosen
from the measured disk bandwidth: iteration >= 1.3 x (state bytes / disk bandwidth) /
``target_every`` (125M: every 1; 1B: every 10), capped so each part fits its share of the
time; ``disk_binds`` in the JSON says where the cap won and the disk still binds (the 1B
every-iteration part always: it shows the honest stall). Rejected alternative: one fixed
batch for every machine — on most disks the 1.6 GB of state per step of the 125M model
cannot be written in the ~50 ms of one micro-batch, so every engine would measure the disk.

Time budget (``--budget-s``, default 450 s from the start): the benchmark is a schedule of
rounds by priority (125M rounds 1-2 and the resume check first, then 1B every 10, 1B every 1,
a third 125M round, a second 1B every-10 round); a round starts only if its estimate (from
the last round of the same part, else from the disk and calibration) plus the estimates of
the more important rounds after it fits the time left; skipped rounds are noted. Run
directories live in one temp folder (``--work``), removed at the end.

``--dry``: the same script on the CPU with tiny models (a few iterations per mode, every mode,
retention, the resume check, the pytest part pointed at the same selection, which skips
without CUDA), for the test suite (``tests/bench/test_gpu_check.py``).

    PYTHONUNBUFFERED=1 python bench/gpu_check.py --out $OUT 2>&1 | tee $OUT/log
    python bench/gpu_check.py --dry --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the repository's dstt, run from anywhere
    sys.path.insert(0, str(ROOT))
MODES = ("none", "dstt", "torch_save", "dcp")
GiB = 1024**3
MiB = 1024**2
HEADROOM = 1.3  # iteration >= HEADROOM x disk time per checkpoint, where the cap allows


# -- what runs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A model to train: its config (a preset of ``dstt.testing.llama`` or keyword arguments),
    micro-batch rows, the checkpoint interval its iteration is sized for, and the longest
    iteration its share of the time allows."""

    name: str
    config: str | dict[str, Any]
    batch: int
    target_every: int
    max_iter_s: float


@dataclass(frozen=True)
class Part:
    """One benchmark configuration: a model, a checkpoint interval, iterations per mode."""

    name: str
    model: str
    every: int
    iters: int  # timed, a multiple of every
    keep_last: int  # dstt retention

    @property
    def warmup(self) -> int:  # the first checkpoint and its wait stay untimed
        return self.every + 1


@dataclass(frozen=True)
class Slot:
    """One entry of the schedule: a round of a part, or the resume check; lower priority
    numbers are more important (a slot starts only if it leaves time for the later slots
    as important as it or more)."""

    part: str  # a part's name, or "resume"
    round: int
    priority: int


@dataclass(frozen=True)
class Plan:
    models: dict[str, ModelSpec]
    parts: dict[str, Part]
    schedule: tuple[Slot, ...]
    threshold_part: str  # where the issue's targets are checked
    resume_model: str
    disk_probe_bytes: int


FULL = Plan(
    models={
        "125M": ModelSpec("125M", "LLAMA_125M", batch=8, target_every=1, max_iter_s=1.5),
        "1B": ModelSpec("1B", "LLAMA_1B", batch=4, target_every=10, max_iter_s=1.0),
    },
    parts={
        "125M/every1": Part("125M/every1", "125M", every=1, iters=5, keep_last=2),
        "1B/every10": Part("1B/every10", "1B", every=10, iters=10, keep_last=1),
        "1B/every1": Part("1B/every1", "1B", every=1, iters=2, keep_last=1),
    },
    schedule=(
        Slot("125M/every1", 0, 0),
        Slot("125M/every1", 1, 1),
        Slot("125M/every1", 2, 4),
        Slot("resume", 0, 0),
        Slot("1B/every10", 0, 2),
        Slot("1B/every1", 0, 3),
        Slot("1B/every10", 1, 5),
    ),
    threshold_part="125M/every1",
    resume_model="125M",
    disk_probe_bytes=GiB,
)

_TINY = dict(vocab=256, d=64, layers=2, heads=4, kv_heads=4, ffn=128, seq=32)
_TINY_LARGE = dict(vocab=256, d=96, layers=3, heads=4, kv_heads=2, ffn=192, seq=32)
DRY = Plan(
    models={
        "tiny": ModelSpec("tiny", _TINY, batch=2, target_every=1, max_iter_s=0.05),
        "tiny-large": ModelSpec(
            "tiny-large", _TINY_LARGE, batch=2, target_every=2, max_iter_s=0.05
        ),
    },
    parts={
        "tiny/every1": Part("tiny/every1", "tiny", every=1, iters=3, keep_last=2),
        "tiny-large/every2": Part("tiny-large/every2", "tiny-large", every=2, iters=2, keep_last=2),
        "tiny-large/every1": Part("tiny-large/every1", "tiny-large", every=1, iters=2, keep_last=1),
    },
    schedule=(
        Slot("tiny/every1", 0, 0),
        Slot("tiny/every1", 1, 1),
        Slot("resume", 0, 0),
        Slot("tiny-large/every2", 0, 2),
        Slot("tiny-large/every1", 0, 3),
    ),
    threshold_part="tiny/every1",
    resume_model="tiny",
    disk_probe_bytes=16 * MiB,
)


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def log(msg: str) -> None:
    print(msg, flush=True)


# -- 1. preflight ---------------------------------------------------------------------------
def _requirements() -> tuple[list[str], list[str]]:
    """dstt's dependencies and the test tools the pytest part needs, from pyproject.toml."""
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = [
        r
        for r in proj["optional-dependencies"]["dev"]
        if re.match(r"pytest\b|pytest-timeout\b|psutil\b", r)
    ]
    return list(proj["dependencies"]), dev


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def check_requirement(req: str) -> str | None:
    """None when ``req`` is importable at its minimum version, else why not."""
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)  # type: ignore[union-attr]
    module = name.replace("-", "_").lower()
    if importlib.util.find_spec(module) is None:
        return "missing"
    low = re.search(r">=\s*([0-9][0-9.]*)", req)
    if low:
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None  # importable without metadata (a source tree): trust it
        if _version_tuple(have) < _version_tuple(low.group(1)):
            return f"too old ({have})"
    return None


def preflight() -> dict[str, Any]:
    deps, dev = _requirements()
    problems = {r: why for r in deps if (why := check_requirement(r)) is not None}
    test_problems = {r: why for r in dev if (why := check_requirement(r)) is not None}
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "problems": problems,
        "test_tool_problems": test_problems,
    }
    if not problems:
        try:
            importlib.import_module("dstt")
        except Exception as e:  # a broken install: say which
            out["import_dstt_error"] = f"{type(e).__name__}: {e}"
    need = [r for r in list(problems) + list(test_problems) if not r.startswith("torch")]
    if need:
        py = ".".join(platform.python_version_tuple()[:2])
        quoted = " ".join(f"'{r}'" for r in need)
        out["pip_download"] = (
            f"pip download --dest wheels --only-binary=:all: "
            f"--python-version {py} --platform manylinux_2_17_"
            f"{platform.machine()} {quoted}"
        )
        out["pip_install"] = f"python -m pip install --no-index --find-links wheels {quoted}"
    return out


def print_preflight(pre: dict[str, Any]) -> None:
    for r, why in {**pre["problems"], **pre["test_tool_problems"]}.items():
        log(f"preflight: {r}: {why}")
    if "import_dstt_error" in pre:
        log(f"preflight: import dstt failed: {pre['import_dstt_error']}")
    if "pip_download" in pre:
        log("preflight: bring these as wheels (their dependencies come along):")
        log(f"  {pre['pip_download']}")
        log(f"  then on the device: {pre['pip_install']}")


# -- small measurements ---------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss(pid: int | str = "self") -> int:
    """Resident bytes of a process (Linux /proc; psutil elsewhere; 0 if neither)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        try:
            import psutil

            return int(psutil.Process(None if pid == "self" else int(pid)).memory_info().rss)
        except Exception:
            return 0


def children_rss() -> int:
    """Resident bytes of this process's children (dstt's flusher, DCP helpers)."""
    me, total = os.getpid(), 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me:
                total += rss(entry.name)
    return total


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (from /proc/mounts; "" if unknown)."""
    best, kind, where = "", "", str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3 or len(parts[1]) <= len(best):
                continue
            if where == parts[1] or where.startswith(parts[1].rstrip("/") + "/"):
                best, kind = parts[1], parts[2]
    return kind


def default_work() -> str:
    """The system temp folder or the repository's parent, whichever has more free disk;
    never a RAM filesystem when the other is not (a tmpfs "disk" would measure memory)."""
    cands = [Path(tempfile.gettempdir()), ROOT.parent]
    ram = ("tmpfs", "ramfs")
    return str(max(cands, key=lambda p: (filesystem(p) not in ram, shutil.disk_usage(p).free)))


def tree_bytes(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    n = size = 0
    for p in path.rglob("*") if path.exists() else ():
        if p.is_file():
            n += 1
            size += p.stat().st_size
    return n, size


class Device:
    """The device the check trains on, and the measurements that depend on it."""

    def __init__(self, torch_mod: Any, cuda: bool) -> None:
        self.torch = torch_mod
        self.cuda = cuda
        self.device = torch_mod.device("cuda" if cuda else "cpu")
        self._base = 0

    def sync(self) -> None:
        """Wait for the compute stream only (see the module docstring)."""
        if self.cuda:
            self.torch.cuda.current_stream().synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self._base = self.torch.cuda.memory_allocated()

    def peak_over_base(self) -> int | None:
        return self.torch.cuda.max_memory_allocated() - self._base if self.cuda else None

    def cleanup(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
            empty_host = getattr(self.torch._C, "_host_emptyCache", None)  # pinned blocks
            if empty_host is not None:
                with contextlib.suppress(Exception):
                    empty_host()


# -- the model in training ------------------------------------------------------------------
def llama_config(spec: ModelSpec) -> Any:
    from dstt.testing import llama

    return (
        getattr(llama, spec.config)
        if isinstance(spec.config, str)
        else llama.LlamaConfig(**spec.config)
    )


class Trainer:
    """A Llama-style model + AdamW + a few pre-built batches on the device; one ``fwd_bwd``
    runs ``accum`` micro-batches under bf16 autocast."""

    def __init__(self, spec: ModelSpec, dev: Device, seed: int = 0, accum: int = 1) -> None:
        torch = dev.torch
        from dstt.testing.llama import TinyLlama

        self.spec, self.dev, self.accum = spec, dev, accum
        self.cfg = llama_config(spec)
        torch.manual_seed(seed)
        with dev.device:
            self.model = TinyLlama(self.cfg)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1
        )
        g = torch.Generator(device=dev.device).manual_seed(1000 + seed)
        self.batches = [
            torch.randint(
                self.cfg.vocab, (spec.batch, self.cfg.seq + 1), generator=g, device=dev.device
            )
            for _ in range(4)
        ]
        self.i = 0
        self.params = sum(p.numel() for p in self.model.parameters())

    def micro(self, tokens: Any) -> None:
        torch = self.dev.torch
        with torch.autocast(self.dev.device.type, dtype=torch.bfloat16):
            _, loss = self.model(tokens[:, :-1], tokens[:, 1:])
        (loss / self.accum).backward()

    def fwd_bwd(self) -> None:
        for _ in range(self.accum):
            self.micro(self.batches[self.i % len(self.batches)])
            self.i += 1

    def opt_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def state_bytes(self) -> int:
        torch = self.dev.torch
        seen: set[int] = set()
        n = 0
        tensors = list(self.model.state_dict().values())
        for st in self.opt.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                n += t.numel() * t.element_size()
        return n

    def calibrate(self) -> tuple[float, float]:
        """(seconds per micro-batch, seconds per optimizer step), after a warm-up that also
        creates the AdamW state."""
        acc, self.accum = self.accum, 1
        for _ in range(2):
            self.fwd_bwd()
            self.opt_step()
        micro, opt = [], []
        for _ in range(3):
            self.dev.sync()
            t = time.perf_counter()
            self.fwd_bwd()
            self.dev.sync()
            t1 = time.perf_counter()
            self.opt_step()
            self.dev.sync()
            micro.append(t1 - t)
            opt.append(time.perf_counter() - t1)
        self.accum = acc
        return med(micro), med(opt)


def choose_accum(spec: ModelSpec, micro_s: float, opt_s: float, disk_s: float) -> int:
    """Micro-batches per iteration: enough for the disk to keep up at ``target_every``,
    within ``max_iter_s``."""
    want = HEADROOM * disk_s / spec.target_every
    need = math.ceil(max(0.0, want - opt_s) / max(micro_s, 1e-6))
    cap = max(1, math.floor(max(0.0, spec.max_iter_s - opt_s) / max(micro_s, 1e-6)))
    return max(1, min(need, cap))


# -- the modes ------------------------------------------------------------------------------
class Checkpointer:
    """What one mode does around an iteration; ``blocked_s`` sums the training thread's
    waits inside the timed window."""

    name = "none"

    def __init__(self, tr: Trainer, part: Part, path: Path, ctx: dict[str, Any]) -> None:
        self.tr, self.part, self.path, self.ctx = tr, part, path, ctx
        self.count = 0  # optimizer steps taken in this mode
        self.timing = False
        self.blocked: list[float] = []

    def start(self) -> None:
        pass

    def before_opt(self) -> float:
        return 0.0

    def after_opt(self) -> float:
        return 0.0

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def report(self) -> dict[str, Any]:
        return {}

    def due(self) -> bool:
        return self.count % self.part.every == 0


class TorchSave(Checkpointer):
    name = "torch_save"

    def after_opt(self) -> float:
        if not self.due():
            return 0.0
        from dstt.store.storage.posix import fsync_dir

        t = time.perf_counter()
        self.path.mkdir(parents=True, exist_ok=True)
        tmp, final = self.path / "ckpt.pt.tmp", self.path / "ckpt.pt"
        with open(tmp, "wb") as f:
            self.tr.dev.torch.save(self.tr.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(self.path)
        return time.perf_counter() - t

    def report(self) -> dict[str, Any]:
        final = self.path / "ckpt.pt"
        return {"ckpt_bytes": final.stat().st_size if final.exists() else None}

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def plain(obj: Any) -> Any:
    """``obj`` with every mapping a ``dict`` (a module's ``state_dict`` is an ``OrderedDict``):
    torch 2.11's DCP staging deep-copies other containers through ``__reduce_ex__`` and then
    fails on the class in the reduction (``KeyError: <class 'type'>``; seen on the H200)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


@contextlib.contextmanager
def one_rank_group(work: Path, cuda: bool) -> Iterator[tuple[Any, str]]:
    """A one-process group for DCP's collectives, destroyed on exit."""
    import torch.distributed as dist

    def init(backend: str) -> None:
        store = dist.FileStore(str(work / f"pg-{time.monotonic_ns()}"), 1)
        dist.init_process_group(
            backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
        )

    backend = "cuda:nccl,cpu:gloo" if cuda else "gloo"
    try:
        init(backend)
        if cuda:
            dist.barrier()  # NCCL starts here, not inside the first save
    except Exception as e:  # no NCCL here: the tensors never cross a one-rank group anyway
        log(f"  dcp: {backend} failed ({type(e).__name__}: {e}); using gloo")
        if dist.is_initialized():
            dist.destroy_process_group()
        backend = "gloo"
        init(backend)
    try:
        yield dist.group.WORLD, backend
    finally:
        dist.destroy_process_group()


class Dcp(Checkpointer):
    name = "dcp"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._stack = contextlib.ExitStack()
        self.stager: Any = None
        self.staging: Any = None
        self.upload: Any = None
        self.n = 0
        self.variant = self.backend = ""

    def start(self) -> None:
        self.pg, self.backend = self._stack.enter_context(
            one_rank_group(self.ctx["work"], self.tr.dev.cuda)
        )
        cuda = self.tr.dev.cuda
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
            self.variant = (
                "DefaultStager(pinned, async staging, non-blocking)"
                if cuda
                else "DefaultStager(async staging)"
            )
        except (ImportError, TypeError, AssertionError, AttributeError):
            self.variant = (
                "FileSystemWriter(cache_staged_state_dict=True)" if cuda else "FileSystemWriter"
            )

    def _writer(self, d: Path) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        if self.stager is None and self.tr.dev.cuda:
            with contextlib.suppress(TypeError):
                return FileSystemWriter(d, sync_files=True, cache_staged_state_dict=True)
        return FileSystemWriter(d, sync_files=True)

    def before_opt(self) -> float:  # the last save's staging must finish before the update
        if self.staging is None:
            return 0.0
        t = time.perf_counter()
        self.staging.result()
        self.staging = None
        return time.perf_counter() - t

    def after_opt(self) -> float:
        if not self.due():
            return 0.0
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        if self.upload is not None:
            self.upload.result()
        d = self.path / f"c{self.n % 2}"
        self.n += 1
        shutil.rmtree(d, ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw: dict[str, Any] = {"storage_writer": self._writer(d), "process_group": self.pg}
            if self.stager is not None:
                kw["async_stager"] = self.stager
            resp = dcp.async_save(plain(self.tr.state_dict()), **kw)
        if hasattr(resp, "upload_completion"):
            self.staging, self.upload = resp.staging_completion, resp.upload_completion
        else:
            self.staging, self.upload = None, resp
        return time.perf_counter() - t

    def drain(self) -> None:
        if self.staging is not None:
            self.staging.result()
        if self.upload is not None:
            self.upload.result()

    def report(self) -> dict[str, Any]:
        last = self.path / f"c{(self.n - 1) % 2}"
        return {
            "ckpt_bytes": tree_bytes(last)[1] if self.n else None,
            "variant": self.variant,
            "backend": self.backend,
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drain()
        if self.stager is not None:
            with contextlib.suppress(Exception):
                self.stager.close()
        self._stack.close()
        shutil.rmtree(self.path, ignore_errors=True)


class Dstt(Checkpointer):
    name = "dstt"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._t: dict[str, float] = {}
        self.hooks_s: list[float] = []
        self._handles: list[Any] = []
        self._facts_at_close: dict[str, Any] = {}
        self.s: Any = None
        self.budget = 0

    def start(self) -> None:
        import dstt

        opt = self.tr.opt

        def mark(key: str) -> Callable[..., None]:
            return lambda *_: self._t.__setitem__(key, time.perf_counter())

        # hooks run in registration order: these bracket dstt's own
        self._handles = [
            opt.register_step_pre_hook(mark("pre0")),
            opt.register_step_post_hook(mark("post0")),
        ]
        state = self.tr.state_bytes()
        self.budget = 2 * state + max(64 * MiB, state // 20)
        retention = dstt.Retention(keep_last=self.part.keep_last, every_commits=1)
        self.s = dstt.session(
            self.tr.model,
            opt,
            run=self.path,
            every=self.part.every,
            budget_bytes=self.budget,
            retention=retention,
        )
        self.s.start()
        self._handles += [
            opt.register_step_pre_hook(mark("pre1")),
            opt.register_step_post_hook(mark("post1")),
        ]

    def after_opt(self) -> float:
        t = self._t
        if self.timing:
            self.hooks_s.append(t["pre1"] - t["pre0"] + t["post1"] - t["post0"])
        return 0.0  # dstt's own waits are in its metrics (report)

    def drain(self) -> None:
        self._facts_at_close = self._facts()
        self.s.close()

    def _facts(self) -> dict[str, Any]:
        pipe = getattr(self.s, "_pipeline", None)
        steps = getattr(pipe, "steps", None)
        cache = getattr(pipe, "cache", None)
        buffers = steps if steps is not None else cache
        return {
            "lane": "flat" if steps is not None else "chunk",
            "pinned": bool(getattr(buffers, "pinned", False)),
            "host_buffer_bytes": getattr(buffers, "capacity", 0),
            "flusher": getattr(getattr(pipe, "sink", None), "flusher", None) is not None,
        }

    def report(self) -> dict[str, Any]:
        w, n = self.part.warmup, self.part.iters
        ms = {m.step: m for m in self.s.metrics}
        # step k's copy is waited for at step k + 1: the window's waits are steps w .. w+n-1
        window = [ms[k] for k in range(w, w + n) if k in ms]
        # the steps captured for their interval (not the last one, which close captures)
        captured = [ms[k] for k in range(w + 1, w + n + 1) if k in ms and k % self.part.every == 0]
        files = len(list((self.path / "steps").rglob("*.zip")))  # one per kept step
        size = tree_bytes(self.path)[1]
        return {
            "blocked_s": sum(m.blocked_s for m in window),
            "hooks_s_per_iter": med(self.hooks_s),
            "hooks_s": sum(self.hooks_s),
            "ckpt_bytes": max((m.written_bytes for m in captured if m.committed), default=None),
            "state_bytes": med([m.bytes for m in captured]),
            "copy_s": med([m.copy_s for m in captured]),
            "flush_s": med([m.flush_s for m in captured]),
            "stall_s": sum(m.stall_s for m in captured),
            "budget_bytes": self.budget,
            "backlog_max": max((m.backlog for m in captured), default=0),
            "committed": sum(1 for m in captured if m.committed),
            "errors": [m.error for m in self.s.metrics if m.error][:3],
            "step_files_at_end": files,
            "run_bytes_at_end": size,
            "retention_pruned": sum(len(r.pruned_steps) for r, _ in self.s.retention_runs),
            **self._facts_at_close,
        }

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.s is not None:
            with contextlib.suppress(Exception):
                self.s.close()  # a no-op once drained
        shutil.rmtree(self.path, ignore_errors=True)


CHECKPOINTERS: dict[str, type[Checkpointer]] = {
    "none": Checkpointer,
    "dstt": Dstt,
    "torch_save": TorchSave,
    "dcp": Dcp,
}


def disk_checkpoints(mode: str, part: Part) -> int:
    """Checkpoints a mode holds on disk at most: torch.save its file and the next one's tmp,
    DCP two folders, dstt the kept steps (the head among them) plus one being written (two
    at every step: the flusher writes two steps at once)."""
    if mode == "dstt":
        return max(1, part.keep_last) + (2 if part.every == 1 else 1)
    return {"none": 0, "torch_save": 2, "dcp": 2}[mode]


def run_mode(mode: str, tr: Trainer, part: Part, path: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """``part.warmup`` untimed and ``part.iters`` timed iterations of ``mode``."""
    dev = tr.dev
    need = disk_checkpoints(mode, part) * ctx["state_bytes"]
    free = shutil.disk_usage(ctx["work"]).free
    if need and free < need + GiB:
        return {"skipped": f"needs ~{need / 1e9:.1f} GB of disk, {free / 1e9:.1f} GB free"}
    ck = CHECKPOINTERS[mode](tr, part, path, ctx)
    dev.cleanup()
    rss0 = rss()
    dev.reset_peak()
    iters: list[float] = []
    blocked = 0.0
    peak = rss0
    try:
        ck.start()
        for k in range(1, part.warmup + part.iters + 1):
            ck.timing = k > part.warmup
            dev.sync()
            t = time.perf_counter()
            tr.fwd_bwd()
            b = ck.before_opt()
            tr.opt.step()
            ck.count += 1
            tr.opt.zero_grad(set_to_none=True)
            b += ck.after_opt()
            dev.sync()
            dt = time.perf_counter() - t
            if ck.timing:
                iters.append(dt)
                blocked += b
                peak = max(peak, rss())
        gpu = dev.peak_over_base()
        kids = children_rss()
        t = time.perf_counter()
        ck.drain()
        drain = time.perf_counter() - t
        extra = ck.report()
    finally:
        ck.close()
    blocked = extra.pop("blocked_s", blocked)
    total = sum(iters)
    return {
        "iter_s": iters,
        "s_per_iter": total / len(iters),
        "iter_median_s": med(iters),
        "blocked_s_per_iter": blocked / len(iters),
        "blocked_frac": blocked / total if total else float("nan"),
        "drain_s": drain,
        "checkpoints_timed": part.iters // part.every if mode != "none" else 0,
        "host_rss_added": peak - rss0,
        "host_rss_peak": peak,
        "children_rss": kids,
        "gpu_peak_over_base": gpu,
        **extra,
    }


def run_round(tr: Trainer, part: Part, rnd: int, ctx: dict[str, Any]) -> dict[str, Any]:
    order = MODES[rnd % len(MODES) :] + MODES[: rnd % len(MODES)]
    row: dict[str, Any] = {"order": list(order)}
    for mode in order:
        slug = part.name.replace("/", "-")
        try:
            r = run_mode(mode, tr, part, ctx["work"] / f"{slug}-r{rnd}-{mode}", ctx)
        except Exception as e:  # one mode's failure is a result, not the end of the check
            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        row[mode] = r
        tr.dev.cleanup()
        if "s_per_iter" in r:
            log(
                f"  {part.name} round {rnd} {mode:<10} {r['s_per_iter'] * 1e3:9.1f} ms/iter "
                f"blocked {r['blocked_frac'] * 100:6.2f}%  drain {r['drain_s']:.2f} s"
            )
        else:
            log(f"  {part.name} round {rnd} {mode:<10} {r.get('skipped') or r.get('error')}")
    return row


def summarize_part(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds; ratios as medians of per-round ratios to the round's ``none``."""
    out: dict[str, Any] = {}
    for mode in MODES:
        rows = [
            (r[mode], r["none"])
            for r in rounds
            if "s_per_iter" in r.get(mode, {}) and "s_per_iter" in r.get("none", {})
        ]
        if not rows:
            out[mode] = {
                "missing": [
                    r.get(mode, {}).get("skipped") or r.get(mode, {}).get("error") for r in rounds
                ]
            }
            continue
        gpu = [
            m["gpu_peak_over_base"] - n["gpu_peak_over_base"]
            for m, n in rows
            if m["gpu_peak_over_base"] is not None
        ]
        last = rows[-1][0]
        s: dict[str, Any] = {
            "rounds": len(rows),
            "s_per_iter": med([m["s_per_iter"] for m, _ in rows]),
            "ratio": med([m["s_per_iter"] / n["s_per_iter"] for m, n in rows]),
            "ratios": [m["s_per_iter"] / n["s_per_iter"] for m, n in rows],
            "blocked_s_per_iter": med([m["blocked_s_per_iter"] for m, _ in rows]),
            "blocked_frac": med([m["blocked_frac"] for m, _ in rows]),
            "drain_s": med([m["drain_s"] for m, _ in rows]),
            "ckpt_bytes": last.get("ckpt_bytes"),
            "host_rss_added": med([m["host_rss_added"] for m, _ in rows]),
            "gpu_added_vs_none": med(gpu) if gpu else None,
        }
        if mode == "dstt":
            s["hooks_frac"] = med([m["hooks_s"] / sum(m["iter_s"]) for m, _ in rows])
            for k in (
                "lane",
                "pinned",
                "flusher",
                "host_buffer_bytes",
                "budget_bytes",
                "step_files_at_end",
                "run_bytes_at_end",
                "committed",
                "errors",
            ):
                s[k] = last.get(k)
        if mode == "dcp":
            s["variant"], s["backend"] = last.get("variant"), last.get("backend")
        out[mode] = s
    return out


# -- estimates and the schedule -------------------------------------------------------------
def estimate_round(part: Part, m: dict[str, Any]) -> float:
    """Seconds one round of ``part`` should take, from the model's facts ``m``: iteration
    ``it``, disk seconds per checkpoint ``disk_s``, ``state`` bytes."""
    it, disk_s, state = m["it"], m["disk_s"], m["state"]
    per = {
        "none": it,
        "dstt": max(it, disk_s / part.every),
        "dcp": max(it, disk_s / part.every),
        "torch_save": it + (disk_s + state / 4e9) / part.every,
    }
    n = part.warmup + part.iters
    setup = 2 * state / 4e9 + 2 * disk_s + 3.0  # buffers pinned, drains, process group
    return sum(n * v for v in per.values()) + setup


def predict_model(
    spec: ModelSpec, plan: Plan, known: dict[str, dict[str, Any]], disk_bw: float
) -> dict[str, Any]:
    """A model's facts before it is built: state from its config; iteration from the rule
    ``choose_accum`` follows (its floor scaled from a built model's micro-batch)."""
    cfg = llama_config(spec)
    state = 12 * cfg.params()
    disk_s = state / disk_bw
    floor = 0.0
    for name, k in known.items():
        ref = llama_config(plan.models[name])
        flops = cfg.params() * spec.batch * cfg.seq
        floor = k["micro_s"] * flops / (ref.params() * plan.models[name].batch * ref.seq)
    it = min(max(HEADROOM * disk_s / spec.target_every, floor), max(spec.max_iter_s, floor))
    return {"it": it, "disk_s": disk_s, "state": state, "build_s": 10 + state / 2e9}


def reserve(schedule: tuple[Slot, ...], i: int, est: Callable[[Slot], float]) -> float:
    """Time to keep for the later slots as important as slot ``i`` or more."""
    return sum(est(s) for s in schedule[i + 1 :] if s.priority <= schedule[i].priority)


# -- 2. the GPU tests -----------------------------------------------------------------------
def gpu_test_files() -> list[str]:
    """Test files that carry ``pytest.mark.gpu``."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text(errors="replace")
    )


def run_pytest(out: Path, timeout: float) -> dict[str, Any]:
    files = gpu_test_files()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        *files,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(10.0, timeout)
        )
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}{e.stderr or ''}\n(timed out after {timeout:.0f} s)", -1
        text = text if isinstance(text, str) else str(text)
    (out / "pytest.txt").write_text(" ".join(cmd) + "\n\n" + text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = next(
        (
            ln.strip(" =")
            for ln in reversed(lines)
            if re.search(r"\d+ (passed|failed|skipped|error|deselected)|no tests ran", ln)
        ),
        lines[-1] if lines else "",
    )
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    return {
        "files": files,
        "rc": rc,
        "summary": summary,
        "counts": counts,
        "wall_s": time.perf_counter() - t,
    }


# -- 4. resume on the device ----------------------------------------------------------------
def same_bits(a: Any, b: Any) -> bool:
    torch = sys.modules["torch"]
    if not isinstance(a, torch.Tensor):
        return bool(a == b)
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1), b.detach().reshape(-1).to(a.device)
    if a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))


def flat_state(tr: Trainer, sched: Any) -> dict[str, Any]:
    """Every tensor and number of the training state, cloned, by name."""
    out: dict[str, Any] = {
        f"model/{k}": v.detach().clone() for k, v in tr.model.state_dict().items()
    }
    osd = tr.opt.state_dict()
    for idx, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{idx}/{k}"] = v.detach().clone() if hasattr(v, "detach") else v
    for i, g in enumerate(osd["param_groups"]):
        for k, v in g.items():
            out[f"group/{i}/{k}"] = v
    out.update({f"sched/{k}": v for k, v in sched.state_dict().items()})
    return out


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(
        k for k in a.keys() | b.keys() if k not in a or k not in b or not same_bits(a[k], b[k])
    )


@contextlib.contextmanager
def deterministic_step(torch: Any) -> Iterator[None]:
    """Math attention and deterministic kernels: the same inputs give the same bits."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = sdpa_kernel(SDPBackend.MATH)
    except ImportError:
        kernel = torch.backends.cuda.sdp_kernel(
            enable_flash=False, enable_math=True, enable_mem_efficient=False
        )
    prev = torch.are_deterministic_algorithms_enabled()
    with warnings.catch_warnings(), kernel:
        warnings.simplefilter("ignore")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev)


def resume_check(spec: ModelSpec, dev: Device, run: Path, steps: int = 3) -> dict[str, Any]:
    import dstt

    torch = dev.torch
    t0 = time.perf_counter()

    def sched_of(tr: Trainer) -> Any:
        return torch.optim.lr_scheduler.LinearLR(tr.opt, start_factor=0.1, total_iters=100)

    a = Trainer(spec, dev, seed=0)
    sa = sched_of(a)
    with dstt.session(a.model, a.opt, run=run, scheduler=sa):
        for _ in range(steps):
            a.fwd_bwd()
            a.opt_step()
            sa.step()
    ref = flat_state(a, sa)
    b = Trainer(spec, dev, seed=1)
    sb = sched_of(b)
    b.fwd_bwd()
    b.opt_step()  # an AdamW state of its own to be overwritten
    sb.step()
    differed = len(diff(ref, flat_state(b, sb)))
    with dstt.session(b.model, b.opt, run=run, scheduler=sb, resume=True) as s:
        restored_step = s.step
        restored = diff(ref, flat_state(b, sb))
    tokens = a.batches[0]

    def one_step(tr: Trainer, sc: Any) -> dict[str, Any]:
        with deterministic_step(torch):
            tr.micro(tokens)
            tr.opt_step()
            sc.step()
        return flat_state(tr, sc)

    # control: the same step twice from the same state on ``a`` (are the kernels
    # deterministic here? if not, a mismatch after the step says nothing about the resume)
    saved = copy.deepcopy((a.model.state_dict(), a.opt.state_dict(), sa.state_dict()))
    first = one_step(a, sa)
    a.model.load_state_dict(saved[0])
    a.opt.load_state_dict(saved[1])
    sa.load_state_dict(saved[2])
    control = diff(first, one_step(a, sa))
    continued = diff(first, one_step(b, sb))
    n = len(ref)
    del a, b, ref, saved, first
    dev.cleanup()
    return {
        "model": spec.name,
        "steps": steps,
        "restored_step": restored_step,
        "entries": n,
        "differed_before": differed,
        "restored_bit_exact": restored_step == steps and not restored and differed > 0,
        "restored_mismatch": restored[:10],
        "continued_bit_exact": not continued,
        "continued_mismatch": continued[:10],
        "kernels_deterministic": not control,
        "control_mismatch": control[:10],
        "wall_s": time.perf_counter() - t0,
    }


# -- 5. report ------------------------------------------------------------------------------
def targets(res: dict[str, Any], plan: Plan) -> dict[str, Any]:
    part = res["parts"].get(plan.threshold_part, {}).get("summary", {})
    d, dcp, ts = part.get("dstt", {}), part.get("dcp", {}), part.get("torch_save", {})
    out: dict[str, Any] = {"part": plan.threshold_part}
    if "blocked_frac" in d:
        out["blocked_le_5pct"] = d["blocked_frac"] <= 0.05
        out["hooks_le_5pct"] = d["hooks_frac"] <= 0.05
    if "ratio" in d and "ratio" in dcp:
        out["dstt_le_dcp"] = d["ratio"] <= dcp["ratio"]
    if "ratio" in d and "ratio" in ts:
        out["dstt_le_torch_save"] = d["ratio"] <= ts["ratio"]
    rs = res.get("resume") or {}
    if "restored_bit_exact" in rs:
        out["resume_bit_exact"] = rs["restored_bit_exact"] and rs["continued_bit_exact"]
    pt = res.get("pytest") or {}
    if "rc" in pt:
        out["gpu_tests_passed"] = pt["rc"] == 0 and pt["counts"].get("passed", 0) > 0
    facts = res["parts"].get(plan.threshold_part, {}).get("model", {})
    if "disk_binds" in facts:
        out["disk_binds"] = facts["disk_binds"]
    return out


def _f(x: Any, fmt: str, scale: float = 1.0) -> str:
    return (
        "-"
        if x is None or (isinstance(x, float) and not math.isfinite(x))
        else format(x * scale, fmt)
    )


def print_table(res: dict[str, Any]) -> None:
    log(
        "\n| part | mode | s/iter | x none | blocked ms/iter | blocked % | in hooks % | "
        "drain s | GB/ckpt | host MB added | GPU MB vs none |"
    )
    log("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, p in res["parts"].items():
        for mode, s in p.get("summary", {}).items():
            if "ratio" not in s:
                log(
                    f"| {name} | {mode} | {'; '.join(map(str, s.get('missing', [])))} "
                    "| | | | | | | | |"
                )
                continue
            log(
                f"| {name} | {mode} | {_f(s['s_per_iter'], '.3f')} | {_f(s['ratio'], '.2f')}x "
                f"| {_f(s['blocked_s_per_iter'], '.1f', 1e3)} | "
                f"{_f(s['blocked_frac'], '.2f', 100)} | {_f(s.get('hooks_frac'), '.2f', 100)} "
                f"| {_f(s['drain_s'], '.2f')} | {_f(s['ckpt_bytes'], '.3f', 1e-9)} | "
                f"{_f(s['host_rss_added'], '.0f', 1 / MiB)} | "
                f"{_f(s['gpu_added_vs_none'], '.0f', 1 / MiB)} |"
            )
    for name, p in res["parts"].items():
        m = p.get("model", {})
        if m:
            log(
                f"{name}: {m['params'] / 1e6:.0f} M params, {m['state_bytes'] / 1e9:.2f} GB "
                f"state, accum {m['accum']} x {m['batch']} x {m['seq']} tokens, "
                f"disk {m['disk_s_per_ckpt']:.2f} s/ckpt, none {m['iter_s']:.3f} s/iter, "
                f"disk binds: {m['disk_binds']}"
            )
    rs = res.get("resume")
    if rs:
        log(
            f"resume ({rs.get('model')}): restored bit-exact {rs.get('restored_bit_exact')}, "
            f"continued step bit-exact {rs.get('continued_bit_exact')}"
            + (f", error {rs['error']}" if "error" in rs else "")
        )
    pt = res.get("pytest")
    if pt:
        log(f"pytest -m gpu: {pt.get('summary') or pt.get('skipped')}")
    log(f"targets: {json.dumps(res.get('targets', {}))}")
    for note in res["notes"]:
        log(f"note: {note}")


class Results:
    def __init__(self, path: Path, res: dict[str, Any]) -> None:
        self.path, self.res = path, res

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


# -- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    global MODES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and pytest.txt")
    ap.add_argument("--dry", action="store_true", help="tiny models on the CPU (the test)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall seconds for everything (default 450; --dry 300)",
    )
    ap.add_argument("--work", default=None, help="where run folders go (a temp dir in it)")
    ap.add_argument(
        "--pytest",
        choices=("gpu", "none"),
        default="gpu",
        help="run the tests marked gpu (default) or skip them",
    )
    ap.add_argument(
        "--accum",
        type=int,
        default=0,
        help="micro-batches per iteration for every model (default: from the disk)",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated parts (and/or 'resume') to run, in the plan's order (default all)",
    )
    ap.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(MODES)}")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    # child processes (dstt's flusher, the pytest part) import this repository's dstt too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    budget = args.budget_s if args.budget_s is not None else (300.0 if args.dry else 450.0)
    deadline = t_start + budget
    plan = DRY if args.dry else FULL
    if args.modes:
        unknown = set(args.modes.split(",")) - set(MODES)
        if unknown or "none" not in args.modes.split(","):
            ap.error(f"--modes: a subset of {MODES} with none in it (unknown: {unknown})")
        MODES = tuple(m for m in MODES if m in args.modes.split(","))
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - set(plan.parts) - {"resume"}
        if unknown:
            ap.error(f"--only: unknown parts {sorted(unknown)}; known: {sorted(plan.parts)}")
        plan = replace(plan, schedule=tuple(s for s in plan.schedule if s.part in keep))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "bench": "gpu_check",
        "dry": args.dry,
        "budget_s": budget,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "plan": {
            "parts": {k: {**asdict(v), "warmup": v.warmup} for k, v in plan.parts.items()},
            "models": {k: asdict(v) for k, v in plan.models.items()},
        },
        "notes": [],
        "parts": {},
    }
    store = Results(out / "gpu_check.json", res)
    pre = res["preflight"] = preflight()
    print_preflight(pre)
    store.save()
    if pre["problems"] or "import_dstt_error" in pre:
        log("preflight failed: dstt cannot run here (see above)")
        return 2
    import torch

    cuda = torch.cuda.is_available() and not args.dry
    if not cuda and not args.dry:
        log("no CUDA device: this check needs one (use --dry for the CPU dry run)")
        res["notes"].append("no CUDA device")
        store.save()
        return 3
    if args.dry:
        torch.set_num_threads(1)
    dev = Device(torch, cuda)
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import disk_bandwidth, source_state

    work = Path(tempfile.mkdtemp(prefix="dstt-gpu-check-", dir=args.work or default_work()))
    res["machine"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_memory": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "disk_free": shutil.disk_usage(work).free,
        "work": str(work),
        "work_fs": filesystem(work),
        **source_state(),
    }
    log(f"machine: {json.dumps(res['machine'])}")
    try:
        if args.pytest == "gpu" and importlib.util.find_spec("pytest") is None:
            res["pytest"] = {"skipped": "pytest is not installed"}
        elif args.pytest == "gpu":
            log(f"pytest -m gpu {' '.join(gpu_test_files())} ...")
            res["pytest"] = run_pytest(out, min(240.0, deadline - time.perf_counter() - 60))
            log(
                f"pytest: {res['pytest']['summary']} (rc {res['pytest']['rc']}, "
                f"{res['pytest']['wall_s']:.0f} s)"
            )
        else:
            res["pytest"] = {"skipped": "--pytest none"}
        store.save()
        bench(plan, args, dev, work, res, store, deadline, disk_bandwidth)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        log(res["traceback"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        res["targets"] = targets(res, plan)
        res["wall_s"] = time.perf_counter() - t_start
        store.save()
        print_table(res)
        log(f"\nwrote {store.path} ({res['wall_s']:.0f} s)")
    return 1 if "error" in res else 0


def bench(
    plan: Plan,
    args: argparse.Namespace,
    dev: Device,
    work: Path,
    res: dict[str, Any],
    store: Results,
    deadline: float,
    disk_bandwidth: Callable[[Path, int], float],
) -> None:
    """The capture benchmark and the resume check, slot by slot within the time left."""
    disk_bw = disk_bandwidth(work, plan.disk_probe_bytes)
    res["disk_write_bytes_per_s"] = disk_bw
    log(f"disk: {disk_bw / 1e9:.2f} GB/s (64 MiB writes + fsync)")
    facts: dict[str, dict[str, Any]] = {}  # built models: measured facts
    round_s: dict[str, float] = {}  # part -> seconds its last round took
    trainer: Trainer | None = None

    def est(slot: Slot) -> float:
        if slot.part == "resume":
            m = facts.get(plan.resume_model) or predict_model(
                plan.models[plan.resume_model], plan, facts, disk_bw
            )
            return 4 * m["disk_s"] + 15.0
        part = plan.parts[slot.part]
        if slot.part in round_s:
            return round_s[slot.part]
        m = facts.get(part.model)
        build = 0.0
        if m is None:
            m = predict_model(plan.models[part.model], plan, facts, disk_bw)
            build = m["build_s"]
        return estimate_round(part, m) + build

    for i, slot in enumerate(plan.schedule):
        left = deadline - time.perf_counter()
        e, keep = est(slot), reserve(plan.schedule, i, est)
        label = slot.part if slot.part == "resume" else f"{slot.part} round {slot.round}"
        if e + keep > left:
            res["notes"].append(
                f"skipped {label}: needs ~{e:.0f} s (+{keep:.0f} s kept for "
                f"later checks), {left:.0f} s left"
            )
            log(res["notes"][-1])
            continue
        if slot.part == "resume":
            if trainer is not None and trainer.spec.name != plan.resume_model:
                trainer = None
                dev.cleanup()
            try:
                res["resume"] = resume_check(
                    plan.models[plan.resume_model], dev, work / "resume-run"
                )
            except Exception as e:
                res["resume"] = {
                    "model": plan.resume_model,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            finally:
                shutil.rmtree(work / "resume-run", ignore_errors=True)
            shown = {k: v for k, v in res["resume"].items() if k != "traceback"}
            log(f"resume: {json.dumps(shown)}")
            store.save()
            continue
        part = plan.parts[slot.part]
        spec = plan.models[part.model]
        if trainer is None or trainer.spec.name != spec.name:
            trainer = None
            dev.cleanup()
            t = time.perf_counter()
            trainer = Trainer(spec, dev)
            micro_s, opt_s = trainer.calibrate()
            state = trainer.state_bytes()
            disk_s = state / disk_bw
            trainer.accum = args.accum or choose_accum(spec, micro_s, opt_s, disk_s)
            it = trainer.accum * micro_s + opt_s
            facts[spec.name] = {"it": it, "disk_s": disk_s, "state": state, "micro_s": micro_s}
            res["parts"].setdefault(part.name, {})
            info = {
                "params": trainer.params,
                "state_bytes": state,
                "accum": trainer.accum,
                "batch": spec.batch,
                "seq": trainer.cfg.seq,
                "micro_s": micro_s,
                "opt_s": opt_s,
                "iter_s": it,
                "disk_s_per_ckpt": disk_s,
                "build_s": time.perf_counter() - t,
            }
            log(f"model {spec.name}: {json.dumps(info)}")
            for p in plan.parts.values():
                if p.model == spec.name:
                    res["parts"].setdefault(p.name, {})["model"] = {
                        **info,
                        "every": p.every,
                        "disk_binds": disk_s / p.every > it,
                    }
        ctx = {"work": work, "state_bytes": facts[spec.name]["state"]}
        t = time.perf_counter()
        row = run_round(trainer, part, slot.round, ctx)
        round_s[part.name] = time.perf_counter() - t
        entry = res["parts"].setdefault(part.name, {})
        entry.setdefault("rounds", []).append(row)
        entry["summary"] = summarize_part(entry["rounds"])
        res["targets"] = targets(res, plan)
        store.save()


if __name__ == "__main__":
    sys.exit(main())
