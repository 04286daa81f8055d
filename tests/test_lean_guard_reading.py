"""The lean guards are read from Dynamo's typed guard objects, never from its debug text.

At precompile, Dynamo's guard tree is read into the lean-guard spec from the
types of its managers, accessors and leaves, the typed sources and guards, and
the capture's live values. Here the leaf guards' ``verbose_code_parts`` and the
accessors' ``repr`` (Dynamo's debug text) raise while the spec is read: a real
Hugging Face model still gets lean guards, and a fresh process serves its
calls with them, equal to eager, without building Dynamo's guard manager. A
leaf guard of a kind the reader does not know means no lean guards: the file
loads through Dynamo's guard manager, which decides, and the output is right.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import script_json

from tests.fixtures.models import build_tiny_mlp
from torch_precompile import Precompile
from torch_precompile.lean.guards import LeanGuards
from torch_precompile.lean_writer import guard_leaves as lean_guard_leaves
from torch_precompile.lean_writer import guard_spec as guard_spec_module

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

VOCAB = 1000


@contextlib.contextmanager
def _reading_spied(reads: list[Any], debug_text_calls: list[str]) -> Iterator[None]:
    """Record each spec read at precompile; while it is read, Dynamo's debug text raises."""
    guards = torch._C._dynamo.guards
    read = guard_spec_module.lean_guard_spec

    def no_debug_text(name: str) -> Any:
        def raising(*args: Any, **kwargs: Any) -> Any:
            debug_text_calls.append(name)
            raise RuntimeError(f"{name} read while reading the lean guards")

        return raising

    def spied(reading: Any) -> Any:
        saved = (guards.LeafGuard.verbose_code_parts, guards.GuardAccessor.repr)
        guards.LeafGuard.verbose_code_parts = no_debug_text("verbose_code_parts")
        guards.GuardAccessor.repr = no_debug_text("repr")
        try:
            spec = read(reading)
        finally:
            guards.LeafGuard.verbose_code_parts, guards.GuardAccessor.repr = saved
        reads.append(None if spec is None else spec.write())  # the form the file stores
        return spec

    guard_spec_module.lean_guard_spec = spied
    try:
        yield
    finally:
        guard_spec_module.lean_guard_spec = read


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second sequence is padded
    reads: list[Any] = []
    debug_text_calls: list[str] = []
    with torch.no_grad(), _reading_spied(reads, debug_text_calls):
        artifact = Precompile.compile(model, (ids,), {"attention_mask": mask})
        eager = model(ids, attention_mask=mask).logits
    tmp = tmp_path_factory.mktemp("light-reading")
    path = tmp / "gpt2.pt2"
    Precompile.save(path, artifact)
    torch.save({"ids": ids, "mask": mask, "logits": eager}, tmp / "io.pt")
    return {"path": path, "io": tmp / "io.pt", "reads": reads, "calls": debug_text_calls}


def test_spec_is_read_without_dynamo_debug_text(gpt2_file: dict[str, Any]) -> None:
    assert gpt2_file["calls"] == [], gpt2_file["calls"]
    assert len(gpt2_file["reads"]) == 1 and gpt2_file["reads"][0] is not None
    spec = gpt2_file["reads"][0]
    kinds = {leaf[0] for leaf in spec["leaves"]}
    # The CheckFunctionManager's own guards, at the root.
    assert {"global_state", "no_torch_function_mode", "no_default_device"} <= kinds, kinds
    assert "no_saved_tensor_hooks" in kinds, kinds
    # Every tensor the call reads is checked: the two inputs and GPT-2's weights.
    tensors = _tensor_sources(spec)
    assert {"L['args'][0]", "L['kwargs']['attention_mask']"} <= set(tensors), tensors
    assert sum("_parameters" in s for s in tensors) > 20, tensors


def _tensor_sources(node: dict[str, Any]) -> list[str]:
    found = [node["source"]] if any(leaf[0] == "tensor" for leaf in node["leaves"]) else []
    subs = [child for _, child in node["children"]]
    subs += [x for _, k, v in node.get("dict", {}).get("entries", []) for x in (k, v) if x]
    return found + [s for sub in subs for s in _tensor_sources(sub)]


