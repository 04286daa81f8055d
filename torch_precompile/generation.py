"""Generation on one artifact: ``model.generate`` calling a precompiled forward.

A Hugging Face ``generate`` loop calls the model's forward in two shapes of
program: a *prefill* (the whole prompt, an empty cache) and a *decode* step
(one new token, a cache holding everything before it); transformers' mask
code treats a one-token step, and Dynamo a size of 1, as programs of their
own. :func:`compile_for_generation` asks ``generate`` itself which arguments
it passes to forward (so the keywords, the cache class and the flags are
exactly the library's), and compiles one variant for each program at batch
1 and at a dynamic batch, bundled in one artifact:

=========  ======================  ======================
program    batch 1                 batch 2..N
=========  ======================  ======================
prefill    prompt 1, prompt 2..L   prompt 1, prompt 2..L
decode     cache 1, cache 2..L     cache 1, cache 2..L
=========  ======================  ======================

:func:`generate_with` makes ``model.generate`` run on an artifact (loaded with
``Precompile.load(path, model=model)`` or standalone), and puts the model's
own forward back afterwards::

    artifact = compile_for_generation(model, prompt_ids)
    Precompile.save("gpt2.pt", artifact)
    loaded = Precompile.load("gpt2.pt", model=model)
    with generate_with(model, loaded):
        tokens = model.generate(prompt_ids, max_new_tokens=20, do_sample=False)
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ._api import Precompile
from ._artifact import PrecompiledArtifact
from ._preserve import Snapshot

log = logging.getLogger("torch_precompile")

__all__ = ["compile_for_generation", "forward_calls", "generate_with"]


def forward_calls(
    model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int = 2, **generate_kwargs: Any
) -> list[dict[str, Any]]:
    """The keyword arguments ``model.generate`` passes to forward at each step (copies).

    Runs ``generate`` eagerly under ``torch.no_grad()`` (greedy, ``new_tokens``
    steps); the model is left as it was.
    """
    calls: list[dict[str, Any]] = []
    forward = model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError(
                "generate passed positional arguments to forward; compile_for_generation "
                "supports models whose generate passes keywords (transformers 5)"
            )
        calls.append(copy.deepcopy(kwargs))  # the cache is updated in place by later steps
        return forward(**kwargs)

    snapshot = Snapshot({"model": model}, persistent=("model",))
    model.forward = spy  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                **generate_kwargs,
            )
    finally:
        snapshot.restore()  # also removes the spy from the instance's __dict__
    return calls


def compile_for_generation(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    mode: str | None = None,
    verbose: bool = False,
    **generate_kwargs: Any,
) -> PrecompiledArtifact:
    """One artifact for ``model.generate``: prefill and decode, batch 1 and 2..N.

    ``input_ids`` is an example prompt (its first row is used, at least 2
    tokens); ``generate_kwargs`` are passed to ``generate`` when asking it
    what it passes to forward (``cache_implementation="static"`` for a
    ``StaticCache``). The model and its config are left as they were.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must be a (batch, length) prompt of at least 2 tokens, "
            f"got shape {tuple(input_ids.shape)}"
        )
    row = input_ids[:1]
    # A dynamic batch equal to another size (the prompt, a decode mask of 2) would be
    # tied to it by Dynamo's duck sizing: pick one equal to none of them.
    prompt_len = row.shape[1]
    many = next(b for b in (3, 4, 5, 6, 7) if b not in (prompt_len, prompt_len + 1, prompt_len + 2))
    examples = []
    for batch in (many, 1):
        for prompt in (row, row[:, :1]):
            ids = prompt.expand(batch, -1).clone(memory_format=torch.contiguous_format)
            calls = forward_calls(model, ids, new_tokens=2, **generate_kwargs)
            # The prefill at this prompt length, then the first decode step: after a
            # prompt of 1 its cache holds 1, after a longer one 2 or more.
            examples.append(("prefill", batch, ids.shape[1], calls[0]))
            examples.append(("decode", batch, ids.shape[1], calls[1]))
    variants = []
    with torch.no_grad():
        for program, batch, prompt_len, kwargs in examples:
            log.info("generation: compiling %s (batch %d, prompt %d)", program, batch, prompt_len)
            variants.append(
                Precompile.compile(
                    model, (), kwargs, dynamic=True, size_one=False, mode=mode, verbose=verbose
                )
            )
    return Precompile.precompile(variants)


@contextlib.contextmanager
def generate_with(model: torch.nn.Module, artifact: PrecompiledArtifact) -> Iterator[None]:
    """Within the block, ``model(...)`` and ``model.generate(...)`` run on ``artifact``.

    ``artifact`` computes with its own weights: load it with
    ``Precompile.load(path, model=model)`` for the model's, or standalone for
    the file's. The model's own forward is back after the block.
    """
    had = "forward" in model.__dict__
    previous = model.__dict__.get("forward")

    def forward(*args: Any, **kwargs: Any) -> Any:
        return artifact(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            model.forward = previous  # type: ignore[method-assign]
        else:
            del model.forward
