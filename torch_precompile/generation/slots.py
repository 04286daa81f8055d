"""The slot decode step: each row of the cache its own offset (continuous batching).

A server keeps one request per row ("slot") of the generator's static cache, as
llama.cpp's server does: a request joins when a row frees, so rows sit at
different positions. The step then takes ``start`` as a ``(batch,)`` tensor:
row ``r``'s new key and value go to cache index ``start[r]`` (in a slot the
cache index is the position: its prompt was prefilled alone from index 0),
and row ``r`` attends to indices ``0..start[r]`` (the last ``window`` of them
in a sliding-window layer). The mask is made by transformers' own mask
function for the model's attention implementation, one per layer type, and
handed to the decoder already built, so no shared position enters it; a row's left
padding (the mask argument's zeros) is masked too, so ``generate``'s padded rows decode
through this step as through the shared one (a CPU build then holds no other decode
program, ``rows.py``).

Families whose forward cannot take such a mask (ALiBi built from a 2-D mask:
Bloom, Falcon) fail :func:`slots_work`'s eager check at build; their
generator is built without slots and ``serve`` refuses it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("torch_precompile")

# The layer types whose mask this module knows how to make (a window or none).
_KINDS = ("full_attention", "sliding_attention")


def slot_cache_and_mask(
    config: Any,
    cache: tuple[torch.Tensor, ...],
    start: torch.Tensor,
    padding: torch.Tensor,
    max_length: int,
    layer_class: Any,
) -> tuple[list[Any], Any]:
    """The cache layers writing each row at its own ``start[row]``, and the decoder's mask
    (``padding``, ``(batch, max_length)``, 0 where an entry is a left pad of the row's
    prompt: ``generate``'s rows; the server's are all 1).

    ``layer_class`` is :func:`slot_layer_class`'s, passed in by the traced step
    (read off its class, which the file's guards leave to the build: a global
    of this module read while tracing would be a guard the serving process,
    which never makes the class, fails).
    """
    layers = [
        _slot_layer(layer_class, keys, values, start, max_length) for keys, values in _pairs(cache)
    ]
    return layers, _slot_mask(config, start, padding, max_length, cache[0].dtype)


def _pairs(cache: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(cache[0::2], cache[1::2]))


_SLOT_LAYER: Any = None


def slot_layer_class() -> Any:
    """``StaticLayer`` whose one new token per row lands at that row's ``start``.

    Made once per process at build (transformers imported then), outside any
    trace: Dynamo reads the class, never defines it.
    """
    global _SLOT_LAYER
    if _SLOT_LAYER is None:
        from transformers.cache_utils import StaticLayer

        class SlotLayer(StaticLayer):
            start: torch.Tensor

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *a, **k):
                # a scatter along the length, not an index_put over (rows, start), whose
                # broadcast of its two indices branches on a batch of 1 (rows.py)
                for cache, new in ((self.keys, key_states), (self.values, value_states)):
                    at = self.start[:, None, None, None].expand(-1, new.shape[1], 1, new.shape[3])
                    cache.scatter_(2, at, new)
                return self.keys, self.values

        _SLOT_LAYER = SlotLayer
    return _SLOT_LAYER


def _slot_layer(
    layer_class: Any, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor, max_length: int
) -> Any:
    layer = layer_class(max_length)
    layer.keys, layer.values, layer.start = keys, values, start
    layer.dtype, layer.device = keys.dtype, keys.device
    layer.batch_size, layer.num_heads = keys.shape[0], keys.shape[1]
    layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
    layer.cumulative_length = start.max()  # read only by get_seq_length
    layer.is_initialized = True
    return layer


def layer_windows(config: Any) -> dict[str, int | None]:
    """Each layer type of the model and its window (``None``: full attention).

    ``layer_types`` as the config lists them; a config without them (Mistral)
    has one kind, sliding where ``sliding_window`` is set. Raises ``ValueError``
    for a kind this step cannot mask (chunked attention, linear attention).
    """
    window = getattr(config, "sliding_window", None)
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or ()))
    if not kinds:
        return {"sliding_attention" if window else "full_attention": window or None}
    unknown = [k for k in kinds if k not in _KINDS]
    if unknown:
        raise ValueError(f"layer types {unknown} have no slot mask")
    return {k: (window if k == "sliding_attention" else None) for k in kinds}


def _slot_mask(
    config: Any, start: torch.Tensor, padding: torch.Tensor, max_length: int, dtype: torch.dtype
) -> Any:
    """One mask (a single layer type) or a dict by layer type, in the format of the
    model's attention implementation (transformers' own mask interface)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    make = ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]

    def mask(window: int | None) -> Any:
        def visible(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
            last = start[batch_idx]
            keep = kv_idx <= last
            return keep & (kv_idx > last - window) if window else keep

        return make(
            batch_size=start.shape[0],
            q_length=1,
            kv_length=max_length,
            q_offset=0,
            kv_offset=0,
            mask_function=visible,
            attention_mask=padding.bool(),
            allow_is_causal_skip=False,
            dtype=dtype,
            config=config,
            device=start.device,
        )

    windows = layer_windows(config)
    if len(windows) == 1:
        return mask(next(iter(windows.values())))
    return {kind: mask(window) for kind, window in windows.items()}


def check_length(config: Any, max_length: int) -> int:
    """A prompt length for the build's check: past the sliding window where there is one."""
    window = getattr(config, "sliding_window", None) or 0
    return max(2, min(max_length - 2, max(12, window + 3)))


@torch.no_grad()
def slots_work(step: torch.nn.Module, shapes: list[tuple[int, int]], dtype: str) -> str | None:
    """Whether the slot decode step computes what the shared step does (eagerly, at build).

    Row 1 is prefilled and decoded one token with the shared ``start``; then
    two rows at different offsets decode one token each in slot mode. Returns
    ``None`` when row 1's logits agree, else why not (the model cannot take
    a per-row mask).
    """
    config = step.model.config
    max_length = step.max_length
    device = next(step.parameters()).device
    n = check_length(config, max_length)
    vocab = int(getattr(config, "vocab_size", 2))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (1, k), generator=g).to(device) for k in (n - 1, n)]
    nxt = torch.randint(0, vocab, (2, 1), generator=g).to(device)

    def blank(rows: int) -> list[torch.Tensor]:
        made = [
            torch.zeros((rows, h, max_length, d), dtype=getattr(torch, dtype)) for h, d in shapes
        ]
        return [t.to(device) for t in made]

    def prefill(ids: torch.Tensor, cache: list[torch.Tensor]) -> None:
        mask = torch.zeros((1, max_length), dtype=torch.long, device=device)
        mask[:, : ids.shape[1]] = 1
        positions = torch.arange(ids.shape[1], device=device)[None]
        step(ids, mask, positions, torch.tensor(0, device=device), *cache)

    try:
        alone = blank(1)
        prefill(prompts[1], alone)
        mask = torch.zeros((1, max_length), dtype=torch.long, device=device)
        mask[:, : n + 1] = 1
        at = torch.tensor([[n]], device=device)
        want = step(nxt[1:], mask, at, torch.tensor(n, device=device), *alone)[0, -1]
        both = blank(2)
        for row, ids in enumerate(prompts):
            prefill(ids, [t[row : row + 1] for t in both])
        start = torch.tensor([n - 1, n], device=device)
        full = torch.ones((2, max_length), dtype=torch.long, device=device)
        got = step(nxt, full, start[:, None], start, *both)[1, -1]
    except Exception as exc:  # the family's forward refused the mask or the cache
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    if not torch.allclose(got.float(), want.float(), atol=1e-3, rtol=1e-3):
        return f"slot logits differ from the shared step's by {(got - want).abs().max():.3g}"
    return None


def slot_example(
    batch: int, max_length: int, shapes: list[tuple[int, int]], dtype: str, device: Any
) -> tuple[Any, ...]:
    """The slot decode step's example call: one token per row, rows at offsets 1..batch."""
    ids = torch.randint(0, 2, (batch, 1), device=device)
    mask = torch.ones((batch, max_length), dtype=torch.long, device=device)
    start = torch.arange(1, batch + 1, device=device)
    positions = start[:, None].clone()
    cache = [
        torch.zeros((batch, h, max_length, d), dtype=getattr(torch, dtype), device=device)
        for h, d in shapes
    ]
    return (ids, mask, positions, start, *cache)
