"""A decode step's grouped-query attention over the cache's own heads
(generation/decode_attention.py).

The rewrite runs on Dynamo's graphs of the generator's real step (``_Step``) for
each family, through a ``torch.compile`` backend that applies it and runs the
graph as it is: the step's logits and the cache it writes equal the eager
step's, at batch 1, a dynamic batch and in slot mode, and what is not the
pattern (a prompt, heads not grouped) is left alone. A generator built with the
rewrite on this CPU (it is on for GPUs only) then equals transformers' own
``generate``, logits and all.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch_precompile import Precompile  # noqa: E402
from torch_precompile.generation import compile as generation_compile  # noqa: E402
from torch_precompile.generation.compile import _cache_layout, _Step  # noqa: E402
from torch_precompile.generation.decode_attention import (  # noqa: E402
    grouped_decode_attention,
    groups_on,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_generator import SMALL, _prompts, _same_as_transformers  # noqa: E402

from tests.fixtures.hf_models import generator_families  # noqa: E402

LENGTH = 24
# Families whose attention is transformers' SDPA with grouped key/value heads: each of
# their layers is rewritten.
GROUPED = ("llama", "qwen2", "mistral", "phi3", "qwen3", "gemma3", "olmo2", "starcoder2")


def _rewritten(step: torch.nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor, list[int]]:
    """The step's output through Dynamo with the rewrite applied, and each graph's count."""
    counts: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        new, count = grouped_decode_attention(gm)
        counts.append(count)
        assert (new is gm) == (count == 0)
        return new.forward

    torch.compiler.reset()
    compiled = torch.compile(step, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        return compiled(*args), counts


def _decode_args(
    model: Any, batch: int, at: int, *, slots: bool = False, query: int = 1, seed: int = 0
) -> tuple[Any, ...]:
    """A step's inputs: ``query`` tokens a row at cache index ``at`` (row r at ``at + r`` in
    slot mode) over a random cache."""
    shapes, dtype = _cache_layout(model, LENGTH)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (batch, query), generator=g)
    cache = [
        torch.randn((batch, h, LENGTH, d), generator=g).to(getattr(torch, dtype)) for h, d in shapes
    ]
    if slots:
        start = torch.arange(at, at + batch)
        mask = torch.ones((batch, LENGTH), dtype=torch.long)
        return (ids, mask, start[:, None].clone(), start, *cache)
    mask = torch.zeros((batch, LENGTH), dtype=torch.long)
    mask[:, : at + query] = 1
    mask[1:, :2] = 0  # rows after the first left-padded
    positions = torch.arange(at, at + query).repeat(batch, 1)
    return (ids, mask, positions, torch.tensor(at), *cache)


def _check_equal(model: Any, args: tuple[Any, ...], atol: float = 1e-4) -> list[int]:
    """The rewritten step's logits and written cache equal the eager step's."""
    step = _Step(model.eval(), LENGTH).eval()
    mine = [t.clone() for t in args]
    with torch.no_grad():
        want = step(*args)
    got, counts = _rewritten(step, tuple(mine))
    assert torch.allclose(got, want, atol=atol, rtol=1e-4), (got - want).abs().max()
    for written, expected in zip(mine[4:], args[4:]):
        assert torch.allclose(written, expected, atol=atol), (written - expected).abs().max()
    return counts


@pytest.fixture(scope="module")
def families() -> dict[str, Any]:
    torch.manual_seed(0)
    return {name: make().eval() for name, make in generator_families().items()}


@pytest.mark.parametrize("name", sorted(generator_families()))
def test_each_familys_decode_step_equals_the_eager_step(
    families: dict[str, Any], name: str
) -> None:
    model = families[name]
    layers = model.config.num_hidden_layers
    counts = _check_equal(model, _decode_args(model, 1, 9))  # batch 1, inside every window
    counts += _check_equal(model, _decode_args(model, 3, 14, seed=1))  # past Mistral's 12
    if name in GROUPED:
        assert counts == [layers, layers], counts
    else:
        assert set(counts) <= {0, layers}, counts


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_the_slot_step_rows_at_their_own_offsets(families: dict[str, Any], name: str) -> None:
    model = families[name]
    counts = _check_equal(model, _decode_args(model, 3, 11, slots=True, seed=2))
    assert counts == [model.config.num_hidden_layers]


def test_a_prompt_and_ungrouped_heads_are_left_alone(families: dict[str, Any]) -> None:
    llama = families["llama"]
    assert _check_equal(llama, _decode_args(llama, 2, 3, query=5)) == [0]  # a prompt
    torch.manual_seed(1)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=4, **SMALL))
    assert _check_equal(plain.eval(), _decode_args(plain, 2, 6)) == [0]  # every head its own


def test_one_key_value_head_for_all_queries() -> None:
    torch.manual_seed(2)
    mqa = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=1, **SMALL))
    assert _check_equal(mqa.eval(), _decode_args(mqa, 2, 7)) == [2]


def test_bfloat16_as_transformers_eager_attention() -> None:
    """In bfloat16 the rewrite computes what transformers' ``eager`` attention does (its
    scores rounded to bfloat16 by the matmul), not SDPA's float32 scores: it is held to
    the eager attention's distance from the float32 model, with room for one rounding."""
    torch.manual_seed(3)
    config = transformers.LlamaConfig(num_key_value_heads=2, **SMALL)
    model = transformers.LlamaForCausalLM(config).eval()
    args32 = _decode_args(model, 2, 10, seed=4)
    with torch.no_grad():
        exact = _Step(model, LENGTH).eval()(*[t.clone() for t in args32])
    half = model.to(torch.bfloat16)
    args = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in args32)
    got, counts = _rewritten(_Step(half, LENGTH).eval(), tuple(t.clone() for t in args))
    assert counts == [2]
    half.config._attn_implementation = "eager"
    with torch.no_grad():
        eager = _Step(half, LENGTH).eval()(*[t.clone() for t in args])
    err_got = (got.float() - exact).abs().max()
    err_eager = (eager.float() - exact).abs().max()
    assert err_got <= 1.5 * err_eager + 1e-2, (err_got, err_eager)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


