"""Weight-only quantized views of a model for ``compile_generator(weights=...)``.

Decode reads every weight once a token, so the weights' bytes set its speed. A
view of the model (:func:`quantized_view`; the model itself is unchanged, as in
``views.py``) holds, for each ``nn.Linear`` of the decoder, a small module over
plain tensors that calls torch's own weight-only matmul
(``_compat/quantized_mm.py``): the traced step, and the file, hold int8 or
packed int4 tensors and their scales, and the serving process needs torch alone.

The quantization math is torchao's (imported at build only): its affine
primitives, as its ``Int8WeightOnlyConfig`` (symmetric, one scale per output
channel) and its tinygemm int4 (asymmetric, a float scale and zero per group
of :data:`INT4_GROUP` inputs) compute them. A float32 model's int4 layers on the
CPU hold bfloat16 scales and zeros and run on bfloat16 activations (ATen's
kernel is ten times slower on float32 ones); its int8 layers stay float32, a
decode step's one-row matmul a reduction of Inductor's (``decode_matmul.py``).
``torchao.quantize_`` itself is not used: it swaps weights for torchao tensor
subclasses, which the file would then need torchao to load.

On the CPU the head (``get_output_embeddings``, an ``nn.Linear``) is int8 in both
formats, as gpt-fast's int8 handler takes every linear and llama.cpp's q4 files keep
the output at higher precision than the layers: at a small model's vocabulary it is
most of a token's bytes (the SmolLM2-135M shape's tied 49152 x 576 matrix, 113 MB in
float32, against 14 MB a layer). The token embedding (an ``nn.Embedding``) is int8
too, each row its own scale; where the model ties it to the head, both read the same
int8 tensor and scales, so the file holds it once. On a GPU both stay in the model's
dtype: an int8 head there has not been measured.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._compat.quantized_mm import int4_pack, int4_weight_mm, int8_weight_mm
from .._errors import QuantizationError
from .views import copy_on_paths

__all__ = [
    "INT4_GROUP",
    "WEIGHT_FORMATS",
    "Int4Linear",
    "Int8Embedding",
    "Int8Linear",
    "quantized_view",
]

# Inputs sharing one int4 scale and zero. 64: torchao's table measures int4 at group 64
# (Llama-3.1-8B); 128 would refuse common widths (SmolLM2's 576 = 9 * 64), 32 doubles
# the scales' bytes for little accuracy at these sizes.
INT4_GROUP = 64
WEIGHT_FORMATS = ("int8", "int4")


class Int8Linear(torch.nn.Module):
    """``nn.Linear`` over an int8 weight ``(out, in)`` and one scale an output channel."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: Any) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = bias
        self.out_features, self.in_features = qweight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = int8_weight_mm(flat, self.qweight, self.scales)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Int8Embedding(torch.nn.Module):
    """``nn.Embedding`` over int8 rows and one scale a row (the head's own tensors where
    the model ties the two)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)


class Int4Linear(torch.nn.Module):
    """``nn.Linear`` over a packed int4 weight, a scale and a zero per group of inputs."""

    def __init__(
        self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: Any, shape: Any
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.bias = bias
        self.out_features, self.in_features = shape
        # CPU: the group size as a tensor the step reads (_compat/quantized_mm.py);
        # CUDA: as the int the operator takes.
        self.register_buffer("group", torch.tensor(INT4_GROUP, device=packed.device))
        self.group_size = INT4_GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        group = self.group if x.device.type == "cpu" else self.group_size
        out = int4_weight_mm(flat, self.qweight, group, self.scales_and_zeros)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


@dataclasses.dataclass(frozen=True)
class Quantized:
    """What :func:`quantized_view` did: the format, how many linears, their bytes."""

    weights: str  # "int8" or "int4"
    group: int  # inputs a scale covers (int8: the whole row)
    layers: int
    bytes: int  # the quantized weights with their scales and zeros
    float_bytes: int  # the same weights in the model's dtype
    head_bytes: int = 0  # the int8 head and token embedding with their scales (0: none)
    head_float_bytes: int = 0  # the same in the model's dtype (a tied pair once)

    def spec_fields(self) -> dict[str, Any]:
        """The generator record's fields that say so (``GeneratorSpec.weights...``)."""
        return {
            "weights": self.weights,
            "weight_group": self.group,
            "quantized_layers": self.layers,
            "quantized_bytes": self.bytes,
            "float_bytes": self.float_bytes,
            "head_bytes": self.head_bytes,
            "head_float_bytes": self.head_float_bytes,
        }


