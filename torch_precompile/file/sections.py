"""Every section name ``Precompile.save`` writes, in one place (``docs/FORMAT.md``
says what each holds). No torch import: the command line reads them too."""

from __future__ import annotations

COMPILED = "compiled"  # PyTorch's serialization of variant 0 (``compiled.<i>``: variant i)
LEAN = "lean"  # what runs variant 0 without the compiler (``lean.<i>``: variant i)
KERNEL_PREFIX = "kernel/"  # one C++ shared object or Triton cubin each: ``kernel/<key>``
SKELETON = "skeleton"  # a module's tree, attributes and tensor names (JSON)
WEIGHTS = "weights"  # a module's tensors (also the one section of a rank's shard file)
SELF = "self"  # another object the compiled code reads as ``self`` (pickled)
DISTRIBUTED_HOOKS = "distributed_hooks"  # the parallelisation hooks of a distributed model
GENERATOR = "generator"  # a generator file's record: limits, cache layout, token ids (JSON)
GENERATOR_TOKENIZER = "generator-tokenizer"  # its tokenizer (tokenizers' JSON), if built with one
KERNELS_V1 = "kernels"  # format version 1: every kernel in one nested container


def stored_compressed(name: str) -> bool:
    """Whether ``save`` stores section ``name`` zlib-compressed (format version 4): the
    compiled and lean pickles, mostly source text (8 MiB each for the 30 layers of the
    SmolLM2-135M shape, a twelfth of that compressed, 11-25 ms to decompress)."""
    return name.split(".")[0] in (COMPILED, LEAN)


def section_name(base: str, variant: int) -> str:
    """``compiled`` / ``lean`` for variant 0, ``compiled.<i>`` for variant ``i``."""
    return base if variant == 0 else f"{base}.{variant}"
