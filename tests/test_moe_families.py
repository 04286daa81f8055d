"""Every mixture-of-experts family of transformers 5.23 whose routing is torch operators,
served by torch alone: each built tiny (``hf_models.moe_families``: 2 layers, width 32,
4 experts of which 2 a token, 256 tokens), saved, and served in one fresh process where
``transformers`` cannot be imported, its greedy tokens and every step's
logits equal to transformers' own ``generate``. And the build's proof that a file needs
nothing of the model's library where it is loaded: a model whose compiled code would
read a transformers function at every call is refused at build, naming it; ``inspect``
lists the modules a file imports at load. Its own file (CI time): each build takes
minutes on two cores."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from conftest import run_script  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from tests.fixtures.hf_models import assert_same_logits, moe_families  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile._errors import CaptureError  # noqa: E402
from torch_precompile.cli.inspect_header import header  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402

# One row: two programs a family (left padding through experts is test_generator's
# Mixtral case, at batch 3).
MAX_BATCH, MAX_LENGTH, NEW = 1, 16, 8
FAMILIES = moe_families()
# What a served generator may import at load besides the standard library.
TORCH_ALONE = {"torch", "torch_precompile"}

_SERVE = """
import json, sys
sys.modules["transformers"] = None  # not importable here: nor its registered operators
import torch
from torch_precompile import Precompile

cases = json.loads(sys.argv[1])
for name, case in cases.items():
    saved = torch.load(case["case"])
    out = Precompile.load(case["path"]).generate(
        saved["ids"], saved["mask"], max_new_tokens=saved["new"], eos_token_id=None,
        return_dict_in_generate=True, output_logits=True,
    )
    torch.save({"sequences": out.sequences, "logits": out.logits}, case["out"])
imported = [
    m for m in ("transformers", "torch._dynamo", "torch._inductor.compile_fx", "sympy")
    if sys.modules.get(m) is not None
]
print(json.dumps({"imported": imported}))
"""


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt of 6 tokens."""
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(5))
    return ids, torch.ones_like(ids)


