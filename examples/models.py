"""Reference models for the examples, tests and benchmarks of torch_precompile.

Plain PyTorch, no dependency on torch_precompile. Every model is written the way
users write real models, is deterministic to build under ``torch.manual_seed``,
and is captured by Dynamo as one graph (``torch.compile(..., fullgraph=True)``):
no ``.item()``, no data-dependent Python control flow, no prints in ``forward``.
Each is small enough for Inductor to compile in seconds on a 2-core CPU.

Models (``nn.Module``):

- ``TinyTransformer``: "the transformer" of the project; token + learned
  positional embeddings, pre-LN blocks with hand-written multi-head attention
  (``F.scaled_dot_product_attention``) and a GELU MLP, final LayerNorm, linear
  head. Holds a ``pos_ids`` buffer.
- ``ConvNet``: conv-BN-ReLU-conv-BN with a residual add, pooling, linear head.
- ``GPTDecoder``: GPT-style causal decoder with a registered ``tril`` mask
  buffer and a weight-tied head; any batch 1..8 and sequence length 1..128.
- ``BertEncoder``: BERT-style encoder taking ``attention_mask`` and
  ``token_type_ids`` keyword arguments, returning the ``EncoderOutput``
  dataclass.
- ``ResNetSmall``: ResNet-style CNN of three ``BasicBlock``s.
- ``MLPMixer``: patch embedding and two token-/channel-mixing layers.
- ``DecoratedModel``: ``forward`` wrapped by a HuggingFace-style decorator that
  inspects its arguments, reads a ``ModelConfig`` and returns a ``ModelOutput``
  (an ``OrderedDict`` subclass).
- ``DataclassOutputModel``: returns the ``MultiOutput`` dataclass with a nested
  dict/list field.
- ``DropoutMLP``: Linear-GELU-Dropout-Linear, for training tests.
- ``ContextManagerModel``: ``torch.no_grad()`` and bfloat16 autocast inside
  ``forward``.
- ``TinyMLP``: two 64-wide Linear layers, for per-call overhead (cold-start benchmark).
- ``KVCacheStep``: one attention decoding step writing a static KV cache and a
  step counter (buffers) in place.

Callables (not modules):

- ``nested_fn(x, y, *, scale=1.0, bias=None)``: keyword arguments, nested output.
- ``make_closure(weight)``: a closure capturing a tensor and a float.
- ``scalar_fn(x, alpha, n, flag)``: Python scalars as arguments.
- ``view_outputs(x, scale)``: returns its input and views of it; doubles
  ``scale`` in place.

Each has a ``build_<name>()`` returning ``(model_or_fn, example_args,
example_kwargs)`` built under ``torch.manual_seed(0)``, in ``eval()`` mode
unless the builder's name ends in ``_train``. ``BUILDERS`` maps every builder's
short name to the builder.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BUILDERS",
    "BasicBlock",
    "BertEncoder",
    "ContextManagerModel",
    "ConvNet",
    "DataclassOutputModel",
    "DecoratedModel",
    "DropoutMLP",
    "EncoderOutput",
    "GPTDecoder",
    "MLPMixer",
    "ModelConfig",
    "ModelOutput",
    "MultiOutput",
    "ResNetSmall",
    "TinyMLP",
    "TinyTransformer",
    "build_bert",
    "build_closure",
    "build_context_managers",
    "build_convnet",
    "build_dataclass_output",
    "build_decorated",
    "build_dropout_mlp",
    "build_dropout_mlp_train",
    "build_gpt",
    "build_mlp_mixer",
    "build_nested_fn",
    "build_resnet",
    "build_scalar_fn",
    "build_tiny_mlp",
    "build_transformer",
    "image_inputs",
    "make_closure",
    "nested_fn",
    "scalar_fn",
    "transformer_inputs",
]

Built = tuple[Any, tuple[Any, ...], dict[str, Any]]


# ---------------------------------------------------------------------------
# Shared transformer pieces
# ---------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Multi-head self-attention with hand-written q/k/v projections."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def _split(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """Attend over ``x`` (batch, seq, d_model); ``attn_mask`` is additive or boolean."""
        b, t, d = x.shape
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.out_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward block: Linear -> GELU -> Linear (-> Dropout)."""

    def __init__(self, d_model: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to the last dimension of ``x``."""
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class PreLNBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model, dropout)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """Run one block on ``x`` (batch, seq, d_model)."""
        x = x + self.attn(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))


# ---------------------------------------------------------------------------
# TinyTransformer
# ---------------------------------------------------------------------------


class TinyTransformer(nn.Module):
    """Small pre-LN transformer language model (the project's reference transformer)."""

    def __init__(
        self,
        vocab: int = 1000,
        d_model: int = 256,
        n_heads: int = 4,
        n_layers: int = 2,
        max_len: int = 128,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.register_buffer("pos_ids", torch.arange(max_len), persistent=True)
        self.blocks = nn.ModuleList(PreLNBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        """Map token ids (batch, seq) to logits (batch, seq, vocab)."""
        seq = ids.shape[1]
        x = self.tok_emb(ids) + self.pos_emb(self.pos_ids[:seq])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def transformer_inputs(batch: int = 2, seq: int = 32, vocab: int = 1000) -> Tensor:
    """Random token ids of shape (batch, seq) for TinyTransformer / GPTDecoder."""
    return torch.randint(0, vocab, (batch, seq))


def build_transformer() -> Built:
    """TinyTransformer (2 blocks, d=256) in eval mode with ids of shape (2, 32)."""
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    return model, (transformer_inputs(),), {}


# ---------------------------------------------------------------------------
# ConvNet
# ---------------------------------------------------------------------------


def image_inputs(batch: int = 2, channels: int = 3, size: int = 32) -> Tensor:
    """Random images of shape (batch, channels, size, size)."""
    return torch.randn(batch, channels, size, size)


class ConvNet(nn.Module):
    """Conv -> BN -> ReLU -> conv -> BN, residual add, pooling, linear head."""

    def __init__(self, channels: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Classify images (N, 3, H, W) into logits (N, num_classes)."""
        x = self.stem(x)
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        x = F.relu(x + h)
        return self.fc(torch.flatten(self.pool(x), 1))


def build_convnet() -> Built:
    """ConvNet in eval mode with images of shape (2, 3, 32, 32)."""
    torch.manual_seed(0)
    model = ConvNet().eval()
    return model, (image_inputs(),), {}


# ---------------------------------------------------------------------------
# GPTDecoder
# ---------------------------------------------------------------------------


class GPTDecoder(nn.Module):
    """GPT-style causal decoder with a tril mask buffer and a weight-tied head."""

    def __init__(
        self,
        vocab: int = 512,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        max_len: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Parameter(torch.zeros(1, max_len, d_model))
        nn.init.normal_(self.pos_emb, std=0.02)
        self.drop = nn.Dropout(dropout)
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)),
            persistent=False,
        )
        self.blocks = nn.ModuleList(PreLNBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying, as in GPT-2

    def forward(self, ids: Tensor) -> Tensor:
        """Map token ids (batch, seq <= max_len) to next-token logits."""
        seq = ids.shape[1]
        x = self.drop(self.tok_emb(ids) + self.pos_emb[:, :seq])
        mask = self.causal_mask[:seq, :seq]
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def build_gpt() -> Built:
    """GPTDecoder in eval mode with ids of shape (2, 16)."""
    torch.manual_seed(0)
    model = GPTDecoder().eval()
    return model, (transformer_inputs(batch=2, seq=16, vocab=512),), {}


# ---------------------------------------------------------------------------
# BertEncoder
# ---------------------------------------------------------------------------


@dataclass
class EncoderOutput:
    """What BertEncoder returns: per-token states and the pooled [CLS] state."""

    last_hidden_state: Tensor
    pooled: Tensor


class BertLayer(nn.Module):
    """Post-LN encoder layer as in BERT: LN(x + attn(x)), then LN(x + ffn(x))."""

    def __init__(self, d_model: int, n_heads: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.attn_drop = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(d_model, eps=1e-12)
        self.ffn = MLP(d_model, hidden, dropout)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:
        """Run one encoder layer with an additive mask broadcastable to the scores."""
        x = self.ln1(x + self.attn_drop(self.attn(x, attn_mask)))
        return self.ln2(x + self.ffn(x))


class BertEncoder(nn.Module):
    """BERT-style encoder with padding mask, token types and a tanh pooler."""

    def __init__(
        self,
        vocab: int = 1000,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 2,
        max_len: int = 128,
        type_vocab: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d_model, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_len, d_model)
        self.token_type_embeddings = nn.Embedding(type_vocab, d_model)
        self.register_buffer("position_ids", torch.arange(max_len).unsqueeze(0))
        self.emb_ln = nn.LayerNorm(d_model, eps=1e-12)
        self.emb_drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            BertLayer(d_model, n_heads, 4 * d_model, dropout) for _ in range(n_layers)
        )
        self.pooler = nn.Linear(d_model, d_model)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> EncoderOutput:
        """Encode ids (batch, seq); ``attention_mask`` is 1 for tokens, 0 for padding."""
        seq = input_ids.shape[1]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(self.position_ids[:, :seq])
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.emb_drop(self.emb_ln(x))
        # (batch, seq) of 0/1 -> (batch, 1, 1, seq) of 0 / large negative, as HF does.
        dtype = x.dtype
        extended = attention_mask[:, None, None, :].to(dtype)
        additive = (1.0 - extended) * torch.finfo(dtype).min
        for layer in self.layers:
            x = layer(x, additive)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return EncoderOutput(last_hidden_state=x, pooled=pooled)


def build_bert() -> Built:
    """BertEncoder in eval mode: ids (2, 24) with a padding mask and token types."""
    torch.manual_seed(0)
    model = BertEncoder().eval()
    batch, seq = 2, 24
    input_ids = torch.randint(1, 1000, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, 16:] = 0  # second sequence is padded
    input_ids = input_ids * attention_mask
    token_type_ids = torch.zeros(batch, seq, dtype=torch.long)
    token_type_ids[:, seq // 2 :] = 1
    kwargs = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
    return model, (input_ids,), kwargs


# ---------------------------------------------------------------------------
# ResNetSmall
# ---------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn plus (projected) shortcut."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to feature maps (N, in_ch, H, W)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetSmall(nn.Module):
    """Small ResNet for 32x32 images: stem and three BasicBlocks (16, 32, 64 ch)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
        )
        self.layers = nn.Sequential(
            BasicBlock(16, 16),
            BasicBlock(16, 32, stride=2),
            BasicBlock(32, 64, stride=2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Classify images (N, 3, 32, 32) into logits (N, num_classes)."""
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_resnet() -> Built:
    """ResNetSmall in eval mode with images of shape (2, 3, 32, 32)."""
    torch.manual_seed(0)
    model = ResNetSmall().eval()
    return model, (image_inputs(),), {}


# ---------------------------------------------------------------------------
# MLPMixer
# ---------------------------------------------------------------------------


class MixerLayer(nn.Module):
    """One Mixer layer: token-mixing MLP across patches, then channel-mixing MLP."""

    def __init__(self, num_patches: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.ln_token = nn.LayerNorm(dim)
        self.token_mlp = MLP(num_patches, token_hidden)
        self.ln_channel = nn.LayerNorm(dim)
        self.channel_mlp = MLP(dim, channel_hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Mix ``x`` (batch, patches, dim) across patches and then across channels."""
        y = self.ln_token(x).transpose(1, 2)  # (batch, dim, patches)
        x = x + self.token_mlp(y).transpose(1, 2)
        return x + self.channel_mlp(self.ln_channel(x))


class MLPMixer(nn.Module):
    """MLP-Mixer for 32x32 images: 4x4 patches, two mixer layers, linear head."""

    def __init__(
        self,
        image_size: int = 32,
        patch: int = 4,
        dim: int = 128,
        n_layers: int = 2,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        num_patches = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.layers = nn.ModuleList(
            MixerLayer(num_patches, dim, dim // 2, 4 * dim) for _ in range(n_layers)
        )
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Classify images (N, 3, 32, 32) into logits (N, num_classes)."""
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (N, patches, dim)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x).mean(dim=1))


def build_mlp_mixer() -> Built:
    """MLPMixer in eval mode with images of shape (2, 3, 32, 32)."""
    torch.manual_seed(0)
    model = MLPMixer().eval()
    return model, (image_inputs(),), {}


# ---------------------------------------------------------------------------
# DecoratedModel (HuggingFace-style)
# ---------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Configuration object read inside ``forward``, as HF models read ``self.config``."""

    hidden_size: int = 64
    num_labels: int = 4
    use_residual: bool = True
    return_dict: bool = True
    output_hidden_states: bool = False


class ModelOutput(OrderedDict):
    """Output container like HF's ``ModelOutput``: a dict with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_tuple(self) -> tuple[Any, ...]:
        """The values in insertion order."""
        return tuple(self.values())


class ClassifierOutput(ModelOutput):
    """``DecoratedModel``'s output: ``logits`` and ``hidden`` (and optional extras)."""


def handle_return_dict(forward: Callable[..., ModelOutput]) -> Callable[..., Any]:
    """Decorator in the style of HF's ``can_return_tuple``: honour ``return_dict=``.

    It binds the call to ``forward``'s signature to validate the arguments, takes
    ``return_dict`` out of the keyword arguments (falling back to
    ``self.config.return_dict``) and turns the ``ModelOutput`` into a tuple when
    asked.
    """
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # A filtered copy rather than kwargs.pop: Dynamo refuses to read the
        # signature's mapping proxy once any dict has been mutated in the frame.
        forward_kwargs = {k: v for k, v in kwargs.items() if k != "return_dict"}
        signature.bind(self, *args, **forward_kwargs)  # TypeError on a bad call
        return_dict = kwargs.get("return_dict")
        if return_dict is None:
            return_dict = self.config.return_dict
        output = forward(self, *args, **forward_kwargs)
        if not return_dict:
            return output.to_tuple()
        return output

    return wrapper


class DecoratedModel(nn.Module):
    """Two-layer classifier whose decorated ``forward`` reads ``self.config``."""

    def __init__(self, config: ModelConfig | None = None, in_features: int = 32) -> None:
        super().__init__()
        self.config = config if config is not None else ModelConfig()
        hidden = self.config.hidden_size
        self.proj = nn.Linear(in_features, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.classifier = nn.Linear(hidden, self.config.num_labels)

    @handle_return_dict
    def forward(self, x: Tensor, mask: Tensor | None = None) -> ClassifierOutput:
        """Classify features (batch, in_features); ``mask`` (batch,) zeroes rows."""
        h = self.proj(x)
        out = F.gelu(self.dense(h))
        if self.config.use_residual:
            out = out + h
        out = self.norm(out)
        if mask is not None:
            out = out * mask.unsqueeze(-1).to(out.dtype)
        logits = self.classifier(out)
        if self.config.output_hidden_states:
            return ClassifierOutput(logits=logits, hidden=out, hidden_states=(h, out))
        return ClassifierOutput(logits=logits, hidden=out)


def build_decorated() -> Built:
    """DecoratedModel in eval mode: x (4, 32), mask (4,) and ``return_dict=True``."""
    torch.manual_seed(0)
    model = DecoratedModel().eval()
    x = torch.randn(4, 32)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    return model, (x,), {"mask": mask, "return_dict": True}


# ---------------------------------------------------------------------------
# DataclassOutputModel
# ---------------------------------------------------------------------------


@dataclass
class MultiOutput:
    """Two tensors and a nested container of tensors."""

    logits: Tensor
    features: Tensor
    extras: dict[str, list[Tensor]] = field(default_factory=dict)


class DataclassOutputModel(nn.Module):
    """Small MLP returning a ``MultiOutput`` dataclass with nested extras."""

    def __init__(self, in_features: int = 16, hidden: int = 32, out: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        self.head = nn.Linear(hidden, out)

    def forward(self, x: Tensor) -> MultiOutput:
        """Encode ``x`` (batch, in_features) and return logits, features and extras."""
        features = F.relu(self.encoder(x))
        logits = self.head(features)
        extras = {
            "stats": [features.mean(dim=-1), features.std(dim=-1)],
            "probs": [logits.softmax(dim=-1)],
        }
        return MultiOutput(logits=logits, features=features, extras=extras)


def build_dataclass_output() -> Built:
    """DataclassOutputModel in eval mode with x of shape (3, 16)."""
    torch.manual_seed(0)
    model = DataclassOutputModel().eval()
    return model, (torch.randn(3, 16),), {}


# ---------------------------------------------------------------------------
# DropoutMLP
# ---------------------------------------------------------------------------


class DropoutMLP(nn.Module):
    """Linear -> GELU -> Dropout(0.1) -> Linear; the model of the training tests."""

    def __init__(self, in_features: int = 32, hidden: int = 64, out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: Tensor) -> Tensor:
        """Map x (batch, in_features) to logits (batch, out)."""
        return self.fc2(self.drop(F.gelu(self.fc1(x))))


def build_dropout_mlp() -> Built:
    """DropoutMLP in eval mode (dropout off) with x of shape (8, 32)."""
    torch.manual_seed(0)
    model = DropoutMLP().eval()
    return model, (torch.randn(8, 32),), {}


class TinyMLP(nn.Module):
    """Linear(64, 64) -> ReLU -> Linear(64, 64): so small that per-call overhead dominates."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        """Map x (batch, width) to (batch, width)."""
        return self.fc2(F.relu(self.fc1(x)))


def build_tiny_mlp() -> Built:
    """TinyMLP (64 wide) in eval mode with x of shape (8, 64), for the cold-start benchmark."""
    torch.manual_seed(0)
    model = TinyMLP().eval()
    return model, (torch.randn(8, 64),), {}


def build_dropout_mlp_train() -> Built:
    """DropoutMLP in train mode (dropout on) with x of shape (8, 32)."""
    torch.manual_seed(0)
    model = DropoutMLP().train()
    return model, (torch.randn(8, 32),), {}


class KVCacheStep(nn.Module):
    """One decoding step of an attention layer with a static KV cache.

    ``forward(x, pos)`` writes this step's keys and values into the cache
    buffers at ``pos`` in place (as a static KV cache does), counts the steps
    in a buffer, and attends over the cache up to ``pos``.
    """

    def __init__(self, dim: int = 32, max_len: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("k_cache", torch.zeros(1, max_len, dim))
        self.register_buffer("v_cache", torch.zeros(1, max_len, dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("positions", torch.arange(max_len))

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        """x (1, 1, dim) at position pos (a 1-element long tensor) to (1, 1, dim)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        self.k_cache.index_copy_(1, pos, k)
        self.v_cache.index_copy_(1, pos, v)
        self.steps.add_(1)
        mask = self.positions <= pos
        att = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.out(att)


def build_kv_cache_step() -> Built:
    """KVCacheStep (32 wide, 16 positions) in eval mode with one token at position 0."""
    torch.manual_seed(0)
    model = KVCacheStep().eval()
    return model, (torch.randn(1, 1, 32), torch.tensor([0])), {}


def build_convnet_train() -> Built:
    """ConvNet in train mode (BatchNorm updates its running statistics in place)."""
    torch.manual_seed(0)
    model = ConvNet().train()
    return model, (image_inputs(),), {}


# ---------------------------------------------------------------------------
# Plain callables
# ---------------------------------------------------------------------------


def nested_fn(
    x: Tensor, y: Tensor, *, scale: float = 1.0, bias: Tensor | None = None
) -> dict[str, Any]:
    """Keyword-only arguments in, ``{"sum": t, "parts": [a, (b, c)]}`` out."""
    a = x * scale
    if bias is not None:
        a = a + bias
    b = torch.sin(y)
    c = torch.relu(x - y)
    return {"sum": a + b + c, "parts": [a, (b, c)]}


def build_nested_fn() -> Built:
    """``nested_fn`` with x, y of shape (4, 8), ``scale=2.0`` and a bias of shape (8,)."""
    torch.manual_seed(0)
    x, y, bias = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    return nested_fn, (x, y), {"scale": 2.0, "bias": bias}


def make_closure(weight: Tensor) -> Callable[[Tensor], Tensor]:
    """A closure over the tensor ``weight`` and the float ``factor``."""
    factor = 0.5 * math.sqrt(2.0)

    def f(x: Tensor) -> Tensor:
        return torch.tanh(x @ weight) * factor

    return f


def build_closure() -> Built:
    """``make_closure`` over a (8, 4) weight, called with x of shape (3, 8)."""
    torch.manual_seed(0)
    weight = torch.randn(8, 4)
    return make_closure(weight), (torch.randn(3, 8),), {}


def view_outputs(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Outputs that are the input, views of it (a transpose, a row, a dtype view)
    and a new tensor; ``scale`` is doubled in place."""
    scale.mul_(2)
    return x, x.t(), x[1], x.view(torch.int32), torch.relu(x) * scale


def build_view_outputs() -> Built:
    """``view_outputs`` with x of shape (4, 8) and a scale of shape (8,)."""
    torch.manual_seed(0)
    return view_outputs, (torch.randn(4, 8), torch.rand(8)), {}


def scalar_fn(x: Tensor, alpha: float, n: int, flag: bool) -> Tensor:
    """Python scalars as arguments: a float, an int and a bool that picks a branch."""
    if flag:
        return x * alpha + n
    return (x - n) / alpha


def build_scalar_fn() -> Built:
    """``scalar_fn`` with x of shape (5,), ``alpha=0.5``, ``n=3``, ``flag=True``."""
    torch.manual_seed(0)
    return scalar_fn, (torch.randn(5), 0.5, 3, True), {}


# ---------------------------------------------------------------------------
# ContextManagerModel (no_grad and autocast inside forward)
# ---------------------------------------------------------------------------


class ContextManagerModel(nn.Module):
    """``torch.no_grad()`` and CPU bfloat16 autocast inside ``forward``, as library code does.

    A frozen projection runs under ``no_grad``; the MLP runs under autocast and
    its result is cast back to float32.
    """

    def __init__(self, in_features: int = 32, hidden: int = 64, out: int = 8) -> None:
        super().__init__()
        self.frozen = nn.Linear(in_features, in_features)
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` (batch, in_features) with the frozen layer, then the MLP in bf16."""
        with torch.no_grad():
            x = F.layer_norm(self.frozen(x), (x.shape[-1],))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc2(F.gelu(self.fc1(x)))
        return h.float()


def build_context_managers() -> Built:
    """ContextManagerModel in eval mode with x of shape (4, 32)."""
    torch.manual_seed(0)
    model = ContextManagerModel().eval()
    return model, (torch.randn(4, 32),), {}


BUILDERS: dict[str, Callable[[], Built]] = {
    "transformer": build_transformer,
    "convnet": build_convnet,
    "gpt": build_gpt,
    "bert": build_bert,
    "resnet": build_resnet,
    "mlp_mixer": build_mlp_mixer,
    "decorated": build_decorated,
    "dataclass_output": build_dataclass_output,
    "dropout_mlp": build_dropout_mlp,
    "dropout_mlp_train": build_dropout_mlp_train,
    "nested_fn": build_nested_fn,
    "closure": build_closure,
    "scalar_fn": build_scalar_fn,
    "context_managers": build_context_managers,
    "tiny_mlp": build_tiny_mlp,
    "kv_cache_step": build_kv_cache_step,
    "convnet_train": build_convnet_train,
    "view_outputs": build_view_outputs,
}
"""Every builder by short name; each returns ``(model_or_fn, args, kwargs)``."""
