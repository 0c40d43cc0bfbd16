"""Read-side views over committed runs: lazy xarray, summaries, comparisons, export.

Modules, each importable on its own (``naming``, ``selection``, ``catalog``, ``readers``
stay free of xarray): names — ``naming`` (store paths <-> torch names), ``selection``,
``catalog`` (a commit's names, tied aliases); reading — ``readers`` (per-thread readers),
``lazy`` (xarray backend arrays), ``views`` (DataArray / DataTree), ``sharded`` (ZeRO
tensors), ``virtual`` (a timeline as one virtual Zarr store); numbers — ``summaries``,
``indexed``, ``diagnose``, ``compare``, ``html``; out — ``export``, ``export_dcp``,
``restore``, ``optimizers``; re-execution — ``replay`` (with ``replay_kit``, ``replay_data``,
``replay_compare``, ``replay_grads``), ``rebuild`` (a light step; ``rebuild_ddp``: DDP ranks).
Everything reads through ``dstt.store``; ``dstt.run`` is the front. Rejected: eager imports
here (``dstt ls`` would pay for xarray). History: docs/decisions.md.
"""
