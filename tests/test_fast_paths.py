"""PyTorch's inference fast paths for transformer modules, against eager at every position.

In eval mode without grad, ``nn.TransformerEncoder(enable_nested_tensor=True)``
given a ``src_key_padding_mask`` computes on a nested tensor and returns zeros
at the padded positions; a traced forward does not, so capture refuses it.
``TransformerEncoderLayer``'s and ``MultiheadAttention``'s own fast paths
(``_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``) trace to
the same numbers as eager's at every position, padded ones included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_precompile import CaptureError, Precompile

D, HEADS = 8, 2


def _layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(D, HEADS, 16, dropout=0.0, batch_first=True)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(2, 5, D)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # row 1: 2 padded positions
    return x, mask


class Encoder(nn.Module):
    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoder(_layer(), 2, enable_nested_tensor=nested)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(x, src_key_padding_mask=mask)


class FastPaths(nn.Module):
    """A layer and an attention that take their fast paths in eager, with padding masks."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = _layer()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = self.layer(x, src_key_padding_mask=mask)
        attn, _ = self.attn(x, x, x, key_padding_mask=mask, need_weights=False)
        weighted, _ = self.attn(x, x, x, key_padding_mask=mask)
        return layer, attn, weighted


def _refusal(model: nn.Module) -> str:
    x, mask = _inputs()
    with torch.no_grad(), pytest.raises(CaptureError) as info:
        Precompile.dynamo(model.eval(), (x, mask))
    return str(info.value)


def test_nested_tensor_encoder_is_refused_with_the_reason_and_fix() -> None:
    model = Encoder(nested=True).eval()
    x, mask = _inputs()
    with torch.no_grad():
        eager = model(x, mask)
    assert eager[1, 3:].abs().max() == 0  # the nested path's zeros, which a trace lacks
    message = _refusal(model)
    for part in (
        "model.encoder is an nn.TransformerEncoder",
        "zeros at the padded positions",
        "enable_nested_tensor=False",
        "model.encoder.use_nested_tensor = False",
    ):
        assert part in message, message


def test_nn_transformer_with_nested_encoder_is_refused() -> None:
    """nn.Transformer builds its encoder with the nested path on (batch_first)."""
    model = nn.Transformer(D, HEADS, 1, 1, 16, dropout=0.0, batch_first=True)
    assert "model.encoder is an nn.TransformerEncoder" in _refusal(model)


def test_nested_encoder_outside_its_fast_path_is_captured() -> None:
    """Training mode, or grad on: eager takes the dense path too, so nothing is refused."""
    x, mask = _inputs()
    Precompile.dynamo(Encoder(nested=True).train(), (x, mask))
    model = Encoder(nested=True).eval()
    with torch.no_grad():
        model.encoder.use_nested_tensor = False
        Precompile.dynamo(model, (x, mask))


@pytest.fixture(scope="module")
def compiled() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    encoder, fast = Encoder(nested=False).eval(), FastPaths().eval()
    x, mask = _inputs()

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.fast = encoder, fast

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (self.encoder(x, mask), *self.fast(x, mask))

    model = Both().eval()
    with torch.no_grad():
        artifact = Precompile.compile(model, (x, mask))
    return model, artifact


def test_layer_and_attention_fast_paths_match_eager_at_every_position(
    compiled: tuple[nn.Module, object],
) -> None:
    model, artifact = compiled
    x, mask = _inputs()
    with torch.no_grad():
        eager = model(x, mask)
        got = artifact(x, mask)
    names = ("encoder", "layer", "attention", "attention with weights")
    for name, want, out in zip(names, eager, got, strict=True):
        assert want[1, 3:].abs().max() > 0.1, name  # padded positions hold values in eager
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=name)
