"""What the CUDA / torch 2.11 work added, checked where CI runs (CPU, torch 2.13).

The CUDA runs themselves (Triton kernels shipped in the artifact, CUDA graphs after
load, the cold-start table) need a GPU: ``benchmarks/cuda_flow.py`` and
``benchmarks/coldstart_cuda.py``, results under ``benchmarks/results/``. Here:

- the torch-version branch of Inductor's compiler config call, against both signatures;
- finding AOTAutograd's serializable entry through wrappers that are plain closures
  (torch 2.11's training path);
- builtins Dynamo's bytecode reads (``type``) saved with it, as torch 2.12+ does
  and torch 2.11 did not (HF models on CUDA: ``benchmarks/cuda_real_models.py``);
- a ``mode="reduce-overhead"`` artifact through the staged API: the mode is recorded
  in the file, restored at load in a fresh process, and each call starts a new CUDA
  graph generation, as torch.compile does; the results match eager.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import textwrap
import types

import pytest
import torch
from conftest import script_json

from tests.fixtures.models import build_transformer
from torch_precompile import Precompile
from torch_precompile import file as container
from torch_precompile._compat import joint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------- version branch


def test_compiler_config_extra_follows_the_installed_signature() -> None:
    calls = []
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    config = types.SimpleNamespace(name="inductor config")

    def takes_config(config):  # torch 2.11
        calls.append(("config", config))
        return "extra-2.11"

    def takes_gm(gm):  # torch 2.12+
        calls.append(("gm", gm))
        return "extra-2.13"

    old = types.SimpleNamespace(create_compiler_config_extra=takes_config)
    new = types.SimpleNamespace(create_compiler_config_extra=takes_gm)
    assert joint._compiler_config_extra(old, config, gm) == "extra-2.11"
    assert joint._compiler_config_extra(new, config, gm) == "extra-2.13"
    assert calls == [("config", config), ("gm", gm)]


# ------------------------------------------------- serializable entry lookup


def _serializable(entry: str):
    import torch._functorch.aot_autograd  # noqa: F401  (imports runtime_wrappers without a cycle)
    from torch._functorch._aot_autograd.runtime_wrappers import SerializableCompiledFunction

    return SerializableCompiledFunction(lambda *a: a, lambda: entry)


def test_serializable_entry_is_found_through_closures_and_wraps() -> None:
    inner = _serializable("the entry")

    def boxed(args):  # like make_boxed_func: a closure without __wrapped__
        return inner(*args)

    @functools.wraps(boxed)
    def runtime_wrapper(args):
        return boxed(args)

    class Holder:  # like BundledAOTAutogradSerializableCallable
        def __init__(self, fn):
            self.compiled_fn = fn

    serialize = joint._find_serialize_fn(Holder(runtime_wrapper))
    assert serialize is not None and serialize() == "the entry"


def test_no_serializable_entry_gives_none() -> None:
    def plain(args):
        return args

    def outer(args):
        return plain(args)

    assert joint._find_serialize_fn(outer) is None


# ------------------------------------------------ builtins the bytecode reads


def _bytecode_reading_builtins(x):
    return type(x), len(x), helper(x), __builtins_dict___0["abs"](x)  # noqa: F821


def test_builtins_read_by_the_bytecode_join_the_runtime_env() -> None:
    """torch 2.11's ``get_runtime_env`` leaves builtins out of ``used_globals``, and
    ``AOTCompiledFunction`` then refused HF models ("Missing required external
    references: ['type']"). Simulated here on torch 2.13 with an env built the 2.11 way."""
    import builtins

    from torch._dynamo.convert_frame import GraphCaptureOutput, GraphRuntimeEnv

    from torch_precompile._compat import functions

    code = _bytecode_reading_builtins.__code__
    f_globals = {
        "len": lambda x: "the module's len",  # a module global that shadows a builtin
        "__builtins_dict___0": {"abs": abs, "unpicklable": lambda: None},
    }

    def get_runtime_env_as_on_torch_2_11() -> GraphRuntimeEnv:
        fields = {
            "bytecode": code,
            "pycode": [],  # since torch 2.12
            "import_sources": {},
            "used_globals": {},
            "closure": None,
            "argdefs": None,
            "external_refs": GraphCaptureOutput._get_external_refs(code),
        }
        known = {f.name for f in dataclasses.fields(GraphRuntimeEnv)}
        return GraphRuntimeEnv(**{k: v for k, v in fields.items() if k in known})

    gco = types.SimpleNamespace(
        get_runtime_env=get_runtime_env_as_on_torch_2_11, f_globals=f_globals
    )
    env = functions.runtime_env_with_builtins(gco)
    assert env.used_globals["type"] is builtins.type
    assert "len" not in env.used_globals  # left to the module's globals
    assert env.used_globals["__builtins_dict___0"] == {"abs": abs}  # picklable entries
    fn = env.forward_callable("helper", str, extra_globals={"len": f_globals["len"]})
    assert fn(-3) == (int, "the module's len", "-3", 3)


# ---------------------------------------------------- reduce-overhead artifact

_FRESH = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch_precompile import Precompile
    from tests.fixtures.models import build_transformer

    model, (ids,), _ = build_transformer()
    art = Precompile.load(sys.argv[1])
    lean = type(art.compiled_function).__name__ == "LeanCompiledFunction"
    steps = None
    with torch.no_grad():
        if lean:
            outs = [art(ids).clone() for _ in range(3)]
        else:
            from torch._dynamo.mutation_guard import GenerationTracker
            before = GenerationTracker.generation
            outs = [art(ids).clone() for _ in range(3)]
            steps = GenerationTracker.generation - before
        ref = model(ids)
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    print(json.dumps({"generation_steps": steps, "lean": lean,
                      "dynamo": "torch._dynamo" in sys.modules}))
    """
)


@pytest.fixture(scope="module")
def reduce_overhead_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    model, (ids,), _ = build_transformer()
    with torch.no_grad():
        gm, bytecode, guards = Precompile.dynamo(model, ids)
        joint, guards = Precompile.aot_autograd(gm, guards)
        compiled, guards = Precompile.inductor(joint, guards, mode="reduce-overhead")
        art = Precompile.precompile(compiled)
        torch.testing.assert_close(art(ids), model(ids), rtol=1e-4, atol=1e-4)
    path = str(tmp_path_factory.mktemp("ro") / "transformer_ro.pt")
    Precompile.save(path, art, bytecode, guards)
    return path


def test_reduce_overhead_is_recorded_in_the_file(reduce_overhead_file: str) -> None:
    meta, _ = container.read_artifact(reduce_overhead_file)
    assert meta["cudagraphs"] is True


def test_reduce_overhead_full_path_steps_generations(reduce_overhead_file: str) -> None:
    result = script_json(_FRESH, reduce_overhead_file, TORCH_PRECOMPILE_LEAN="0")
    assert result["lean"] is False
    # One new CUDA-graph generation per call, as torch.compile's frame entry does.
    assert result["generation_steps"] == 3


def test_reduce_overhead_loads_lean(reduce_overhead_file: str) -> None:
    # On CPU Inductor records no CUDA graphs; the lean load runs the graph as
    # compiled (on CUDA it records them itself: benchmarks/cuda_flow.py).
    result = script_json(_FRESH, reduce_overhead_file)
    assert result["lean"] is True and result["dynamo"] is False, result