def _torchao() -> Any:
    try:
        from torchao.quantization import quant_primitives, utils
    except ImportError as exc:
        raise QuantizationError(
            f"compile_generator(weights=...) quantizes with torchao, which cannot be imported "
            f"here ({exc}): pip install torchao (the served file does not need it)"
        ) from None
    return quant_primitives, utils


def int8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight and per-output-channel scales (``weight``'s dtype) of ``weight``,
    as torchao's ``Int8WeightOnlyConfig`` computes them."""
    primitives, _ = _torchao()
    w = weight.detach().float()
    block = (1, w.shape[1])
    scale, zero = primitives.choose_qparams_affine(
        w,
        primitives.MappingType.SYMMETRIC,
        block,
        torch.int8,
        eps=torch.finfo(torch.float32).eps,
        scale_dtype=torch.float32,
        zero_point_dtype=torch.int64,
    )
    q = primitives.quantize_affine(w, block, scale, zero, torch.int8)
    return q.contiguous(), scale.reshape(-1).to(weight.dtype).contiguous()


def int4_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int32 values 0..15 ``(out, in)`` and tinygemm's scales and zeros
    ``(in / group, out, 2)`` (``weight``'s dtype) of ``weight``, by torchao."""
    _, utils = _torchao()
    values, scales_and_zeros = utils.groupwise_affine_quantize_tensor(
        weight.detach().float().cpu(), n_bit=4, groupsize=INT4_GROUP, dtype=torch.float32
    )  # on the CPU: int32 values, unpacked (a GPU gets nibbles there)
    return values, scales_and_zeros.to(weight.dtype)


def _linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The decoder's ``nn.Linear`` layers (paths from ``model``), with plain weights."""
    decoder = model.get_decoder()  # type: ignore[operator]
    prefix = next((n for n, m in model.named_modules() if m is decoder), "")
    found = []
    for name, module in decoder.named_modules():
        if type(module) is torch.nn.Linear and type(module.weight) is torch.nn.Parameter:
            found.append((f"{prefix}.{name}" if prefix else name, module))
    return found


def _check(model: torch.nn.Module, weights: str, linears: list[tuple[str, Any]]) -> None:
    """A :class:`QuantizationError` naming why ``model`` cannot hold ``weights``."""
    kind = type(model).__name__
    if weights not in WEIGHT_FORMATS:
        raise QuantizationError(
            f"weights={weights!r} is not a format compile_generator writes: use one of "
            f"{', '.join(WEIGHT_FORMATS)} or None (the model's own dtype)"
        )
    if not linears:
        raise QuantizationError(
            f"{kind}: its decoder holds no nn.Linear layer with a plain weight (GPT-2's "
            f"Conv1D, a sharded or already quantized weight), so weights={weights!r} would "
            "quantize nothing; build it with weights=None"
        )
    for path, linear in linears:
        if linear._forward_hooks or linear._forward_pre_hooks:
            raise QuantizationError(
                f"{kind}: {path} has forward hooks, which its quantized stand-in would not "
                "run; remove them or build with weights=None"
            )
        if linear.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise QuantizationError(
                f"{kind}: {path} holds {linear.weight.dtype} weights; weights={weights!r} "
                "quantizes float32, bfloat16 or float16 ones"
            )
        if weights == "int4":
            _check_int4(kind, path, linear)


def _check_int4(kind: str, path: str, linear: torch.nn.Linear) -> None:
    out_features, in_features = linear.weight.shape
    if in_features % INT4_GROUP:
        raise QuantizationError(
            f"{kind}: {path} has in_features={in_features}, not a multiple of int4's group "
            f"of {INT4_GROUP} inputs; build it with weights='int8' (any shape) or None"
        )
    device = linear.weight.device
    if device.type == "cuda" and linear.weight.dtype != torch.bfloat16:
        raise QuantizationError(
            f"{kind}: {path} is {linear.weight.dtype} on CUDA, where torch's int4 matmul "
            "takes bfloat16 only: load the model in bfloat16, or use weights='int8'"
        )
    if device.type == "cuda" and (out_features % 8 or in_features % (16 * 8)):
        raise QuantizationError(
            f"{kind}: {path} is ({out_features}, {in_features}); torch's CUDA int4 matmul "
            "needs out_features a multiple of 8 and in_features of 128: use weights='int8'"
        )
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(
            f"{kind}: int4 weights are served by torch's CPU and CUDA kernels, not on "
            f"{device.type}; use weights='int8' or None"
        )


def _int4_scale_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of int4's scales and zeros: bfloat16 for a float32 weight on the CPU,
    whose kernel then runs on bfloat16 activations (``int4_weight_mm``), else the weight's."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return torch.bfloat16
    return weight.dtype


def _stand_in(weights: str, linear: torch.nn.Linear) -> tuple[torch.nn.Module, int]:
    """The quantized module for ``linear``, and its weight's bytes (with scales)."""
    with torch.no_grad():
        if weights == "int8":
            q, scales = int8_weights(linear.weight)
            module: torch.nn.Module = Int8Linear(q, scales, linear.bias)
            return module, q.nbytes + scales.nbytes
        values, scales_and_zeros = int4_weights(linear.weight)
        device = linear.weight.device
        packed = int4_pack(values.to(device))
        scales_and_zeros = scales_and_zeros.to(
            device, _int4_scale_dtype(linear.weight)
        ).contiguous()
        module = Int4Linear(packed, scales_and_zeros, linear.bias, tuple(linear.weight.shape))
        return module, packed.nbytes + scales_and_zeros.nbytes


def quantized_view(model: torch.nn.Module, weights: str) -> tuple[torch.nn.Module, Quantized]:
    """A view of ``model`` whose decoder's ``nn.Linear`` layers hold ``weights`` ("int8":
    per output channel; "int4": groups of :data:`INT4_GROUP`), on the CPU its head and
    token embedding int8 (see the module docstring), and what it holds.

    Only the modules on the way to a quantized one are copied (``views.own_copy``); the
    model keeps its own layers and weights. A shape or dtype the format's kernels
    cannot take is a :class:`QuantizationError` naming the layer.
    """
    linears = _linears(model)
    _check(model, weights, linears)
    view, copied = copy_on_paths(model)

    def put(path: str, module: torch.nn.Module) -> None:
        parent_path, _, name = path.rpartition(".")
        copied(parent_path)._modules[name] = module

    total = floats = 0
    for path, linear in linears:
        module, size = _stand_in(weights, linear)
        put(path, module)
        total += size
        floats += linear.weight.nbytes
    head, embedding = _head_and_embedding(model) if linears[0][1].weight.is_cpu else (None, None)
    head_total = head_floats = 0
    if head is not None:
        with torch.no_grad():
            q, scales = int8_weights(head[1].weight)
        put(head[0], Int8Linear(q, scales, head[1].bias))
        head_total, head_floats = q.nbytes + scales.nbytes, head[1].weight.nbytes
        if embedding is not None and embedding[1].weight is head[1].weight:
            put(embedding[0], Int8Embedding(q, scales))  # tied: the head's own tensors
            embedding = None
    if embedding is not None:
        with torch.no_grad():
            q, scales = int8_weights(embedding[1].weight)
        put(embedding[0], Int8Embedding(q, scales))
        head_total += q.nbytes + scales.nbytes
        head_floats += embedding[1].weight.nbytes
    group = INT4_GROUP if weights == "int4" else 0
    return view, Quantized(weights, group, len(linears), total, floats, head_total, head_floats)


def _head_and_embedding(
    model: torch.nn.Module,
) -> tuple[tuple[str, torch.nn.Linear] | None, tuple[str, torch.nn.Embedding] | None]:
    """The head and the token embedding with their paths, where each is the plain module
    (a subclass, Gemma3's scaled embedding say, keeps its dtype) with a plain weight
    of a float dtype; ``None`` for one that is not."""

    def find(module: Any, kind: type) -> Any:
        weight = getattr(module, "weight", None)
        if type(module) is not kind or type(weight) is not torch.nn.Parameter:
            return None
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        if getattr(module, "_forward_hooks", None) or getattr(module, "_forward_pre_hooks", None):
            return None
        path = next((n for n, m in model.named_modules() if m is module and n), None)
        return None if path is None else (path, module)

    head = find(model.get_output_embeddings(), torch.nn.Linear)  # type: ignore[operator]
    embedding = find(model.get_input_embeddings(), torch.nn.Embedding)  # type: ignore[operator]
    if embedding is not None and (embedding[1].max_norm is not None or embedding[1].sparse):
        embedding = None  # a renormalising or sparse lookup: as the model has it
    return head, embedding
