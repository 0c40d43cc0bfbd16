"""Read-side views over committed runs: lazy xarray, summaries, comparisons, export.

Modules (each importable on its own; this package imports none of them eagerly, so
``dstt.inspect.naming`` stays free of xarray):

- ``naming``     store paths <-> dotted torch names; the layer selector rule
- ``lazy``       xarray ``BackendArray`` over one commit and over many (trajectories)
- ``views``      DataArray / DataTree assembly
- ``summaries``  write-time summaries and metrics as Datasets; loss-spike detection
- ``compare``    per-tensor change between two commits
- ``export``     one commit as a safetensors / torch state dict
- ``html``       the run overview (text, JSON-ready dict, static HTML)

Everything here reads through ``dstt.store`` only; ``dstt._run`` is the user-facing front.
"""