def test_on_gpus_and_cpus_by_default_not_on_mps() -> None:
    assert groups_on(torch.device("cpu")) and groups_on(torch.device("cuda"))
    assert not groups_on(torch.device("mps"))


@pytest.fixture(scope="module")
def grouped_generator(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Qwen2 generator built with the rewrite on (here on the CPU), saved and loaded."""
    torch.manual_seed(5)
    config = transformers.Qwen2Config(num_key_value_heads=2, **SMALL)
    model = transformers.Qwen2ForCausalLM(config).eval()
    patch = pytest.MonkeyPatch()
    patch.setattr(generation_compile, "groups_on", lambda device: True)
    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Handler()
    logger = logging.getLogger("torch_precompile")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        # One row (two programs): the rewrite at a batch of rows, left-padded, is
        # test_each_familys_decode_step_equals_the_eager_step's (batch 3).
        generator = generation_compile.compile_generator(model, max_batch=1, max_length=48)
    finally:
        patch.undo()
        logger.removeHandler(handler)
        logger.setLevel(level)
    path = tmp_path_factory.mktemp("grouped") / "qwen2.pt"
    Precompile.save(path, generator)
    return {"model": model, "loaded": Precompile.load(path), "records": records}


def test_a_grouped_generator_equals_transformers(grouped_generator: dict[str, Any]) -> None:
    rewritten = [r for r in grouped_generator["records"] if "read the cache's heads" in r]
    # The slot step (generate's decode step too), two layers.
    assert rewritten == ["generator: 2 decode attentions read the cache's heads unrepeated"]
    for batch, length, new in ((1, 5, 12), (1, 9, 20)):
        ids, mask = _prompts(batch, length)
        _same_as_transformers(grouped_generator, ids, mask, new, eos_token_id=None)


def test_importing_the_generation_package_imports_no_compiler() -> None:
    """A served file's load imports this package (the decode step's decompositions are
    referenced from it): it must not bring in sympy, Dynamo or Inductor's compiler. The
    rewrite's size check once imported sympy at the top of its module, and the 0.5B's
    load on a GPU took 0.4 s longer."""
    code = (
        "import sys, json; import torch_precompile.generation; "
        "print(json.dumps([m for m in ('sympy', 'torch._dynamo', 'torch._inductor.compile_fx')"
        " if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