LOAD = r"""
import json, sys
import torch
from torch_precompile import Precompile
art = Precompile.load(sys.argv[1])
io = torch.load(sys.argv[2])
with torch.no_grad():
    out = art(io["ids"], attention_mask=io["mask"])
logits = out["logits"] if isinstance(out, dict) else out[0]
print(json.dumps({
    "max_diff": (logits - io["logits"]).abs().max().item(),
    "light_served": art.runtime.guard_manager._full is None,
    "dynamo_imported": "torch._dynamo" in sys.modules,
}))
"""


def test_hf_model_served_by_light_guards_in_a_fresh_process(gpt2_file: dict[str, Any]) -> None:
    result = script_json(LOAD, gpt2_file["path"], gpt2_file["io"])
    assert result["max_diff"] < 1e-4, result
    assert result["light_served"], result
    assert not result["dynamo_imported"], result


@contextlib.contextmanager
def _leaf_kind_unknown(kind: str) -> Iterator[None]:
    saved = lean_guard_leaves.LEAF_READERS.pop(kind)
    try:
        yield
    finally:
        lean_guard_leaves.LEAF_READERS[kind] = saved


FULL = r"""
import json, sys
import torch
from tests.fixtures.models import build_tiny_mlp
from torch_precompile import Precompile
art = Precompile.load(sys.argv[1])
x = torch.load(sys.argv[2])
with torch.no_grad():
    out = art(x)
    expected = build_tiny_mlp()[0](x)
print(json.dumps({
    "max_diff": (out - expected).abs().max().item(),
    "light": art.runtime.guard_manager.lean_guards is not None,
    "full_built": art.runtime.guard_manager._full is not None,
}))
"""


def test_unknown_leaf_kind_gives_no_light_guards(tmp_path: Path) -> None:
    model, (x,), _ = build_tiny_mlp()
    reads: list[Any] = []
    with torch.no_grad(), _leaf_kind_unknown("TENSOR_MATCH"), _reading_spied(reads, []):
        artifact = Precompile.compile(model, x)
    assert reads == [None]  # not a weaker check: none at all
    Precompile.save(tmp_path / "mlp.pt2", artifact)
    torch.save(x, tmp_path / "x.pt")
    result = script_json(FULL, tmp_path / "mlp.pt2", tmp_path / "x.pt")
    assert result["max_diff"] < 1e-5, result
    assert not result["light"] and result["full_built"], result  # Dynamo's manager decided


def _method_self_guards() -> Any:
    # What torch 2.11 (with transformers 5.17) guards of GPT-2's config: the
    # config's get_text_config is a method, bound to the config itself.
    source = "object.__getattribute__(L['cfg'], 'get_text_config')"
    method = {"source": source, "leaves": [["type", "method"]], "children": []}
    spec = {
        "source": "L",
        "leaves": [],
        "children": [
            [
                ["item", "cfg"],
                {
                    "source": "L['cfg']",
                    "leaves": [],
                    "children": [
                        [["oattr", "get_text_config"], method]
                    ],
                },
            ]
        ],
        "shape_guards": [f"L['cfg'] is {source}.__self__"],
    }  # fmt: skip
    return LeanGuards(spec)


def test_a_method_bound_to_a_config_is_checked_lean() -> None:
    from torch_precompile.lean.standin import module as _standin
    from torch_precompile.lean.standin.config import ConfigStandIn

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB)
    holder = torch.nn.Linear(2, 2)
    holder.config = config
    skeleton = _standin.describe_module(holder)
    tensors = _standin.module_tensors(holder)
    standin = _standin.build_standin(skeleton, tensors).config
    guards = _method_self_guards()
    assert guards.check({"cfg": config})  # the live config
    assert guards.check({"cfg": standin})  # a loaded config's stand-in, and it stays one:
    assert isinstance(standin, ConfigStandIn)  # the check imported no library class

    class Shadowed(type(config)):  # an instance attribute shadows the method
        pass

    odd = Shadowed(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB)
    odd.get_text_config = lambda: odd
    assert not guards.check({"cfg": odd})
    other = transformers.GPT2Config()  # a method bound to another object
    assert not guards.check({"cfg": types.SimpleNamespace(get_text_config=other.get_text_config)})
