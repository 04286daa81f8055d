"""The step a generator compiles: the model's forward over a static key/value cache
whose tensors are arguments, returning the last position's logits by the model's own
head (its family's logit processing included)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .._errors import CaptureError
from .slots import slot_cache_and_mask, slot_layer_class
from .views import own_copy


class _Step(torch.nn.Module):
    """``(input_ids, attention_mask, position_ids, start, *cache) -> last logits``.

    ``attention_mask`` covers the whole cache, ``(batch, max_length)``;
    ``start`` (a 0-d tensor) is where the tokens go in the cache; ``cache`` is
    keys and values of each layer, ``(batch, heads, max_length, head_dim)``.
    """

    # The slot step's cache layer class (transformers' StaticLayer, one row per slot),
    # read by the trace through type(self): a class attribute, which the file's guards
    # leave to the build, where a global the trace read would be a guard that the
    # serving process (which never makes the class) fails.
    slot_layer: Any = None

    def __init__(self, model: torch.nn.Module, max_length: int) -> None:
        super().__init__()
        self.model = model
        self.head = _head_view(model)  # registered after ``model``: its weights keep their names
        self.max_length = max_length
        type(self).slot_layer = slot_layer_class()  # one class per process

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        start: torch.Tensor,
        *cache: torch.Tensor,
    ) -> torch.Tensor:
        from transformers.cache_utils import Cache

        if start.dim() == 1:  # slots: each row its own offset (generation/slots.py)
            layers, attention_mask = slot_cache_and_mask(
                self.model.config,
                cache,
                start,
                attention_mask,
                self.max_length,
                type(self).slot_layer,
            )
        else:
            layers = _shared_layers(cache, start, self.max_length)
        # The decoder's forward without transformers' output capturing, whose context
        # variable the compiled code would otherwise write back (a read of the
        # library at serve time); the head on the last position only.
        decoder = self.model.get_decoder()
        hidden = inspect.unwrap(type(decoder).forward)(
            decoder,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=Cache(layers=layers),
            use_cache=True,
        ).last_hidden_state
        # contiguous: a slice of rows whose count may be 1 would branch the head's
        # matmul on it (a guard leaving one row out of a batch dynamic from 1, rows.py)
        return _head_logits(
            self.head, hidden[:, -1:, :].clone(memory_format=torch.contiguous_format)
        )


class _GivenOutput:
    """The decoder output :class:`_Given` returns: the hidden state as ``last_hidden_state``
    (and item 0), ``None`` for whatever else a head reads (caches, attentions, router logits)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state

    def __getattr__(self, name: str) -> None:
        return None


class _Given(torch.nn.Module):
    """Stands for the decoder in :func:`_head_view`: returns the hidden state it is given
    (as ``inputs_embeds``) as the decoder's output."""

    def forward(self, *args: Any, **kwargs: Any) -> _GivenOutput:
        return _GivenOutput(kwargs["inputs_embeds"])


def _head_view(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a ``...ForCausalLM``) with its decoder replaced by :class:`_Given`: the
    same weights and attributes, so its own ``forward`` computes the logits from a hidden
    state with the family's own processing (Cohere's ``logit_scale``, Granite's
    ``logits_scaling``, Gemma2's softcapping), not a copy of it. The model is unchanged."""
    decoder = model.get_decoder()
    path = next((n for n, m in model.named_modules() if m is decoder and n), None)
    if path is None:
        raise CaptureError(
            f"{type(model).__name__}: its decoder (get_decoder()) is not one of its "
            "submodules; compile_generator serves a ...ForCausalLM whose decoder is"
        )
    view = own_copy(model)
    parent = view
    *parents, last = path.split(".")  # OPT: model.decoder, each module on the way copied
    for name in parents:
        parent._modules[name] = own_copy(parent._modules[name])
        parent = parent._modules[name]
    parent._modules[last] = _Given()
    return view


def _head_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of ``hidden`` (``(batch, 1, hidden)``, the decoder's last position) by the
    model's own forward over :func:`_head_view`'s stand-in decoder: the decoder runs
    without transformers' output capturing (whose context variable the compiled code
    would write back, a read of the library at serve time), the head as the model's."""
    return type(head).forward(head, inputs_embeds=hidden, use_cache=False).logits


def _shared_layers(cache: tuple[torch.Tensor, ...], start: torch.Tensor, max_length: int) -> list:
    """Static layers over the cache tensors, every row written from one ``start``."""
    from transformers.cache_utils import StaticLayer

    layers = []
    for keys, values in zip(cache[0::2], cache[1::2]):
        layer = StaticLayer(max_length)
        layer.keys, layer.values = keys, values
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.batch_size, layer.num_heads = keys.shape[0], keys.shape[1]
        layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
        layer.cumulative_length = start.clone()  # update() adds to it in place
        layer.is_initialized = True
        layers.append(layer)
    return layers
