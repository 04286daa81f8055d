"""Hugging Face ``transformers`` models, as users bring them, through the staged flow.

Each model is built from a small random-init config (nothing is downloaded),
run through the four stages, saved, and loaded in one fresh process that has
``transformers`` installed but never constructs a model (``nn.Module.__init__``
of any ``transformers`` class raises there) and has no C++ compiler. Its
outputs, of the library's own output type, must equal eager's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import no_compiler_env, run_script

from torch_precompile import GuardError, Precompile

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
T = transformers

VOCAB = 1000


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _padded_mask() -> torch.Tensor:
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0  # the second sequence is padded
    return mask


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


_SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=VOCAB,
)
_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128)

# name -> (build model, positional args, keyword args)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[Any, ...], dict[str, Any]]] = {
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(**_GPT2)), (_ids(2, 16),), {}),
    "gpt2_no_cache": (
        lambda: T.GPT2LMHeadModel(T.GPT2Config(**_GPT2, use_cache=False)),
        (_ids(2, 16),),
        {},
    ),
    "bert_padded": (
        lambda: T.BertModel(T.BertConfig(**_SMALL, max_position_embeddings=64)),
        (_ids(2, 16),),
        {"attention_mask": _padded_mask()},
    ),
    "distilbert_padded": (
        lambda: T.DistilBertModel(
            T.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=VOCAB)
        ),
        (_ids(2, 16),),
        {"attention_mask": _padded_mask()},
    ),
    "llama_gqa": (
        lambda: T.LlamaForCausalLM(
            T.LlamaConfig(**_SMALL, num_key_value_heads=2, max_position_embeddings=64)
        ),
        (_ids(2, 16),),
        {},
    ),
    "t5": (
        lambda: T.T5ForConditionalGeneration(
            T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB)
        ),
        (_ids(2, 16),),
        {"decoder_input_ids": _ids(2, 8, seed=1)},
    ),
    "vit": (
        lambda: T.ViTModel(
            T.ViTConfig(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                image_size=32,
                patch_size=8,
            )
        ),
        (_images(),),
        {},
    ),
    "resnet": (
        lambda: T.ResNetModel(
            T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
        ),
        (_images(),),
        {},
    ),
    "convnext": (
        lambda: T.ConvNextModel(
            T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)
        ),
        (_images(),),
        {},
    ),
}


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    # Library config warnings (e.g. GPT-2's default bos/eos ids outside a small vocab).
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return MODELS[name][0]().eval()


def _staged(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    gm, bytecode, guards = Precompile.dynamo(model, args, kwargs)
    joint, guards = Precompile.aot_autograd(gm, guards)
    compiled, guards = Precompile.inductor(joint, guards)
    return Precompile.precompile(compiled), bytecode, guards


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name -> artifact, model, eager output and the saved file (each built once)."""
    out_dir = tmp_path_factory.mktemp("hf")
    logger = logging.getLogger("torch_precompile")
    cases = {}
    for name, (_, args, kwargs) in MODELS.items():
        model = _build(name)
        records: list[logging.LogRecord] = []
        handler = logging.Handler(level=logging.WARNING)
        handler.emit = records.append  # type: ignore[method-assign]
        logger.addHandler(handler)
        try:
            with torch.no_grad():
                want = model(*args, **kwargs)
                artifact, bytecode, guards = _staged(model, args, kwargs)
        finally:
            logger.removeHandler(handler)
        path = out_dir / f"{name}.pt2"
        Precompile.save(path, artifact, bytecode, guards)
        ref = out_dir / f"{name}.ref"
        torch.save([(args, kwargs, want)], ref)
        cases[name] = {
            "artifact": artifact,
            "want": want,
            "path": path,
            "ref": ref,
            "warnings": [r.getMessage() for r in records],
        }
    return cases


def _assert_same_output(got: Any, want: Any, **tol: Any) -> None:
    assert type(got) is type(want), (type(got), type(want))
    torch.testing.assert_close(dict(got), dict(want), **tol)


@pytest.mark.parametrize("name", list(MODELS))
def test_in_process_artifact_matches_eager(built: dict[str, Any], name: str) -> None:
    _, args, kwargs = MODELS[name]
    with torch.no_grad():
        got = built[name]["artifact"](*args, **kwargs)
    _assert_same_output(got, built[name]["want"], rtol=1e-4, atol=1e-4)


# One fresh process loads every artifact: transformers is importable there, but no
# transformers model may be constructed, and no C++ compiler can run.
_LOAD_ALL = """
import json, sys
import torch
import transformers
from torch_precompile import Precompile

original_init = torch.nn.Module.__init__

def guarded_init(self, *args, **kwargs):
    if type(self).__module__.startswith("transformers"):
        raise AssertionError(f"{type(self).__name__} was constructed at load")
    original_init(self, *args, **kwargs)

torch.nn.Module.__init__ = guarded_init
cases = json.loads(sys.argv[1])
results = {}
for name, case in cases.items():
    try:
        art = Precompile.load(case["path"])
        for args, kwargs, want in torch.load(case["ref"], weights_only=False):
            with torch.no_grad():
                got = art(*args, **kwargs)
            assert type(got) is type(want), (type(got), type(want))
            torch.testing.assert_close(dict(got), dict(want), rtol=1e-4, atol=1e-4)
            diff = max(
                (g - w).abs().max().item()
                for g, w in zip(dict(got).values(), dict(want).values())
                if isinstance(w, torch.Tensor)
            )
        results[name] = {"ok": True, "max_diff": diff, "output": type(got).__name__}
    except Exception as exc:
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def fresh_results(built: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict:
    cases = {n: {"path": str(c["path"]), "ref": str(c["ref"])} for n, c in built.items()}
    root = tmp_path_factory.mktemp("hf-fresh")
    proc = run_script(_LOAD_ALL, json.dumps(cases), env=no_compiler_env(root))
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(MODELS))
def test_fresh_process_load_matches_eager(fresh_results: dict[str, Any], name: str) -> None:
    result = fresh_results[name]
    assert result["ok"], result["error"]


def test_static_artifact_refuses_another_shape_after_load(built: dict[str, Any]) -> None:
    art = Precompile.load(built["gpt2"]["path"])
    with torch.no_grad(), pytest.raises(GuardError, match="input_ids"):
        art(_ids(3, 16))


@pytest.mark.parametrize("name", list(MODELS))
def test_precompile_logs_one_warning_line(built: dict[str, Any], name: str) -> None:
    """A library model's dropped guards are summarised, not listed, at WARNING."""
    warnings = built[name]["warnings"]
    assert len(warnings) <= 1, warnings
    assert all("\n" not in w and "not re-checked after load" in w for w in warnings)
