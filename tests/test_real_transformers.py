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
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    assert_same_output,
    fresh_load_results,
    no_compiler_env,
    package_warnings,
    run_script,
)

from torch_precompile import CaptureError, GuardError, Precompile
from torch_precompile._compat import TRACES_DEEPCOPY

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
from tests.fixtures.hf_models import (  # noqa: E402
    GPT2,
    SMALL,
    VOCAB,
    extra_models,
    padded_mask,
    staged_models,
    survey_models,
    token_ids,
)

CATALOGUE = {**survey_models(), **extra_models()}
T = transformers

# name -> (build model, positional args, keyword args)
MODELS = staged_models()

# From the survey's catalogue, each guarding a fix: Wav2Vec2's positional convolution
# has a weight_norm parametrization (a module whose class refuses pickling, saved in
# Dynamo's guard state as a plain module); Mamba's traced code asks pytree about its
# inputs, so Dynamo guards the pytree registry, a process global.
MODELS.update({name: CATALOGUE[name] for name in ("wav2vec2", "mamba")})


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
    cases = {}
    for name, (_, args, kwargs) in MODELS.items():
        model = _build(name)
        with package_warnings() as warnings, torch.no_grad():
            want = model(*args, **kwargs)
            artifact, bytecode, guards = _staged(model, args, kwargs)
        path = out_dir / f"{name}.pt2"
        Precompile.save(path, artifact, bytecode, guards)
        ref = out_dir / f"{name}.ref"
        torch.save([(args, kwargs, want)], ref)
        cases[name] = {
            "artifact": artifact,
            "want": want,
            "path": path,
            "ref": ref,
            "warnings": warnings,
        }
    return cases


@pytest.mark.parametrize("name", list(MODELS))
def test_in_process_artifact_matches_eager(built: dict[str, Any], name: str) -> None:
    _, args, kwargs = MODELS[name]
    with torch.no_grad():
        got = built[name]["artifact"](*args, **kwargs)
    assert_same_output(got, built[name]["want"])


