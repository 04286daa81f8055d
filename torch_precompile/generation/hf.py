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
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import Precompile, PrecompiledArtifact
from .._errors import CaptureError, GuardError
from ..lean.cudagraphs import not_recorded
from ..runtime.attention_backends import tracing_attention
from ..stages.snapshot import Snapshot, swapped_forward

log = logging.getLogger("torch_precompile")

__all__ = ["compile_for_generation", "forward_calls", "generate_with", "sliding_window"]


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
        kwargs = _with_mask(kwargs)
        calls.append(copy.deepcopy(kwargs))  # the cache is updated in place by later steps
        return forward(**kwargs)

    snapshot = Snapshot({"model": model}, persistent=("model",))
    model.forward = _signed(spy, forward)  # type: ignore[method-assign]
    try:
        with _no_auto_compile(model):
            _greedy(model, input_ids, new_tokens, generate_kwargs)
    finally:
        snapshot.restore()  # also removes the spy from the instance's __dict__
    return calls


def compile_for_generation(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    mode: str | None = None,
    single_batch: bool = False,
    verbose: bool = False,
    **generate_kwargs: Any,
) -> PrecompiledArtifact:
    """One artifact for ``model.generate``: prefill and decode, batch 1 and 2..N.

    ``input_ids`` is an example prompt (its first row is used, at least 2
    tokens); ``generate_kwargs`` are passed to ``generate`` when asking it
    what it passes to forward (``cache_implementation="static"`` for a
    ``StaticCache``). ``single_batch=True`` compiles the batch-1 programs only
    (half the variants, for a server that generates one sequence at a time).
    The model and its config are left as they were.
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise CaptureError(
            f"{type(model).__name__} is an encoder-decoder model: compile_for_generation "
            "supports decoder-only models (its decode step reads an encoder-decoder cache "
            "it cannot capture yet); run this model's generate eagerly, or precompile its "
            "encoder alone with Precompile.compile"
        )
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must be a (batch, length) prompt of at least 2 tokens, "
            f"got shape {tuple(input_ids.shape)}"
        )
    row = input_ids[:1]
    # A dynamic size equal to another size of the call (a head dimension, the number
    # of heads, the prompt) is tied to it by Dynamo's duck sizing, and specialised
    # with it: the example prompt length and batch equal none of them.
    static = _static_sizes(model, row, generate_kwargs)
    prompt_len = next(n for n in range(row.shape[1], 10**6) if not {n, n + 1} & static)
    row = _repeated(row, prompt_len)
    taken = static | {prompt_len, prompt_len + 1, prompt_len + 2}
    many = next(b for b in range(3, 10**6) if b not in taken)
    # A cache of fixed size (StaticCache) is allocated for the prompt plus the new
    # tokens but the last: for one new token it holds the prompt exactly, and the
    # library's mask code takes another branch (kv_length == q_length).
    fixed = generate_kwargs.get(
        "cache_implementation", getattr(model.generation_config, "cache_implementation", None)
    )
    examples = []
    for batch in (1,) if single_batch else (many, 1):
        for prompt in (row, row[:, :1]):
            ids = prompt.expand(batch, -1).clone(memory_format=torch.contiguous_format)
            calls = forward_calls(model, ids, new_tokens=2, **generate_kwargs)
            # The prefill at this prompt length, then the first decode step: after a
            # prompt of 1 its cache holds 1, after a longer one 2 or more.
            examples.append(("prefill", batch, ids.shape[1], calls[0]))
            examples.append(("decode", batch, ids.shape[1], calls[1]))
            if fixed is not None:
                full = forward_calls(model, ids, new_tokens=1, **generate_kwargs)[0]
                examples.append(("prefill, cache full", batch, ids.shape[1], full))
    variants = []
    device = next(model.parameters(), input_ids).device
    with torch.no_grad():
        for program, batch, prompt_len, kwargs in examples:
            log.info("generation: compiling %s (batch %d, prompt %d)", program, batch, prompt_len)
            with tracing_attention(device, prefill=program.startswith("prefill")):
                variants.append(
                    Precompile.compile(
                        model, (), kwargs, dynamic=True, size_one=False, mode=mode, verbose=verbose
                    )
                )
    batches = (1,) if single_batch else (many, 1)

    own_forward = model.__dict__.get("forward")

    def compile_call(kwargs: dict[str, Any]) -> PrecompiledArtifact:
        """Compile the model's own forward (``generate_with`` has swapped it) on ``kwargs``."""
        log.info("generation: compiling a step past the sliding window")
        swapped = model.__dict__.pop("forward")
        if own_forward is not None:
            model.forward = own_forward  # type: ignore[method-assign]
        try:
            with torch.no_grad():
                return Precompile.compile(
                    model, (), kwargs, dynamic=True, size_one=False, mode=mode, verbose=verbose
                )
        finally:
            model.forward = swapped  # type: ignore[method-assign]

    _cover_window(model, variants, row, batches, static, compile_call, generate_kwargs)
    return Precompile.precompile(variants)


def sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window of a model whose layers (all or some) attend to the last
    ``window`` tokens only (Mistral, Gemma2, Phi3, Qwen2 with ``use_sliding_window``)."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or not getattr(config, "use_sliding_window", 1):
        return None
    return window


def _cover_window(
    model: torch.nn.Module,
    variants: list[PrecompiledArtifact],
    row: torch.Tensor,
    batches: tuple[int, ...],
    static: set[int],
    compile_call: Callable[[dict[str, Any]], PrecompiledArtifact],
    generate_kwargs: dict[str, Any],
) -> None:
    """Add to ``variants`` the programs a generation across the sliding window needs.

    Past the window the library's cache stops growing and its mask code takes other
    branches, which Dynamo guards. ``generate`` runs on the variants themselves (a
    prompt ending just before the window, then steps past it; prompts at the window's
    edge; a prompt longer than the window), and a call that none of them serves is
    compiled from the very state the earlier variants left, so a loaded file serves
    the same loop.
    """
    window = sliding_window(model)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 10**9
    if window is None or window + 16 > limit:
        return
    # Lengths near the window that equal no static size (duck sizing would tie them).
    before = next((n for n in range(window - 2, 1, -1) if not {n, n + 1} & static), 2)
    beyond = next(n for n in range(window + 2, limit) if not {n, n + 1} & static)
    growing = _Growing(variants, compile_call)
    for batch in batches:
        # The prompts at the window's edge (one before, at, one past) are programs too.
        edges = [(n, 3) for n in (window - 1, window, window + 1) if n > before]
        for prompt, steps in ((before, window - before + 6), *edges, (beyond, 6)):
            ids = _repeated(row, prompt).expand(batch, -1)
            with generate_with(model, growing):  # type: ignore[arg-type]
                _greedy(
                    model, ids.clone(memory_format=torch.contiguous_format), steps, generate_kwargs
                )


def _repeated(row: torch.Tensor, length: int) -> torch.Tensor:
    """A prompt of ``length`` tokens: ``row`` repeated, then cut."""
    return row.repeat(1, -(-length // row.shape[1]))[:, :length]


def _greedy(
    model: torch.nn.Module, ids: torch.Tensor, steps: int, generate_kwargs: dict[str, Any]
) -> None:
    """``generate`` exactly ``steps`` greedy tokens after ``ids`` (no padding), under no_grad."""
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            **generate_kwargs,
        )


class _Growing:
    """Variants that compile one more from a call none of them serves."""

    def __init__(
        self,
        variants: list[PrecompiledArtifact],
        compile_call: Callable[[dict[str, Any]], PrecompiledArtifact],
    ) -> None:
        self.variants = variants
        self.compile_call = compile_call
        self.bundle = Precompile.precompile(variants)

    def __call__(self, **kwargs: Any) -> Any:
        try:
            return self.bundle(**kwargs)
        except GuardError:
            # A copy: compiling runs the forward, which updates the cache in place.
            self.variants.append(self.compile_call(copy.deepcopy(kwargs)))
            self.bundle = Precompile.precompile(self.variants)
            return self.variants[-1](**kwargs)


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a forward call's arguments (a cache's, in its layers)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
    elif depth < 4 and hasattr(value, "__dict__") and not isinstance(value, type):
        for v in vars(value).values():
            yield from _tensors(v, depth + 1)


