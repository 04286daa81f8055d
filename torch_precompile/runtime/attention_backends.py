"""The attention kernels a generator's prefill is built with on a GPU: any but cuDNN's.

``scaled_dot_product_attention`` picks its kernel when the step is traced, and
the choice is built into the file. On an H200 (torch 2.11) it picked cuDNN's,
which builds a plan for each new sequence length at its first call: the first
call of each new prompt length took 50-80 ms on a four-layer Llama-3.2-3B shape,
against 8-15 ms with the memory-efficient kernel picked instead, and the same
2-3 ms after (docs/measurements.md, "The prefill's attention and the rotary
product"). A server meets every prompt length. So a prefill is traced with the
backends the process has enabled, cuDNN's left out; where cuDNN's is the only
one enabled, that is the caller's choice, and it is kept. A decode step's
attention reads a cache of one fixed length, and is left as torch picks it. The
warm-up (``warm.py``) runs the prefill's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def without_cudnn(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """Attention on ``device`` with the enabled backends but cuDNN's (a no-op off CUDA,
    when cuDNN's is not enabled, or when it is the only one enabled)."""
    if torch.device(device).type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return contextlib.nullcontext()
    enabled = [
        backend
        for backend, on in (
            (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
            (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
            (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
        )
        if on
    ]
    return sdpa_kernel(enabled) if enabled else contextlib.nullcontext()


def tracing_attention(
    device: torch.device | str, prefill: bool
) -> contextlib.AbstractContextManager[Any]:
    """The backends a step is traced with: a prefill's without cuDNN's (it meets every
    prompt length), a decode step's as torch picks (one fixed cache length)."""
    return without_cudnn(device) if prefill else contextlib.nullcontext()
