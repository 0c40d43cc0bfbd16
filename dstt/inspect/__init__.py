"""Read-side views over committed runs: lazy xarray, summaries, comparisons, export.

Modules, each importable on its own (none imported eagerly, so ``naming``, ``selection``,
``catalog`` and ``readers`` stay free of xarray): names — ``naming`` (store paths <-> torch
names), ``selection`` (the layer selector), ``catalog`` (a commit's names, tied aliases);
reading — ``readers`` (per-thread readers, one table cache), ``lazy`` (xarray backend
arrays), ``views`` (DataArray / DataTree), ``sharded`` (ZeRO logical tensors), ``virtual``
(a timeline as one virtual Zarr store); numbers — ``summaries``, ``indexed``, ``diagnose``,
``compare``, ``html``; out to torch and files — ``export``, ``export_dcp``, ``restore``,
``optimizers``; re-execution — ``replay``, ``rebuild`` (a light step from the one before).
Everything reads through ``dstt.store`` only; ``dstt.run`` is the front. Rejected: eager
imports here, which would make ``dstt ls`` pay for xarray. History: docs/decisions.md.
"""
