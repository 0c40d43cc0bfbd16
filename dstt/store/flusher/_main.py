"""``python -m dstt.store.flusher._main``: the flusher process (``store/flusher/parent.py``).

A module of its own so that running it does not re-execute a module the package
``dstt.store`` already imported (runpy warns about that, on the child's stderr).
"""

from .child import main

main()
