"""``dstt virtual RUN -o OUT``: the run as one virtual Zarr store that plain xarray opens.

Thin, as every command: parse → :meth:`dstt.Run.virtual` → print. Exit codes: 0 written (or
already up to date), 2 bad input (not a run, an output that is not this run's references).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import _P, _command, _emit, _resolve_run

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator

__all__ = ["add_virtual", "cmd_virtual"]


def add_virtual(sub: argparse._SubParsersAction[_P], common: _P) -> None:
    """The ``virtual`` subcommand's parser."""
    what = (
        "write references that present a timeline as one Zarr store (every tensor with a "
        "step dimension, chunks pointing into the step files: no copy); re-run to append"
    )
    sp = _command(sub, common, "virtual", cmd_virtual, what)
    sp.add_argument("-o", "--output", required=True, metavar="OUT", help="the reference file")
    sp.add_argument("--timeline", help="timeline to present (default: the current one)")
    sp.add_argument(
        "--format",
        choices=["kerchunk"],
        default="kerchunk",
        help="reference format: kerchunk JSON, read with fsspec's reference:// file system",
    )


def cmd_virtual(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    rep = run.virtual(args.output, timeline=args.timeline)
    doc = {
        "output": str(rep.path),
        "steps": len(rep.steps),
        "added": list(rep.added),
        "arrays": rep.arrays,
        "left_out_steps": {str(k): v for k, v in rep.left_out_steps.items()},
        "left_out_arrays": dict(rep.left_out_arrays),
    }

    def text() -> Iterator[str]:
        span = f"steps {rep.steps[0]}..{rep.steps[-1]}" if rep.steps else "no steps"
        yield (
            f"{rep.path}: {len(rep.steps)} steps ({span}), {rep.arrays} arrays, "
            f"{len(rep.added)} steps added"
        )
        for k, why in rep.left_out_steps.items():
            yield f"  left out step {k}: {why}"
        for name, why in list(rep.left_out_arrays.items())[:20]:
            yield f"  left out {name}: {why}"
        remote = (
            ", 'remote_protocol': 's3', 'remote_options': {'asynchronous': True}"
            if str(run.reader.storage.location).startswith("s3://")
            else ""
        )
        yield (
            "open it: xarray.open_datatree('reference://run', engine='zarr', "
            f"storage_options={{'fo': '{rep.path}'{remote}}}, consolidated=False, "
            "zarr_format=3)"
        )

    return _emit(args, doc, text)
