"""The ``torch-precompile`` script: its help answered without importing torch.

``import torch_precompile`` imports torch (and registers ``torch.Precompile``),
seconds on a loaded machine. The command line's parser needs none of it, so a
call that only asks for help (``--help``, ``serve -h``, no arguments) builds the
parser from the package's modules with the package's own ``__init__`` not run,
prints, and exits; every other call runs ``torch_precompile.cli.main`` as usual.
``serve`` and ``generate`` import torch without the parts a serving process never
runs (``lean_torch.py``; ``TORCH_PRECOMPILE_LEAN_IMPORT=0``: torch whole).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Sequence

_HELP = ("-h", "--help")
LEAN_IMPORT = "TORCH_PRECOMPILE_LEAN_IMPORT"  # 0: serve and generate import torch whole


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``torch-precompile``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if (not args or any(a in _HELP for a in args)) and "torch_precompile" not in sys.modules:
        return _help(args)
    if args[:1] in (["serve"], ["generate"]) and os.environ.get(LEAN_IMPORT, "1") != "0":
        from .lean_torch import import_torch

        import_torch()
    from torch_precompile.cli.main import main as run

    return run(args)


def _help(args: list[str]) -> int:
    """The parser's answer (help, or the usage error of a bare call) from the command
    line's modules alone: the package is entered without its ``__init__``, and left again
    so that nothing later in this process sees a package without its API."""
    spec = importlib.util.find_spec("torch_precompile")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("torch_precompile is not installed")
    package = types.ModuleType("torch_precompile")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules["torch_precompile"] = package
    try:
        from torch_precompile.cli.main import main as run

        return run(args)
    except SystemExit as done:  # argparse's help and usage errors
        return int(done.code or 0)
    finally:
        entered = [m for m in sys.modules if m.split(".")[0] == "torch_precompile"]
        for name in entered:
            del sys.modules[name]
