"""``python -m torch_precompile`` and the ``torch-precompile`` script: inspect, bench."""

from __future__ import annotations

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