def _static_sizes(
    model: torch.nn.Module, row: torch.Tensor, generate_kwargs: dict[str, Any]
) -> set[int]:
    """Sizes that do not follow the prompt: the weights', and those of every tensor
    ``generate`` passes to forward at two prompt lengths (heads, head dimension)."""
    sizes = {int(d) for t in (*model.parameters(), *model.buffers()) for d in t.shape}
    seen = []
    for extra in (0, 5):
        ids = _repeated(row, row.shape[1] + extra)
        calls = forward_calls(model, ids, new_tokens=2, **generate_kwargs)
        seen.append({int(d) for call in calls for t in _tensors(call) for d in t.shape})
    return sizes | (seen[0] & seen[1])


@contextlib.contextmanager
def _no_auto_compile(model: torch.nn.Module) -> Iterator[None]:
    """transformers' ``generate`` compiles the forward with ``torch.compile`` when
    the cache is a static one on a GPU; the forward here is an artifact (or a spy
    of the arguments): nothing to compile, and Dynamo cannot trace it."""
    config = getattr(model, "generation_config", None)
    if config is None:
        yield
        return
    had = "disable_compile" in vars(config)
    previous = getattr(config, "disable_compile", None)
    config.disable_compile = True
    try:
        yield
    finally:
        if had:
            config.disable_compile = previous
        else:
            vars(config).pop("disable_compile", None)


@contextlib.contextmanager
def generate_with(model: torch.nn.Module, artifact: PrecompiledArtifact) -> Iterator[None]:
    """Within the block, ``model(...)`` and ``model.generate(...)`` run on ``artifact``.

    ``artifact`` computes with its own weights: load it with
    ``Precompile.load(path, model=model)`` for the model's, or standalone for
    the file's. The model's own forward is back after the block.
    """

    expected = _cache_class(artifact)

    def forward(*args: Any, **kwargs: Any) -> Any:
        _check_cache(expected, kwargs.get("past_key_values"))
        kwargs = _with_mask(kwargs)
        ids = kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[1] > 1:
            with not_recorded():  # a prefill: no CUDA graph a prompt length (lean/cudagraphs.py)
                return artifact(*args, **kwargs)
        return artifact(*args, **kwargs)

    with swapped_forward(model, _signed(forward, model.forward)), _no_auto_compile(model):
        yield


def _with_mask(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with an ``attention_mask``: ``generate`` leaves out a mask of ones (no
    padding), and passes a left-padded batch's; one program serves both with the
    mask an input (ones over the cache and the new tokens, as eager's default)."""
    if kwargs.get("attention_mask") is not None or "input_ids" not in kwargs:
        return kwargs
    ids = kwargs["input_ids"]
    cache = kwargs.get("past_key_values")
    past = int(cache.get_seq_length()) if cache is not None else 0
    mask = torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long, device=ids.device)
    return {**kwargs, "attention_mask": mask}


def _signed(fn: Any, forward: Any) -> Any:
    """``fn`` with ``forward``'s signature: ``generate`` reads the forward's parameters to
    decide what to pass (``position_ids`` built from the mask, ``logits_to_keep``), and
    without them a left-padded row gets the positions of an unpadded one."""
    fn.__signature__ = inspect.signature(forward)
    return fn


def _cache_class(artifact: PrecompiledArtifact) -> str | None:
    """The class of ``past_key_values`` the artifact's variants were captured with
    (by name, as their guards describe the example call)."""
    for variant in artifact.variants or (artifact,):
        parameters = variant.signature.parameters or {}
        keywords = parameters.get("kwargs", {})
        call = {
            **parameters,
            **(keywords.get("dict", {}) if isinstance(keywords, dict) else {}),
        }
        desc = call.get("past_key_values")
        if isinstance(desc, dict) and (desc.get("object") or desc.get("dataclass")):
            return desc.get("object") or desc.get("dataclass")
    return None


def _check_cache(expected: str | None, cache: Any) -> None:
    """Refuse a cache of another class than the artifact's, naming both."""
    if expected is None or cache is None or type(cache).__qualname__ == expected:
        return
    given = type(cache).__qualname__
    hint = (
        'pass cache_implementation="static" to generate'
        if "Static" in expected
        else "call generate without cache_implementation"
    )
    raise GuardError(
        f"the artifact was built for a {expected} cache, generate gave a {given}: {hint}, "
        f"or build again with compile_for_generation(..., cache_implementation=...) for "
        f"the {given}"
    )
