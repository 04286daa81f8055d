"""A model's weights and plain attributes, without its class.

A saved artifact must run where the model's class cannot be imported. The
compiled bytecode only reads parameters, buffers and plain Python attributes
through ``self``; a tree of plain ``nn.Module`` objects holding the same
names, tensors and values answers every such read. Tensors travel as raw
bytes (no pickle); tied parameters stay tied.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch

_PLAIN = (bool, int, float, str, type(None))
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


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    return False


def describe_module(module: torch.nn.Module) -> dict[str, Any]:
    """A JSON-able skeleton: per submodule its plain attributes, params and buffers."""
    tensors: dict[int, str] = {}
    modules = {}
    for path, mod in module.named_modules(remove_duplicate=False):
        attrs = {}
        for key, value in vars(mod).items():
            if key in _SKIP_ATTRS or key.startswith("_forward") or key.startswith("_backward"):
                continue
            if _is_plain(value):
                attrs[key] = [type(value).__name__, value]
            elif _is_config(value):
                attrs[key] = ["config", _describe_config(value)]
        params = {}
        for name, p in mod._parameters.items():
            if p is None:
                params[name] = None
                continue
            key = f"{path}.{name}" if path else name
            params[name] = {"key": tensors.setdefault(id(p), key), "requires_grad": p.requires_grad}
        buffers = {}
        for name, b in mod._buffers.items():
            if b is None:
                buffers[name] = None
                continue
            key = f"{path}.{name}" if path else name
            buffers[name] = {
                "key": tensors.setdefault(id(b), key),
                "persistent": name not in mod._non_persistent_buffers_set,
            }
        modules[path] = {
            "attrs": attrs,
            "params": params,
            "buffers": buffers,
            "children": list(mod._modules.keys()),
        }
    return {"modules": modules}


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


def build_standin(skeleton: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Rebuild a tree of plain modules from :func:`describe_module`'s skeleton."""
    mods: dict[str, torch.nn.Module] = {}
    shared: dict[str, torch.Tensor] = {}
    entries = skeleton["modules"]
    for path in entries:
        mods[path] = torch.nn.Module()
    for path, entry in entries.items():
        mod = mods[path]
        for key, (type_name, value) in entry["attrs"].items():
            if type_name == "tuple":
                value = _to_tuple(value)
            elif type_name == "config":
                value = _build_config(value)
            object.__setattr__(mod, key, value)
        for name, spec in entry["params"].items():
            if spec is None:
                mod._parameters[name] = None
                continue
            key = spec["key"]
            if key not in shared:
                shared[key] = torch.nn.Parameter(tensors[key], requires_grad=spec["requires_grad"])
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


def _is_config(value: Any) -> bool:
    """A configuration object (HF's ``self.config``): plain attributes, importable class."""
    cls = type(value)
    if isinstance(value, torch.nn.Module) or not hasattr(value, "__dict__"):
        return False
    if cls.__module__ in ("builtins", "__main__") or "<locals>" in cls.__qualname__:
        return False
    if cls.__module__.split(".")[0] == "torch":
        return False
    if _find_class(cls.__module__, cls.__qualname__, import_missing=False) is not cls:
        return False
    return all(_is_plain(v) for v in vars(value).values())


def _describe_config(value: Any) -> dict[str, Any]:
    cls = type(value)
    state = {k: [type(v).__name__, v] for k, v in vars(value).items()}
    return {"module": cls.__module__, "qualname": cls.__qualname__, "state": state}


def _find_class(module: str, qualname: str, import_missing: bool = True) -> Any:
    import importlib
    import sys

    obj: Any = sys.modules.get(module)
    if obj is None and import_missing:
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _build_config(desc: dict[str, Any]) -> Any:
    """Rebuild a config object; its class must be importable, as output types must be."""
    cls = _find_class(desc["module"], desc["qualname"])
    if not isinstance(cls, type):
        name = f"{desc['module']}.{desc['qualname']}"
        raise ImportError(f"the model's config class {name} cannot be imported")
    obj = cls.__new__(cls)
    for key, (type_name, value) in desc["state"].items():
        obj.__dict__[key] = _to_tuple(value) if type_name == "tuple" else value
    return obj


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value


# ------------------------------------------------------------- raw weights


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors-style: u64 index length, JSON index, then raw contiguous bytes."""
    index = {}
    chunks = []
    offset = 0
    for name, t in tensors.items():
        source_device = t.device
        t = t.detach().to("cpu").contiguous()
        # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes.
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        index[name] = {
            "dtype": str(t.dtype).replace("torch.", ""),
            "shape": list(t.shape),
            "offset": offset,
            "length": len(raw),
        }
        if source_device.type != "cpu":
            # Compiled kernels (and Dynamo's guards) expect the weights where they were.
            index[name]["device"] = str(source_device)
        # 64-byte alignment lets every dtype view its slice in place.
        pad = -len(raw) % 64
        chunks.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    head = json.dumps(index).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(chunks)


def unpack_tensors(data: bytes, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_tensors`; tensors own their memory."""
    n = int.from_bytes(data[:8], "little")
    index = json.loads(data[8 : 8 + n])
    base = 8 + n
    # One copy into memory from torch's allocator (64-byte aligned), so that every
    # tensor, at a 64-byte multiple offset, is aligned as eager's weights are (the
    # compiled code sees the layout it saw when compiling) and owns its memory.
    storage = torch.empty(len(data) - base, dtype=torch.uint8)
    if storage.numel():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer, only read here
            source = torch.frombuffer(data, dtype=torch.uint8, offset=base)
        storage.copy_(source)
    out = {}
    for name, spec in index.items():
        dtype = getattr(torch, spec["dtype"])
        raw = storage[spec["offset"] : spec["offset"] + spec["length"]]
        if spec["length"]:
            t = raw.view(dtype).reshape(spec["shape"])
        else:
            t = torch.empty(spec["shape"], dtype=dtype)
        target = spec.get("device", device)
        out[name] = t.to(target) if str(target) != "cpu" else t
    return out
