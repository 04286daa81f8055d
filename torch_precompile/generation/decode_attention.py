"""A decode step's grouped-query attention, read from the cache's own key/value heads.

transformers' SDPA attention gives each query head its own copy of the key and
value heads it shares (``repeat_kv``: ``cache[:, :, None].expand(...).reshape(...)``,
a copy of the whole cache, two kernels a layer) before
``scaled_dot_product_attention``, which on a GPU does not take a mask together
with grouped heads. With one query position the copy is not needed: the query
heads of a group are laid along the query axis, ``(batch, kv_heads, group,
head_dim)``, and attend to their key/value head as it is in the cache.

:func:`grouped_decode_attention` rewrites Dynamo's graph of a decode step so:
the scores by a matmul in the cache's dtype, scaled, masked and softmaxed in
float32, rounded to the query's dtype and multiplied with the values by a
matmul: the arithmetic of transformers' ``eager`` attention, without its
``repeat_kv``. On an H200 a Qwen2.5-0.5B layer's decode attention took 6.2 us
so, 9.1 us without it (two copies and cuDNN's kernel; benchmarks/decode_attention.py);
on a 2-core CPU a SmolLM2-135M step of 8 rows 33 ms with it, 52-54 without.
Only an attention whose inputs are exactly that pattern is rewritten: one
query position, no dropout, not causal, a mask shared by the heads (or none).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from .._compat.graph_copy import copy_graph_module

_FULL = slice(None)
_SDPA = torch.nn.functional.scaled_dot_product_attention


def groups_on(device: torch.device) -> bool:
    """Whether a step built on ``device`` has its decode attention rewritten: on a GPU,
    where it saves the copies and takes the faster kernels, and on a CPU, where the
    SmolLM2-135M shape's fp32 slot step of 8 rows took 33 ms with it, 52-54 without
    (``repeat_kv`` copied 141 MB a step), and one row decoded 6% faster (a 2-core AMD
    EPYC, docs/measurements.md, 2026-12-06); not on MPS, where it is not measured."""
    return device.type != "mps"


def grouped_decode_attention(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """A copy of Dynamo's graph ``gm`` whose one-query attentions over repeated key/value
    heads read the heads unrepeated, and how many were rewritten (``gm`` itself when
    none was). Inputs and outputs are unchanged."""
    found = [n for n in gm.graph.nodes if _attention_parts(n) is not None]
    if not found:
        return gm, 0
    new = copy_graph_module(gm)
    count = 0
    for node in list(new.graph.nodes):
        parts = _attention_parts(node)
        if parts is not None:
            _rewrite(new.graph, node, *parts)
            count += 1
    new.graph.lint()
    new.recompile()
    return new, count


def _value(node: Any) -> Any:
    """The fake value Dynamo recorded for a node (``None`` for a constant)."""
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _same(a: Any, b: Any) -> bool:
    """Two sizes known equal without adding a guard."""
    # Imported here: the module holding it imports sympy, which a served file's load
    # (importing this package for decode_matmul's function) must not.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def _repeated(node: Any) -> tuple[torch.fx.Node, int] | None:
    """``(source, group)`` when ``node`` is transformers' ``repeat_kv`` of ``source``:
    ``source[:, :, None].expand(b, kv, group, l, d).reshape(b, kv * group, l, d)``."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_method"):
        return None
    if node.target not in ("reshape", "view") or not node.args:
        return None
    expand = node.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.op == "call_method"):
        return None
    if expand.target != "expand" or not expand.args:
        return None
    item = expand.args[0]
    if not (isinstance(item, torch.fx.Node) and item.target is operator.getitem):
        return None
    if len(item.args) != 2 or item.args[1] != (_FULL, _FULL, None, _FULL, _FULL):
        return None
    source = item.args[0]
    src, wide, out = _value(source), _value(expand), _value(node)
    if not all(isinstance(t, torch.Tensor) for t in (src, wide, out)) or src.dim() != 4:
        return None
    group = wide.shape[2]
    if type(group) is not int or wide.dim() != 5 or out.dim() != 4:
        return None
    b, kv, length, dim = src.shape
    if not all(_same(x, y) for x, y in zip(wide.shape, (b, kv, group, length, dim))):
        return None
    if not all(_same(x, y) for x, y in zip(out.shape, (b, kv * group, length, dim))):
        return None
    return source, group


