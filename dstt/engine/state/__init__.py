"""What to capture: ``providers`` (the ``StateProvider`` seam), ``torch_state`` (model,
optimizer, scheduler, RNG), ``optimizers`` (optimizer state as arrays), ``model_names``
(canonical and tied names), ``dims`` (dimension names), ``data_position`` (the loader's
position), ``predictions`` (which arrays the store may predict).

A room because it says *what* a step holds, never *how* it is copied or written: it imports
only ``tensors`` (and the store's seam); ``capture``, ``distributed`` and ``ds`` build on it.
"""
