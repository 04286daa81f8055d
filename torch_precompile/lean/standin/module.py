"""A model's weights and plain attributes, without its class.

A saved artifact must run where the model's class cannot be imported. The
compiled bytecode only reads parameters, buffers and plain Python attributes
through ``self``; a tree of plain ``nn.Module`` objects holding the same
names, tensors and values answers every such read. Tensors travel as raw
bytes (no pickle); tied parameters stay tied. Attribute values are encoded by
:mod:`.attributes`.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ...file.treehash import TreeCheck
from .attributes import (
    Unencodable,
    decode_value,
    encode_value,
    function_by_value,
    imported_modules,
)
from .h2d import copy_checked, copy_to_device

_SKIP_ATTRS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)
# Skeletons of version 1 held plain values as ``[type name, JSON value]`` and configs
# of plain values only; version 2 held configs as instances of their class (tag
# ``object``); both still load. Version 3 holds configs as stand-ins (tag ``config``).
SKELETON_VERSION = 3

log = logging.getLogger("torch_precompile")


def describe_module(module: torch.nn.Module, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON-able skeleton: per submodule its plain attributes, params and buffers.

    ``leave_out``: top-level packages (a model library) whose classes and functions
    the stand-in must not import: an attribute naming one is left out of it (a
    file served without that library), as an attribute that cannot be encoded is."""
    tensors: dict[int, str] = {}
    memo: dict[int, int] = {}
    modules = {}
    for path, mod in module.named_modules(remove_duplicate=False):
        attrs = {}
        for key, value in vars(mod).items():
            if key in _SKIP_ATTRS or key.startswith("_forward") or key.startswith("_backward"):
                continue
            trial = dict(memo)  # an attribute that fails leaves no dangling memo entries
            try:
                encoded = encode_value(value, trial)
            except Unencodable:
                continue  # not in the stand-in; a guard that reads it says so at save
            if leave_out and encoded[0] != "config" and _names_any(encoded, leave_out):
                # A function of the library travels as its code, which a guard's identity
                # of it matches; anything else is left out (a guard that reads it says so;
                # a config stays whole).
                encoded = function_by_value(value, trial) if encoded[0] == "ref" else None
                if encoded is None:
                    log.debug("stand-in: %s.%s left out (it imports %s)", path, key, leave_out)
                    continue
            attrs[key] = encoded
            memo = trial
        params = {
            name: None
            if p is None
            else {"key": _tensor_key(tensors, p, path, name), "requires_grad": p.requires_grad}
            for name, p in mod._parameters.items()
        }
        persistent = mod._buffers.keys() - mod._non_persistent_buffers_set
        buffers = {
            name: None
            if b is None
            else {"key": _tensor_key(tensors, b, path, name), "persistent": name in persistent}
            for name, b in mod._buffers.items()
        }
        modules[path] = {
            "attrs": attrs,
            "params": params,
            "buffers": buffers,
            "children": list(mod._modules.keys()),
        }
    return {"version": SKELETON_VERSION, "modules": modules}


def _names_any(encoded: Any, packages: tuple[str, ...]) -> bool:
    """Whether decoding ``encoded`` imports a module of one of ``packages``."""
    return any(m.split(".")[0] in packages for m in imported_modules(encoded))


def tree_difference(skeleton: dict[str, Any], model: torch.nn.Module) -> str | None:
    """The first module, parameter or buffer where ``model``'s tree differs from the
    skeleton's (the model captured), in words; None when the trees agree."""
    live = dict(model.named_modules(remove_duplicate=False))
    entries = skeleton.get("modules", {})
    for path, entry in entries.items():
        mod = live.get(path)
        if mod is None:
            return f"module {path!r} is missing from the model"
        for table, kind in (("params", "parameter"), ("buffers", "buffer")):
            have = mod._parameters if table == "params" else mod._buffers
            for name in [*entry[table], *have]:
                # A name set to None (``q_proj.bias = None``) holds no tensor.
                in_file = entry[table].get(name) is not None
                in_model = have.get(name) is not None
                if in_file != in_model:
                    where = "missing from the model" if in_file else "new"
                    if name in entry[table] and name in have:
                        where += " (None on one side)"
                    full = f"{path}.{name}" if path else name
                    return f"{kind} {full!r} is {where}"
    for path in live:
        if path not in entries:
            return f"module {path!r} ({type(live[path]).__name__}) is new"
    return None


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every distinct parameter and buffer of ``module`` under its first name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for path, mod in module.named_modules(remove_duplicate=False):
        for name, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            out[f"{path}.{name}" if path else name] = t
    return out


