"""The no-dstt reader of the virtual-store tests: a subprocess that imports neither dstt nor
torch opens a reference file with xarray through fsspec's reference file system and prints
the step coordinate, a metric and the bytes of the named arrays as JSON.

Imported by name (``from virtual_helpers import read_plain``): tests/inspect is on sys.path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import xarray as xr
    refs, names, metric, opts = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    tree = xr.open_datatree(
        "reference://run", engine="zarr", consolidated=False, zarr_format=3,
        storage_options={"fo": refs, **json.loads(opts)},
    )
    out = {"steps": tree["step"].values.tolist(), metric: tree[metric].values.tolist()}
    for n in names:
        v = tree[n]
        out[n] = {"dims": list(v.dims), "bytes": np.ascontiguousarray(v.values).tobytes().hex()}
    out["modules"] = sorted(k for k in sys.modules if k.split(".")[0] in ("dstt", "torch"))
    print(json.dumps(out))
    """
)


def read_plain(
    refs: Path,
    names: list[str],
    metric: str = "loss",
    options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """What the no-dstt reader sees (``options``: the reference file system's storage
    options; default: step files on the local disk)."""
    opts = {"remote_protocol": "file"} if options is None else options
    done = subprocess.run(
        [sys.executable, "-c", READER, str(refs), json.dumps(names), metric, json.dumps(opts)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    assert out["modules"] == [], "the reader must not import dstt or torch"
    return out


def same_bytes(entry: Any, want: np.ndarray) -> bool:
    """The reader's entry (dims ``step`` first) holds exactly ``want``'s bytes."""
    return (
        isinstance(entry, dict)
        and entry["dims"][0] == "step"
        and bytes.fromhex(entry["bytes"]) == np.ascontiguousarray(want).tobytes()
    )