def _eager(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
            eos_token_id=None, return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each family built, saved and compared eagerly; then every file served in one
    process without transformers. A family whose build fails keeps its error."""
    root = tmp_path_factory.mktemp("moe")
    ids, mask = _prompts()
    results: dict[str, Any] = {}
    cases = {}
    for name, make in FAMILIES.items():
        torch.manual_seed(0)
        model = make().eval()
        try:
            generator = compile_generator(model, max_batch=MAX_BATCH, max_length=MAX_LENGTH)
        except Exception as exc:  # reported by the family's own test
            results[name] = {"error": exc}
            continue
        path = root / f"{name}.pt"
        Precompile.save(path, generator)
        torch.save({"ids": ids, "mask": mask, "new": NEW}, root / f"{name}.case")
        results[name] = {"path": path, "want": _eager(model, ids, mask)}
        cases[name] = {
            "path": str(path),
            "case": str(root / f"{name}.case"),
            "out": str(root / f"{name}.out"),
        }
    out = json.loads(run_script(_SERVE, json.dumps(cases)).stdout.splitlines()[-1])
    for name, case in cases.items():
        results[name]["got"] = SimpleNamespace(**torch.load(case["out"]))
    return {"results": results, "imported": out["imported"]}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_serves_with_torch_alone_as_eager(served: dict[str, Any], name: str) -> None:
    case = served["results"][name]
    if "error" in case:
        raise case["error"]
    assert served["imported"] == [], served["imported"]
    assert_same_logits(case["want"], case["got"], f"{name} served without transformers")
    tokens = case["want"].sequences[:, -NEW:]
    assert len(set(tokens.flatten().tolist())) > 2, tokens  # not one repeated token
    # The header says so too: nothing beyond torch and this package at load.
    imports = header(str(case["path"]))["meta"]["imports"]
    packages = {m.split(".")[0] for m in imports["load"]} - set(sys.stdlib_module_names)
    assert packages == TORCH_ALONE, imports["load"]


class _KeepsRotation(torch.nn.Module):
    """A Llama MLP that keeps, at each call, the transformers function it applies: the
    compiled code replays that write, so it reads transformers at every call."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.applied = modeling_llama.rotate_half
        return modeling_llama.rotate_half(self.mlp(x))


def test_a_model_whose_file_needs_transformers_at_load_is_refused_at_build() -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.model.layers[0].mlp = _KeepsRotation(model.model.layers[0].mlp)
    with pytest.raises(CaptureError) as caught:
        compile_generator(model, max_batch=1, max_length=8)
    message = str(caught.value)
    assert "transformers.models.llama.modeling_llama" in message, message
    assert "rotate_half" in message, message
    assert "LlamaForCausalLM" in message, message


_INSPECT = """
import sys
sys.modules["transformers"] = None
from torch_precompile.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_inspect_lists_the_modules_a_file_imports_at_load(
    served: dict[str, Any], tmp_path: Path
) -> None:
    case = served["results"]["phimoe"]
    if "error" in case:
        raise case["error"]
    text = run_script(_INSPECT, "inspect", str(case["path"])).stdout
    line = next(x for x in text.splitlines() if x.startswith("imports:"))
    assert line.startswith("imports:   torch, torch_precompile (and the standard library's"), line
    assert line.endswith("at load"), line
    assert "transformers" not in line, line
    # A file saved before the record (no meta.imports) still reads; inspect says so.
    from torch_precompile.cli.inspect_header import import_lines
    from torch_precompile.file.header import Header

    data = header(str(case["path"]))
    meta = {k: v for k, v in data["meta"].items() if k != "imports"}
    older = Header.decode(data["format_version"], meta, str(case["path"]))
    assert older.imports is None
    assert import_lines(older.imports) == [
        "imports:   not recorded (a file saved before they were)"
    ]
    # A plain artifact whose module holds a transformers function and enum: both named,
    # with the attribute that holds each.
    from transformers.models.llama.modeling_llama import rotate_half
    from transformers.utils.generic import PaddingStrategy

    class Holds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.fn, self.mode = rotate_half, PaddingStrategy.LONGEST

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fn(self.lin(x))
            return y + 1 if self.mode == PaddingStrategy.LONGEST else y

    with torch.no_grad():
        artifact = Precompile.compile(Holds().eval(), (torch.randn(2, 8),), size_one=False)
    Precompile.save(tmp_path / "holds.pt", artifact)
    text = run_script(_INSPECT, "inspect", str(tmp_path / "holds.pt")).stdout
    line = next(x for x in text.splitlines() if x.startswith("imports:"))
    assert "transformers" in line.split("(")[0], line
    assert "skeleton: fn holds transformers.models.llama.modeling_llama.rotate_half" in text
    assert "skeleton: mode holds transformers.utils.generic.PaddingStrategy" in text


class _Touches:
    """Unpickling it would create ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pickle_imports_reads_the_opcodes_and_runs_nothing(tmp_path: Path, protocol: int) -> None:
    import collections
    import pickle

    from torch_precompile.file.pickle_refs import Ref, pickle_imports

    marker = tmp_path / "ran"
    inner = pickle.dumps(collections.OrderedDict(a=1), protocol=protocol)
    data = pickle.dumps({"n": 1, "inner": inner, "x": _Touches(marker)}, protocol=protocol)
    refs = pickle_imports(data)
    assert not marker.exists()
    assert any(r.module == "pathlib" and r.name.startswith("Path") for r in refs), refs
    if protocol >= 3:  # protocol 2 writes bytes as a call of _codecs.encode
        assert Ref("collections", "OrderedDict", where="inner") in refs, refs
    with pytest.raises(ValueError):
        pickle_imports(b"\x80\x04not a pickle")
