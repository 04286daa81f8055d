"""Generation: a decoder language model served from a precompiled file.

Two ways, one package:

- :func:`compile_generator` (``compile.py``) builds a *generator*: the
  model's prefill and decode step over a static KV cache passed as plain
  tensors, saved with ``Precompile.save``. ``Precompile.load`` returns a
  :class:`~torch_precompile.runtime.generator.Generator` whose ``generate``
  runs the loop with torch alone: no transformers, no compiler, batches of 1
  to ``max_batch`` with left padding, greedy or sampled.
- :func:`compile_for_generation` and :func:`generate_with` (``hf.py``) run
  transformers' own ``model.generate`` on an artifact, for the strategies the
  generator does not have (beam search, assisted decoding).

Building needs transformers; serving a generator does not.
"""

from __future__ import annotations

from .compile import compile_generator, save_generator_shard
from .hf import compile_for_generation, forward_calls, generate_with

__all__ = [
    "compile_for_generation",
    "compile_generator",
    "forward_calls",
    "generate_with",
    "save_generator_shard",
]