def _attention_parts(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """``(query, keys, values, group, mask, scale, kv_heads, dtype)`` of an attention
    :func:`_rewrite` can rewrite (``keys``, ``values``: the unrepeated cache), else ``None``."""
    if node.op != "call_function" or node.target is not _SDPA or len(node.args) != 3:
        return None
    kwargs = dict(node.kwargs)
    mask = kwargs.pop("attn_mask", None)
    scale = kwargs.pop("scale", None)
    if kwargs.pop("dropout_p", 0.0) != 0.0 or kwargs.pop("is_causal", False) is not False:
        return None
    if kwargs.pop("enable_gqa", False) is not False or kwargs:
        return None
    query, key, value = node.args
    keys, values = _repeated(key), _repeated(value)
    if keys is None or values is None or keys[1] != values[1]:
        return None
    q = _value(query)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or type(q.shape[2]) is not int:
        return None
    heads, dim = q.shape[1], q.shape[3]
    if type(heads) is not int or type(dim) is not int or q.shape[2] != 1:
        return None
    if scale is not None and not isinstance(scale, (int, float, torch.fx.Node)):
        return None
    if mask is not None:
        m = _value(mask)
        if not isinstance(m, torch.Tensor) or m.dim() != 4:
            return None
        if type(m.shape[1]) is not int or type(m.shape[2]) is not int or m.shape[1:3] != (1, 1):
            return None
        if not (m.dtype == torch.bool or m.dtype.is_floating_point):
            return None
    group = keys[1]
    if heads % group:
        return None
    if scale is None:
        scale = 1 / math.sqrt(dim)
    elif not isinstance(scale, torch.fx.Node):  # else a float Dynamo did not specialise
        scale = float(scale)
    return query, keys[0], values[0], group, mask, scale, heads // group, q.dtype


def _rewrite(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    query: torch.fx.Node,
    keys: torch.fx.Node,
    values: torch.fx.Node,
    group: int,
    mask: torch.fx.Node | None,
    scale: float | torch.fx.Node,
    kv_heads: int,
    dtype: torch.dtype,
) -> None:
    """Replace the attention ``node`` by the grouped computation over the cache's heads."""
    key, value = node.args[1], node.args[2]
    with graph.inserting_before(node):
        # (b, heads, 1, d) -> (b, kv_heads, group, d): head h is group h // group's row h % group.
        q = graph.call_method("transpose", (query, 1, 2))
        q = graph.call_method("unflatten", (q, 2, (kv_heads, group)))
        q = graph.call_method("squeeze", (q, 1))
        k = graph.call_method("transpose", (keys, -1, -2))
        scores = graph.call_function(torch.matmul, (q, k))
        scores = graph.call_method("float", (scores,))
        scores = graph.call_function(operator.mul, (scores, scale))
        if mask is not None:
            m = _value(mask)
            if m.dtype == torch.bool:
                hidden = graph.call_function(operator.invert, (mask,))
                scores = graph.call_method("masked_fill", (scores, hidden, float("-inf")))
            else:
                scores = graph.call_function(operator.add, (scores, mask))
        weights = graph.call_function(torch.softmax, (scores, -1))
        weights = graph.call_method("to", (weights, dtype))
        out = graph.call_function(torch.matmul, (weights, values))
        out = graph.call_method("flatten", (out, 1, 2))
        out = graph.call_method("unsqueeze", (out, 2))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    for dead in (key, value):  # each repeat's reshape, expand and getitem, unused now
        for _ in range(3):
            if not isinstance(dead, torch.fx.Node) or dead.users:
                break
            parent = dead.args[0]
            graph.erase_node(dead)
            dead = parent
