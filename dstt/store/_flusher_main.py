"""``python -m dstt.store._flusher_main``: the flusher process (``store/flusher.py``).

A module of its own so that running it does not re-execute a module the package
``dstt.store`` already imported (runpy warns about that, on the child's stderr).
"""

from .flusher_child import main

main()
