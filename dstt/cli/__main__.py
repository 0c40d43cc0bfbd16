"""``python -m dstt.cli ARGS``: the ``dstt`` script without the script."""

from __future__ import annotations

import sys

from .parser import main

sys.exit(main())