def build_standin(
    skeleton: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    parameter: Callable[[torch.Tensor, bool], torch.Tensor] = torch.nn.Parameter,
) -> torch.nn.Module:
    """Rebuild a tree of plain modules from :func:`describe_module`'s skeleton;
    ``parameter(tensor, requires_grad)`` makes each parameter (a distributed load's
    makes a DTensor one without dispatching through DTensor)."""
    mods: dict[str, torch.nn.Module] = {}
    shared: dict[str, torch.Tensor] = {}
    memo: dict[int, Any] = {}
    entries = skeleton["modules"]
    for path in entries:
        mods[path] = torch.nn.Module()
    for path, entry in entries.items():
        mod = mods[path]
        for key, encoded in entry["attrs"].items():
            object.__setattr__(mod, key, decode_value(encoded, memo))
        for name, spec in entry["params"].items():
            if spec is None:
                mod._parameters[name] = None
                continue
            key = spec["key"]
            if key not in shared:
                shared[key] = parameter(tensors[key], spec["requires_grad"])
            mod._parameters[name] = shared[key]
        for name, spec in entry["buffers"].items():
            if spec is None:
                mod._buffers[name] = None
                continue
            key = spec["key"]
            if key not in shared:
                shared[key] = tensors[key]
            mod._buffers[name] = shared[key]
            if not spec["persistent"]:
                mod._non_persistent_buffers_set.add(name)
        for child in entry["children"]:
            child_path = f"{path}.{child}" if path else child
            mod._modules[child] = mods[child_path]
    return mods[""]


# ------------------------------------------------------------- raw weights


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors-style: u64 index length, JSON index, then raw contiguous bytes.

    Each tensor is copied once, by torch, into one preallocated buffer (no
    NumPy: it is not a dependency of this package).
    """
    index = {}
    flat: list[torch.Tensor] = []
    offset = 0
    for name, t in tensors.items():
        source_device = t.device
        t = t.detach().to("cpu").contiguous()
        # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes.
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        index[name] = {
            "dtype": str(t.dtype).replace("torch.", ""),
            "shape": list(t.shape),
            "offset": offset,
            "length": raw.numel(),
        }
        if source_device.type != "cpu":
            # Compiled kernels (and Dynamo's guards) expect the weights where they were.
            index[name]["device"] = str(source_device)
        flat.append(raw)
        # 64-byte alignment lets every dtype view its slice in place.
        offset += raw.numel() + (-raw.numel() % 64)
    head = json.dumps(index).encode()
    out = bytearray(8 + len(head) + offset)
    out[:8] = len(head).to_bytes(8, "little")
    out[8 : 8 + len(head)] = head
    if offset:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytearray: writable, no warning due
            body = torch.frombuffer(out, dtype=torch.uint8, offset=8 + len(head))
        for spec, raw in zip(index.values(), flat):
            body[spec["offset"] : spec["offset"] + spec["length"]].copy_(raw)
    return bytes(out)


def _tensor_key(tensors: dict[int, str], t: torch.Tensor, path: str, name: str) -> str:
    """``t``'s key in the weights: its first name (a tied tensor met again keeps it)."""
    return tensors.setdefault(id(t), f"{path}.{name}" if path else name)


def unpack_tensors(
    data: bytes | memoryview, device: str | torch.device = "cpu", check: TreeCheck | None = None
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_tensors`; tensors own their memory.

    Tensors of one device are copied as one block, straight from ``data`` (at
    load, a view of the mapped file): CPU tensors into memory from torch's
    allocator (64-byte aligned, so that every tensor, at a 64-byte multiple
    offset, is aligned as eager's weights are and owns its memory), GPU tensors
    in one host-to-device copy, so a CUDA artifact's weights never exist in
    host memory outside the file's pages. With ``check`` (the section's tree
    digest, fed by the copy) and one device, ``data`` is hashed as it is copied
    (:func:`~.h2d.copy_checked`) and the tensors are returned before the copy ends:
    none may be read until ``check`` has answered; otherwise the caller checks it.
    """
    n = int.from_bytes(data[:8], "little")
    index = json.loads(bytes(data[8 : 8 + n]))
    base = 8 + n
    source = torch.empty(0, dtype=torch.uint8)
    if len(data) > base:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer, only read here
            source = torch.frombuffer(data, dtype=torch.uint8, offset=base)
    blocks: dict[str, tuple[torch.Tensor, int]] = {}
    targets = {str(spec.get("device", device)) for spec in index.values()}
    for target in targets:
        spans = [
            (spec["offset"], spec["offset"] + spec["length"])
            for spec in index.values()
            if str(spec.get("device", device)) == target and spec["length"]
        ]
        lo, hi = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0, 0)
        if check is not None and len(targets) == 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only, only read here
                section = torch.frombuffer(data, dtype=torch.uint8)
            block = copy_checked(section, (base + lo, base + hi), target, check)
        elif target == "cpu":
            block = torch.empty(hi - lo, dtype=torch.uint8)
            block.copy_(source[lo:hi])
        else:
            block = copy_to_device(source[lo:hi], target)  # pinned, asynchronous
        blocks[target] = (block, lo)
    out = {}
    for name, spec in index.items():
        dtype = getattr(torch, spec["dtype"])
        target = str(spec.get("device", device))
        block, lo = blocks[target]
        if spec["length"]:
            start = spec["offset"] - lo
            t = block[start : start + spec["length"]].view(dtype).reshape(spec["shape"])
        else:
            t = torch.empty(spec["shape"], dtype=dtype, device=target)
        out[name] = t
    return out
