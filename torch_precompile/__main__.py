"""``python -m torch_precompile`` and the ``torch-precompile`` script: inspect, bench."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
