"""Read-side views over committed runs: lazy xarray, summaries, comparisons, export.

Modules (each importable on its own; this package imports none of them eagerly, so
``naming``, ``selection``, ``catalog`` and ``readers`` stay free of xarray):

- ``naming``     store paths <-> dotted torch names; how a typed name resolves
- ``selection``  the layer selector rule
- ``catalog``    one commit's names: canonical paths and tied aliases
- ``readers``    per-thread readers sharing one cache of (canonically keyed) arrays tables
- ``lazy``       xarray ``BackendArray`` over one commit and over many (trajectories)
- ``views``      DataArray / DataTree assembly
- ``summaries``  write-time summaries and metrics as Datasets; loss-spike detection
- ``compare``    per-tensor change between two commits
- ``export``     one commit as safetensors, a torch state dict, or a Hugging Face folder
- ``restore``    one commit as torch state dicts, and loaded into live objects
- ``optimizers`` torch optimizers back from a commit, one or several
- ``html``       the run overview (text, JSON-ready dict, static HTML)
- ``virtual``    a timeline as one virtual Zarr store (kerchunk references into step files)
- ``indexed``    metrics and write-time summaries from the run's index rows
- ``diagnose``   spike diagnosis: abnormal updates, non-finite values, divergence
- ``sharded``    logical tensors of sharded commits (ZeRO partitions) as table records
- ``export_dcp`` one commit as a ``torch.distributed.checkpoint`` folder
- ``replay``     re-executing a past step exactly (``ReplayKit``, ``replay_step``)
- ``rebuild``    a light step rebuilt from the stored step before it

Everything here reads through ``dstt.store`` only; ``dstt.run`` is the user-facing front.
"""