@pytest.fixture(scope="module")
def fresh_results(built: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict:
    cases = {n: {"path": str(c["path"]), "ref": str(c["ref"])} for n, c in built.items()}
    root = tmp_path_factory.mktemp("hf-fresh")
    return fresh_load_results(cases, "transformers", no_compiler_env(root))


@pytest.mark.parametrize("name", list(MODELS))
def test_fresh_process_load_matches_eager(fresh_results: dict[str, Any], name: str) -> None:
    result = fresh_results[name]
    assert result["ok"], result["error"]


_LEAN = """
import json, sys
import torch
from torch_precompile import Precompile

cases, out = json.loads(sys.argv[1]), {}
for name, case in cases.items():
    art = Precompile.load(case["path"])
    ids, want = torch.load(case["ids"]), torch.load(case["logits"])
    with torch.no_grad():
        got = art(ids).logits
    kind = type(art.compiled_function).__name__
    out[name] = {"diff": (got - want).abs().max().item(), "path": kind}
heavy = ("torch._dynamo", "torch._inductor.compile_fx", "sympy")
out["imported"] = sorted(
    m for m in sys.modules if m in heavy or m.startswith("transformers.models.")
)
print(json.dumps(out))
"""


def test_decoders_load_lean_without_their_library_or_dynamo(
    built: dict[str, Any], tmp_path: Path
) -> None:
    """GPT-2 and Llama load and run in a fresh process without a compiler, and neither
    their modeling or configuration modules (which import most of ``transformers``,
    Dynamo among it) nor Dynamo, Inductor's compiler or sympy are imported: the
    artifact carries its kernels, lean guards and a stand-in of the config."""
    cases = {}
    for name in ("gpt2", "llama_gqa"):
        args = MODELS[name][1]
        ids, logits = tmp_path / f"{name}.ids", tmp_path / f"{name}.logits"
        torch.save(args[0], ids)
        torch.save(built[name]["want"].logits, logits)
        cases[name] = {"path": str(built[name]["path"]), "ids": str(ids), "logits": str(logits)}
    proc = run_script(_LEAN, json.dumps(cases), env=no_compiler_env(tmp_path))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["imported"] == [], out["imported"]
    for name in cases:
        assert out[name]["path"] == "LeanCompiledFunction", out[name]
        assert out[name]["diff"] < 1e-4, out[name]


def test_static_artifact_refuses_another_shape_after_load(built: dict[str, Any]) -> None:
    art = Precompile.load(built["gpt2"]["path"])
    with torch.no_grad(), pytest.raises(GuardError, match=r"args\[0\]|input_ids"):
        art(token_ids(3, 16))


# ------------------------------------------------- refusals a user can act on


def _refusal(artifact: Any, *args: Any, **kwargs: Any) -> str:
    """The GuardError message of a refused call; one line, no raw guard text."""
    with torch.no_grad(), pytest.raises(GuardError) as info:
        artifact(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "L['" not in message and "a guard failed" not in message
    return message


def test_refusals_name_the_argument_and_a_fix(built: dict[str, Any]) -> None:
    gpt2, bert = built["gpt2"]["artifact"], built["bert_padded"]["artifact"]
    ids, mask = token_ids(2, 16), padded_mask()
    # A keyword the capture did not pass: a flag bound to a parameter, then one
    # collected by **kwargs (the forward accepts any keyword).
    message = _refusal(gpt2, ids, output_attentions=True)
    assert "argument 'output_attentions'" in message and "compile again" in message, message
    message = _refusal(gpt2, ids, unknown_option=3)
    assert message.startswith("keyword argument 'unknown_option' was not passed at capture")
    assert "leave it out" in message, message
    # A keyword that the capture passed, left out.
    message = _refusal(bert, ids)
    assert "'attention_mask'" in message and "pass it" in message, message
    # The same values in another memory layout: Dynamo's stride guard, said in words.
    strided = mask.t().contiguous().t()
    message = _refusal(bert, ids, attention_mask=strided)
    assert "argument 'attention_mask'" in message, message
    assert "pass attention_mask.contiguous()" in message, message
    with torch.no_grad():  # and the advice works
        fixed = bert(ids, attention_mask=strided.contiguous()).last_hidden_state
    torch.testing.assert_close(fixed, built["bert_padded"]["want"].last_hidden_state)
    message = _refusal(gpt2, ids.float())
    assert "expected dtype int64, got float32; pass a tensor of dtype int64" in message, message


_OTHER_MODELS = {
    "more_layers": (
        lambda: T.GPT2LMHeadModel(T.GPT2Config(**{**GPT2, "n_layer": 3})),
        "module 'transformer.h.2' (GPT2Block) is new",
    ),
    "narrower": (
        lambda: T.GPT2LMHeadModel(T.GPT2Config(**{**GPT2, "n_embd": 32})),
        "parameter 'transformer.wte.weight' has shape (1000, 32)",
    ),
    "another_architecture": (
        lambda: T.BertModel(T.BertConfig(**SMALL)),
        "module 'transformer' is missing from the model",
    ),
}


@pytest.mark.parametrize("other", list(_OTHER_MODELS))
def test_load_refuses_a_model_of_another_architecture(built: dict[str, Any], other: str) -> None:
    make, difference = _OTHER_MODELS[other]
    with pytest.raises(GuardError, match="model= is not the model this artifact was") as info:
        Precompile.load(built["gpt2"]["path"], model=make())
    assert difference in str(info.value), info.value
    # The same architecture with other weights is bound, and computes with them.
    torch.manual_seed(1)
    same = T.GPT2LMHeadModel(T.GPT2Config(**GPT2)).eval()
    with torch.no_grad():
        got = Precompile.load(built["gpt2"]["path"], model=same)(token_ids(2, 16)).logits
        torch.testing.assert_close(got, same(token_ids(2, 16)).logits)


@pytest.mark.parametrize("name", list(MODELS))
def test_precompile_logs_one_warning_line(built: dict[str, Any], name: str) -> None:
    """A library model's dropped guards are summarised, not listed, at WARNING."""
    warnings = built[name]["warnings"]
    assert len(warnings) <= 1, warnings
    assert all("\n" not in w and "not re-checked after load" in w for w in warnings)


# ------------------------------------------------- dynamic, training, bfloat16

_DYNAMIC_SIZES = [(3, 24), (4, 5), (8, 128)]


@pytest.fixture(scope="module")
def dynamic_gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """HF GPT-2 captured with ``dynamic=True`` (batch and sequence symbolic), saved."""
    model = _build("gpt2_no_cache")
    with torch.no_grad():
        artifact = Precompile.compile(model, (token_ids(2, 16),), dynamic=True)
    path = tmp_path_factory.mktemp("hf-dynamic") / "gpt2_dynamic.pt2"
    Precompile.save(path, artifact)
    ref = path.with_suffix(".ref")
    calls = [(token_ids(b, s, seed=b * s),) for b, s in _DYNAMIC_SIZES]
    with torch.no_grad():
        torch.save([(args, {}, model(*args)) for args in calls], ref)
    return {"path": path, "ref": ref}


def test_dynamic_decoder_serves_other_sizes_after_fresh_load(
    dynamic_gpt2: dict[str, Any], tmp_path: Path
) -> None:
    """Batch 3..8 and sequence 5..128 from one artifact, in a process without a compiler;
    batch 1 is served by the bundled size-1 variant."""
    case = {"dynamic": {"path": str(dynamic_gpt2["path"]), "ref": str(dynamic_gpt2["ref"])}}
    after = """
art = Precompile.load(cases["dynamic"]["path"])
try:
    with torch.no_grad():
        art(torch.zeros(1, 8, dtype=torch.long))
    results["batch_1"] = "served"
except Exception as exc:
    results["batch_1"] = f"{type(exc).__name__}: {exc}"
"""
    results = fresh_load_results(case, "transformers", no_compiler_env(tmp_path), after=after)
    assert results["dynamic"]["ok"], results["dynamic"]["error"]
    assert results["batch_1"] == "served", results["batch_1"]


_TRAIN_STEPS = 4

_TRAIN = """
import json, logging, sys
import torch
import transformers as T
from torch_precompile import Precompile

logging.getLogger("transformers").setLevel(logging.ERROR)
path, steps = sys.argv[1], int(sys.argv[2])
cfg = dict(json.loads(sys.argv[3]))

def build():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(**cfg)).train()

def curve(model, call):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):  # one batch, so the loss must fall
        loss = call(ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses

eager = build()
bound = build()
art = Precompile.load(path, model=bound)
print(json.dumps({
    "eager": curve(eager, lambda ids: eager(ids, labels=ids)),
    "artifact": curve(bound, lambda ids: art(ids, labels=ids)),
}))
"""

_TRAIN_CONFIG = dict(GPT2, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.fixture(scope="module")
def training_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF GPT-2 captured with grad enabled and ``labels=`` (the loss inside the model)."""
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(**_TRAIN_CONFIG)).train()
    ids = token_ids(2, 16)
    artifact = Precompile.compile(model, (ids,), {"labels": ids})
    assert artifact.training
    out, want = artifact(ids, labels=ids), model(ids, labels=ids)
    assert out.loss.grad_fn is not None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    path = tmp_path_factory.mktemp("hf-train") / "gpt2_train.pt2"
    Precompile.save(path, artifact)
    return path


def test_training_artifact_follows_eager_losses_after_fresh_load(
    training_gpt2: Path, tmp_path: Path
) -> None:
    """AdamW steps on a model bound with model= in a new process, against eager's."""
    proc = run_script(
        _TRAIN,
        str(training_gpt2),
        str(_TRAIN_STEPS),
        json.dumps(_TRAIN_CONFIG),
        env=no_compiler_env(tmp_path),
    )
    curves = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(curves["artifact"]) == _TRAIN_STEPS
    torch.testing.assert_close(
        torch.tensor(curves["artifact"]), torch.tensor(curves["eager"]), rtol=1e-5, atol=0
    )
    assert curves["artifact"][-1] < curves["artifact"][0], curves


def test_bfloat16_gpt2_matches_eager_after_load(tmp_path: Path) -> None:
    """bfloat16 weights and activations: compiled kernels keep float32 intermediates
    where eager rounds to bfloat16 after each op, so logits agree to bfloat16's
    resolution (8 bits of mantissa), not float32's."""
    model = _build("gpt2_no_cache").to(torch.bfloat16)
    ids = token_ids(2, 16)
    with torch.no_grad():
        want = model(ids).logits
        artifact = Precompile.compile(model, (ids,))
    path = tmp_path / "gpt2_bf16.pt2"
    Precompile.save(path, artifact)
    loaded = Precompile.load(path)
    with torch.no_grad():
        got = loaded(ids).logits
    assert got.dtype == torch.bfloat16
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 0.02 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_t5_cache_capture_on_this_torch() -> None:
    """T5 building its cache in forward (``use_cache``, the default) calls
    ``copy.deepcopy(config)``: captured where Dynamo traces it (torch 2.13 on);
    on torch 2.11 a ``CaptureError`` that names the line and the way around it."""
    torch.manual_seed(0)
    config = T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB)
    model = T.T5ForConditionalGeneration(config).eval()
    args, kwargs = (token_ids(2, 16),), {"decoder_input_ids": token_ids(2, 8, seed=1)}
    with torch.no_grad():
        if TRACES_DEEPCOPY:
            gm, _, _ = Precompile.dynamo(model, args, kwargs)
            assert len(list(gm.graph.nodes)) > 10
        else:
            with pytest.raises(CaptureError) as info:
                Precompile.dynamo(model, args, kwargs)
            message = str(info.value)
            assert "copy.deepcopy" in message and "get_text_config" in message, message
            assert "use_cache=False" in message and "2.13" in message, message
