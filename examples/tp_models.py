"""Tensor-parallel reference models (plain PyTorch + torch.distributed, no torch_precompile).

- ``TPMLP``: Linear-GELU-Linear; ``up`` column-wise, ``down`` row-wise.
  Plan ``slice``: only ``down`` row-wise, from a replicated input: each rank
  cuts its own slice of the activation, at an offset that depends on its
  rank (code traced on one rank must not bake that rank's offset in).
  Plan ``dtout``: the MLP's plan, ``down`` returning a DTensor (replicated).
- ``TPBlock``: a pre-LN transformer block, multi-head self-attention
  (``q``/``k``/``v`` column-wise, ``o`` row-wise, heads split across ranks)
  and a GELU MLP (``fc1`` column-wise, ``fc2`` row-wise); LayerNorms replicated
  as plain tensors. The head count per rank is read from the local tensor's
  shape, the usual way to write a TP attention.

- ``llama``: a Hugging Face ``LlamaForCausalLM`` (random-init config, grouped-query
  attention; bfloat16 on a CUDA mesh, float32 elsewhere), parallelised with
  the usual Llama plan: ``q/k/v``, ``gate/up`` column-wise, ``o``/``down``
  row-wise; embeddings, norms and the head replicated. Its input is token
  ids (``example_input("llama")``).

``build(name, mesh)`` builds one deterministically (same weights on every
rank before sharding) and parallelises it with ``parallelize_module``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

D_MODEL = 64
N_HEADS = 4  # divisible by 1, 2 and 4 ranks
HEAD_DIM = D_MODEL // N_HEADS


class TPMLP(nn.Module):
    def __init__(self, d: int = D_MODEL, hidden: int = 4 * D_MODEL) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TPBlock(nn.Module):
    def __init__(self, d: int = D_MODEL) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        # (b, s, local heads * head_dim): the local head count comes from the shard.
        q = self.q(h).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = self.k(h).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = self.v(h).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


PLANS = {
    "mlp": {"up": ColwiseParallel(), "down": RowwiseParallel()},
    "block": {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "o": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    },
    "slice": {"down": RowwiseParallel(input_layouts=Replicate())},
    # The MLP returning a DTensor (replicated) instead of its local tensor.
    "dtout": {"up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)},
}


LLAMA_LAYERS = 2
LLAMA_VOCAB = 1000


def _llama(dtype: torch.dtype) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LLAMA_LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,  # divisible by 1, 2 and 4 ranks
        vocab_size=LLAMA_VOCAB,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _llama_plan() -> dict[str, ColwiseParallel | RowwiseParallel]:
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {}
    for i in range(LLAMA_LAYERS):
        layer = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"{layer}.{name}"] = ColwiseParallel()
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{layer}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
    return plan


def build(name: str, mesh: DeviceMesh | None, seed: int = 0) -> nn.Module:
    """The model ``name`` ("mlp", "slice", "dtout", "block" or "llama"), parallelised over
    ``mesh`` (None: not at all), on the mesh's device type."""
    torch.manual_seed(seed)
    if name == "llama":
        cuda = mesh is not None and mesh.device_type == "cuda"
        model = _llama(torch.bfloat16 if cuda else torch.float32)
    else:
        model = TPBlock() if name == "block" else TPMLP()
    if mesh is not None:
        model.to(mesh.device_type)
        parallelize_module(model, mesh, _llama_plan() if name == "llama" else PLANS[name])
    return model


def example_input(name: str, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """The same input on every rank (tensor parallel replicates the activations)."""
    g = torch.Generator().manual_seed(seed)
    if name == "llama":
        return torch.randint(0, LLAMA_VOCAB, (2, 16), generator=g).to(device)
    shape = (2, 16, D_MODEL) if name == "block" else (4, D_MODEL)
    return torch.randn(shape, generator=g).to(device)


def run(model: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """One forward of ``name``: the logits for the decoder, the output otherwise."""
    if name == "llama":
        return model(x, use_cache=False).logits
    return model(x)
