"""``python -m torch_precompile`` (also the ``torch-precompile`` script): inspect and bench artifacts."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
