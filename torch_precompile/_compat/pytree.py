"""PyTorch's pytree flattening (``torch.utils._pytree``), which the stages and the
runtime use to read nested arguments and outputs as Dynamo does."""

from __future__ import annotations

from torch.utils._pytree import tree_leaves

__all__ = ["tree_leaves"]
