"""CUDA's lazy set-up for a generator, done while its weights stream in.

A process's first ``generate`` on a GPU pays once for what CUDA and its
libraries set up at first use: cuBLAS's handle at the first matmul, the
attention kernel's at the first attention, and each of torch's own
kernels the decode loop launches (``masked_fill_``, ``where``, ``argmax``,
...), loaded from its module at its first launch, about 10 ms apiece. On an
H200 that was 0.52 s of the first token of a Llama-3.2-3B-shaped generator
(four layers, torch.profiler: ``aten::mm`` 166 ms, cuDNN attention 69 ms, the
loop's kernels the rest; files built since use no cuDNN attention,
``attention_backends.py``), after a load that reads no weight into any of it.

The warm-up (:data:`PARTS`) does that set-up on a stand-in: a matmul, an
``addmm``, a batched matmul and an attention in the generator's dtype and head
size, then the decode loop itself, greedy and sampled, around a step that returns zeros (a
cache of one row and a few positions). It reads no weight, so it runs beside
the load (:func:`beside_load`: the libraries on one thread, the loop on
another), and on after it: the loaded generator's prefill does not wait for it,
its first decode step does (a CUDA graph's capture must not meet another thread's
allocations or synchronisations), and so does any other call of its step. The
threads are not daemons: a process that ends at once waits for them rather than
exit under their CUDA calls. It leaves behind only what CUDA keeps (loaded
kernels, handles); a failure is logged, never raised, and the first call then
sets up what the warm-up did not. Off a GPU there is nothing to gain and it does
not run.

On by default on CUDA; ``TORCH_PRECOMPILE_WARM_UP=0`` turns it off. Measured on an
H200 (docs/measurements.md, "The first token's lazy set-up"; fresh processes, medians
of 3 to 5 in three runs): a Llama-3.2-3B-shaped generator's first token came 0.17-0.23
s sooner (floor + 1.35-1.54 s without, + 1.12-1.36 s with), a Qwen2.5-0.5B's 0.08 s.
The load itself takes about 0.1 s longer (the threads share the host), and from its
end to the first token went from 0.5 to 0.2 s. Since the prefill runs beside the
warm-up, a four-layer 3B's first token comes 0.05 s sooner and its load 0.1-0.2 s
("The prefill no longer waits for the warm-up").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import torch

from ..file import trace as _trace
from .attention_backends import without_cudnn
from .generator import Generator
from .generator_spec import GeneratorSpec

log = logging.getLogger("torch_precompile")

# The device types whose lazy set-up the warm-up runs (measured on CUDA only).
WARMED = ("cuda",)
# The loop's runs: greedy, then sampled with every warper a default request uses.
RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("greedy", {"do_sample": False}),
    ("sampled", {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "seed": 0}),
)
_POSITIONS = 4  # the stand-in's cache: a prompt of 2, and 2 new tokens


def beside_load(spec: GeneratorSpec) -> list[threading.Thread]:
    """The warm-up of ``spec``'s device, started on threads (the generator joins them
    before a step that may record): the libraries on one, the decode loop on another,
    as their set-up overlaps. On a GPU only, unless ``TORCH_PRECOMPILE_WARM_UP=0``."""
    if os.environ.get("TORCH_PRECOMPILE_WARM_UP") == "0":
        return []
    if torch.device(spec.device).type not in WARMED:
        return []
    threads = [
        threading.Thread(
            target=_logged, args=(part, spec), name=f"torch_precompile-warm-up-{part}", daemon=False
        )
        for part in PARTS
    ]
    for thread in threads:
        thread.start()
    return threads


def _logged(part: str, spec: GeneratorSpec) -> None:
    try:
        seconds = PARTS[part](spec)
    except Exception as exc:  # the first call sets up what this did not
        log.debug(
            "generator warm-up (%s) on %s stopped: %s: %s",
            part,
            spec.device,
            type(exc).__name__,
            exc,
        )
    else:
        log.debug("generator warm-up (%s) on %s: %s", part, spec.device, seconds)
        _trace.record("phase", f"warm-up {part}", 0, sum(seconds.values()))


def warm_libraries(spec: GeneratorSpec) -> dict[str, float]:
    """The first matmuls (cuBLAS) and attention (the kernel torch picks for the step's
    dtype and head size, cuDNN's left out as in the build)."""
    device = torch.device(spec.device)
    heads, dim = spec.kv_shapes[0] if spec.kv_shapes else (1, 64)
    began = time.perf_counter()
    with torch.no_grad():
        _libraries(device, getattr(torch, spec.dtype), heads, dim)
    return {"libraries": _lap(device, began)}


def warm_loop(spec: GeneratorSpec) -> dict[str, float]:
    """The decode loop on a stand-in step, once for each of :data:`RUNS`."""
    device = torch.device(spec.device)
    dtype = getattr(torch, spec.dtype)
    small = dataclasses.replace(spec, max_batch=1, max_length=_POSITIONS)
    generator = Generator(_StandInStep(_vocab(spec), dtype, device), small)
    ids = torch.ones((1, _POSITIONS // 2), dtype=torch.long, device=device)
    seconds = {}
    for name, settings in RUNS:
        began = time.perf_counter()
        generator.generate(ids, max_new_tokens=_POSITIONS // 2, min_new_tokens=1, **settings)
        seconds[name] = _lap(device, began)
    return seconds


PARTS = {"libraries": warm_libraries, "loop": warm_loop}


def _libraries(device: torch.device, dtype: torch.dtype, heads: int, dim: int) -> None:
    x = torch.ones((8, dim), dtype=dtype, device=device)
    w = torch.ones((dim, dim), dtype=dtype, device=device)
    torch.mm(x, w)
    torch.addmm(w[0], x, w)
    torch.bmm(x[None], w[None])
    q = torch.ones((1, heads, 8, dim), dtype=dtype, device=device)
    causal = torch.ones((8, 8), dtype=torch.bool, device=device).tril()
    with without_cudnn(device):  # as the steps were built
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=causal)


def _vocab(spec: GeneratorSpec) -> int:
    """A vocabulary that holds every token id the loop indexes with (end of sequence, pad)."""
    ids = [*spec.eos_token_id, spec.pad_token_id or 0]
    return max(64, max(ids) + 1)


def _lap(device: torch.device, began: float) -> float:
    """Seconds since ``began``, this thread's kernels done. Its stream only: a device-wide
    synchronize would also wait for the load's weight copies, on their own streams."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter() - began


class _StandInStep:
    """A step of the generator's signature that reads no weight: zero logits."""

    def __init__(self, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        self.vocab, self.dtype, self.device = vocab, dtype, device

    def __call__(self, ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return torch.zeros((ids.shape[0], 1, self.vocab), dtype=self.dtype, device=self.device)
