"""``python -m lean_store``: the ``lean-store`` command line."""

import sys

from .cli import main

sys.exit(main())
