"""What every ``dstt`` command shares: exit codes, which errors are the user's input, finding
the run from the arguments, printing (text or ``--json``) and progress bars."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from dstt.errors import (
    ConfigError,
    MetricNotFoundError,
    NotARunError,
    OutputExistsError,
    SchemaError,
    StepNotFoundError,
    TensorNotFoundError,
    TimelineError,
    UnsafeObjectError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT, EXIT_RUN, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_PIPE = 128 + 13  # SIGPIPE: what a shell reports for a tool stopped by a closed pipe
_P = TypeVar("_P", bound=argparse.ArgumentParser)  # the parser type ``add_*`` take


class UsageError(Exception):
    """Bad input found after parsing (exit 2)."""


#: the errors that are the user's input (exit 2); every other ``DsttError`` is about the run
BAD_INPUT: tuple[type[BaseException], ...] = (
    UsageError,
    NotARunError,
    StepNotFoundError,
    TimelineError,
    TensorNotFoundError,
    MetricNotFoundError,
    SchemaError,
    UnsafeObjectError,
    OutputExistsError,
    ConfigError,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the usage block
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _command(
    sub: Any,
    common: Any,
    name: str,
    fn: Callable[[argparse.Namespace], int] | None,
    help: str,
    run: bool = True,
) -> Any:
    """A subcommand's parser: ``common``'s flags, ``help``, and (``run``) the optional ``RUN``;
    ``fn`` None: a group, whose subcommands have the functions."""
    sp = sub.add_parser(name, parents=[common], help=help, description=help)
    if fn is not None:
        sp.set_defaults(func=fn)
    if run:
        sp.add_argument(
            "path", nargs="?", metavar="RUN", help="the run, or a folder inside it (same as --run)"
        )
    return sp


def _resolve_run(args: argparse.Namespace, *, opener: Any = None) -> Any:
    """The run named by the arguments, opened with ``opener`` (default ``dstt.open``)."""
    if opener is None:
        from dstt.run import open_run as opener
    return opener(_run_root(args))


def _run_root(args: argparse.Namespace) -> str:
    """The root of the run given as ``RUN``, ``--run``, ``$DSTT_RUN`` or the current directory,
    any of which may be a folder inside the run (found by walking up, as git does)."""
    from dstt.run import find_run_root
    from dstt.store._internal import Repository, is_url

    positional: str | None = getattr(args, "path", None)
    flag: str | None = getattr(args, "run", None)
    if positional and flag and os.path.abspath(positional) != os.path.abspath(flag):
        raise UsageError(f"two runs given: {positional} and --run {flag}; give one")
    path, source = positional or flag, ""
    if not path and os.environ.get("DSTT_RUN"):
        path, source = os.environ["DSTT_RUN"], " (from $DSTT_RUN)"
    if not path:
        root = find_run_root(os.getcwd())
        if root is None:
            raise UsageError(
                "no run given and the current directory is not inside a dstt run; "
                "pass RUN or --run PATH, or set DSTT_RUN"
            )
        return root
    if is_url(path):  # an object-store run: no folders to walk up
        return path
    if not os.path.exists(path):
        hint = f"; for step {path}, use --step {path}" if path.isdigit() else ""
        raise NotARunError(f"no run at {path}{source}: no such directory{hint}")
    if not os.path.isdir(path):
        raise NotARunError(f"{path}{source} is a file, not a run; pass the run's directory")
    root = find_run_root(path)
    if root is None:
        try:
            Repository.open(path)  # the store's own reason (no zarr.json, bad JSON ...)
        except NotARunError as e:
            raise NotARunError(f"{e}{source}, nor a folder inside one") from None
        root = path
    return root


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return _jsonable(x.item())
    return x


def _fields(obj: Any, names: str) -> dict[str, Any]:
    """``{name: obj.name}`` for each of the space-separated ``names``: a report's attributes
    as fields of a ``--json`` document."""
    return {n: getattr(obj, n) for n in names.split()}


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


def _emit(
    args: argparse.Namespace, doc: Any, text: Callable[[], Iterable[str]], *, ok: bool = True
) -> int:
    """Print ``doc`` as JSON (``--json``) or the lines of ``text()``; returns ``EXIT_OK``, or
    ``EXIT_PROBLEMS`` when not ``ok`` (the command found problems and reported them)."""
    if getattr(args, "json", False):
        print(json.dumps(_jsonable(doc), indent=2, default=str))
    else:
        for line in text():
            print(line)
    return EXIT_OK if ok else EXIT_PROBLEMS


@contextmanager
def _bar(args: argparse.Namespace, total: int | None, unit: str = "it") -> Iterator[Any]:
    from tqdm import tqdm

    disable = True if getattr(args, "json", False) else None  # None: only on a terminal
    with tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        leave=False,
        disable=disable,
    ) as bar:
        yield bar


def _counter(bar: Any) -> Callable[[int, int], None]:
    def update(n: int, total: int) -> None:
        bar.total, bar.n = total, n
        bar.refresh()

    return update


def _timeline_line(t: dict[str, Any], fork: str) -> str:
    """One timeline of ``dstt ls`` and ``dstt timeline list``: where it forked, if it did,
    then ``fork`` (what that command adds about the fork)."""
    rng = f"steps {t['first_step']} … {t['head_step']}" if t["commits"] else "empty"
    base = f"  from {t['base_timeline']}@{t['base_step']}{fork}" if t["base_timeline"] else ""
    return f"{'*' if t['current'] else ' '} {t['name']:<24} {t['commits']:>7} commits  {rng}{base}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _metrics_text(m: dict[str, Any]) -> str:
    return "  ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(m.items())
    )
