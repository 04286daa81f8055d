"""compile_generator(weights="int8" | "int4"): quantized generator files served by torch alone.

One small Llama (2 layers, width 128, a 384-token BPE) is trained here for 300
steps on the GPL-3's text (tests/fixtures/trained_lm.py), saved with
save_pretrained, and built three times from that directory: fp32, int8 (per
output channel) and int4 (groups of 64). The quantized files are loaded in
fresh processes where torchao, transformers and a C++ compiler cannot be used,
and served by ``torch-precompile serve``; their tokens are compared with eager
PyTorch over the same quantized weights dequantized, and with the fp32 file
the way vLLM's ``check_logprobs_close`` compares two models.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")

from conftest import ROOT, no_compiler_env, run_script  # noqa: E402
from test_serve import Server  # noqa: E402

from tests.fixtures.quantized_checks import (  # noqa: E402
    MAX_BATCH,
    MAX_LENGTH,
    NEW,
    PROMPT,
    dequantized,
    eager,
    served,
    walk,
)
from tests.fixtures.trained_lm import SHAPE, VOCAB, train, training_text  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile._errors import ArtifactCorruptedError, QuantizationError  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402
from torch_precompile.generation.quantize import INT4_GROUP, int8_weights  # noqa: E402

ROWS = 4  # the fresh process's prompts, one call each
# Logits of int4's bf16-rounded linears against eager's same rounding: a linear's output
# whose last bit rounds the other way moves by one bf16 step (0.031 for values in [4, 8));
# the CPU decode step's attention sums as transformers' eager attention, the reference's
# as SDPA: 2 of 147,456 logits differ by up to 0.024 on a 2-core AMD EPYC.
INT4_ATOL = 3e-2
FORMATS = ("int8", "int4")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("quantized")
    model, tok = train()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    stream = torch.tensor(tok(training_text())["input_ids"])
    step = (len(stream) - PROMPT) // 16  # 16 prompts spread over the text
    prompts = torch.stack([stream[i * step : i * step + PROMPT] for i in range(16)])
    return {"root": root, "model": model, "tokenizer": tok, "prompts": prompts}


@pytest.fixture(scope="module")
def built(trained: dict[str, Any]) -> dict[str, Any]:
    """fp32, int8 and int4 files of the trained model, loaded from its save_pretrained
    directory; the model's weights and modules checked unchanged by each build."""
    root = trained["root"]
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "model").eval()
    tok = transformers.AutoTokenizer.from_pretrained(root / "model")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    out: dict[str, Any] = {"model": model, "tokenizer": tok, "seconds": {}}
    for weights in (None, *FORMATS):
        name = weights or "fp32"
        start = time.monotonic()
        gen = compile_generator(
            model, max_batch=MAX_BATCH, max_length=MAX_LENGTH, tokenizer=tok, weights=weights
        )
        out["seconds"][name] = time.monotonic() - start
        assert [type(m) for m in model.modules()] == kinds
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        Precompile.save(root / f"{name}.pt", gen)
        out[name] = root / f"{name}.pt"
    return out


# --- refused at build, before anything is compiled -------------------------------


def _tiny(**shape: Any) -> Any:
    config = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": 1, **shape})
    return transformers.LlamaForCausalLM(config).eval()


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(QuantizationError, match="weights='int3' is not a format"):
        compile_generator(_tiny(), max_batch=1, max_length=8, weights="int3")


def test_int4_refuses_a_width_that_is_not_a_multiple_of_its_group() -> None:
    model = _tiny(hidden_size=96, intermediate_size=192, num_attention_heads=4)
    with pytest.raises(
        QuantizationError,
        match=r"model\.layers\.0\.self_attn\.q_proj has "
        r"in_features=96, not a multiple of int4's group of 64",
    ):
        compile_generator(model, max_batch=1, max_length=8, weights="int4")
    assert INT4_GROUP == 64


def test_a_decoder_without_linear_layers_is_refused() -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100)
    model = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(
        QuantizationError, match=r"GPT2LMHeadModel: its decoder holds no nn\.Linear"
    ):
        compile_generator(model, max_batch=1, max_length=8, weights="int8")


def test_fused_projections_with_quantized_weights_is_refused() -> None:
    with pytest.raises(QuantizationError, match="fuse_projections=True"):
        compile_generator(_tiny(), max_batch=1, max_length=8, weights="int8", fuse_projections=True)


# --- the files ---------------------------------------------------------------------


def _inspect(path: Path) -> tuple[dict[str, Any], str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent)}
    cmd = [sys.executable, "-m", "torch_precompile", "inspect"]
    as_json = subprocess.run(
        [*cmd, "--json", str(path)], env=env, capture_output=True, text=True, check=True
    )
    text = subprocess.run([*cmd, str(path)], env=env, capture_output=True, text=True, check=True)
    return json.loads(as_json.stdout)["generator"]["weights"], text.stdout


def test_inspect_shows_the_weights_format_and_bytes(built: dict[str, Any]) -> None:
    """14 linears (7 a layer); int8: a byte a weight and a float32 scale a row; int4:
    half a byte a weight, a bfloat16 scale and zero per 64 inputs (a float32 model on
    the CPU: quantize.py); the head and token embedding int8 either way."""
    layer = [(128, 128), (64, 128), (64, 128), (128, 128), (256, 128), (256, 128), (128, 256)]
    weights = sum(n * k for n, k in layer) * 2
    rows = sum(n for n, _ in layer) * 2
    groups = sum(n * k // 64 for n, k in layer) * 2
    fp32, _ = _inspect(built["fp32"])
    assert fp32 == {"format": "float32"}
    # The head and the token embedding (untied here), int8 in both formats: a byte a
    # weight and a float32 scale a row, each.
    head = {"head_bytes": 2 * (VOCAB * 128 + 4 * VOCAB), "head_float_bytes": 2 * 4 * VOCAB * 128}
    int8, text8 = _inspect(built["int8"])
    assert int8 == {
        "format": "int8",
        "group": 0,
        "quantized_layers": 14,
        "bytes": weights + 4 * rows,
        "float_bytes": 4 * weights,
        **head,
    }
    assert "linear weights: int8 per output channel, 14 layers" in text8
    assert f"head and token embedding int8 per row, {head['head_bytes']:,} bytes" in text8
    int4, text4 = _inspect(built["int4"])
    assert int4 == {
        "format": "int4",
        "group": 64,
        "quantized_layers": 14,
        "bytes": weights // 2 + 4 * groups,
        "float_bytes": 4 * weights,
        **head,
    }
    assert "linear weights: int4 groups of 64 inputs" in text4
    # The weights section: smaller than fp32's by what inspect says (names and offsets aside).
    sizes = {name: _weights_section(built[name]) for name in ("fp32", *FORMATS)}
    for r in (int8, int4):
        saved = sizes["fp32"] - sizes[r["format"]]
        said = r["float_bytes"] - r["bytes"] + r["head_float_bytes"] - r["head_bytes"]
        assert abs(saved - said) < 16384, (saved, r)


def _weights_section(path: Path) -> int:
    from torch_precompile.file import reader

    with reader.open_artifact(path) as opened:
        sections = opened.info.sections
    # Every variant loads without the compiler (a "lean" section each; a constant in
    # the compiled graph, as Inductor makes int4's group size, would refuse it).
    compiled = [s for s in sections if s["name"].startswith("compiled")]
    assert len([s for s in sections if s["name"].startswith("lean")]) == len(compiled), path
    return next(s["length"] for s in sections if s["name"] == "weights")


def test_a_flipped_byte_in_the_packed_weights_is_artifact_corrupted(
    built: dict[str, Any], tmp_path: Path
) -> None:
    weight = built["model"].model.layers[1].mlp.down_proj.weight
    q, _ = int8_weights(weight)
    data = bytearray(built["int8"].read_bytes())
    at = data.find(q.numpy().tobytes())
    assert at > 0 and data.find(q.numpy().tobytes(), at + 1) < 0  # the weight, once
    data[at + q.numel() // 2] ^= 0x01
    (tmp_path / "flipped.pt").write_bytes(bytes(data))
    with pytest.raises(ArtifactCorruptedError, match="fails its SHA-256"):
        Precompile.load(tmp_path / "flipped.pt")


@pytest.mark.parametrize("weights", FORMATS)
def test_tokens_equal_eager_torch_over_the_dequantized_weights(
    built: dict[str, Any], trained: dict[str, Any], weights: str
) -> None:
    """Eager transformers over the weights the file holds, dequantized in plain torch:
    the same greedy tokens; the logits as close as two summation orders allow (the
    kernel sums ``x * q`` then scales, eager scales the weight first; int4's linears
    round their outputs to bfloat16, where a sum's last bit can round either way)."""
    prompts = trained["prompts"]
    ref = eager(dequantized(built["model"], weights), prompts)
    tokens, logits = served(built[weights], prompts)
    assert torch.equal(tokens, ref.sequences[:, PROMPT:])
    want = torch.stack(ref.logits, 1)
    atol, rtol = (2e-4, 1e-4) if weights == "int8" else (INT4_ATOL, 1e-2)
    torch.testing.assert_close(torch.stack(logits), want, atol=atol, rtol=rtol)


_FRESH = """
import sys
for name in ("torchao", "transformers"):
    sys.modules[name] = None  # not importable here
import json
import torch
from torch_precompile import Precompile

cases = json.loads(sys.argv[1])
out = {}
for name, case in cases.items():
    gen = Precompile.load(case["path"])
    greedy, sampled = [], []
    for ids in torch.tensor(case["ids"]).split(1):  # one row a call (max_batch=1)
        greedy += gen.generate(ids, max_new_tokens=case["new"], eos_token_id=None).tolist()
        sampled += gen.generate(
            ids, max_new_tokens=case["new"], do_sample=True, temperature=0.9, top_k=50,
            top_p=0.9, seed=11, eos_token_id=None,
        ).tolist()
    out[name] = {"greedy": greedy, "sampled": sampled}
out["imported"] = [
    m for m in ("torchao", "transformers", "torch._dynamo", "torch._inductor.compile_fx", "sympy")
    if sys.modules.get(m) is not None
]
print(json.dumps(out))
"""


def test_a_fresh_process_without_torchao_transformers_or_compiler_generates(
    built: dict[str, Any], trained: dict[str, Any], tmp_path: Path
) -> None:
    """Greedy: eager torch's tokens over the dequantized weights. Sampled: this
    process's tokens from the same file and seed."""
    ids = trained["prompts"][:ROWS]
    cases = {w: {"path": str(built[w]), "ids": ids.tolist(), "new": 12} for w in FORMATS}
    proc = run_script(_FRESH, json.dumps(cases), env=no_compiler_env(tmp_path))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["imported"] == []
    for weights in FORMATS:
        ref = eager(dequantized(built["model"], weights), ids).sequences[:, : PROMPT + 12]
        assert got[weights]["greedy"] == ref.tolist(), weights
        gen = Precompile.load(built[weights])
        here = torch.cat([
            gen.generate(row, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=50,
                         top_p=0.9, seed=11, eos_token_id=None)
            for row in ids.split(1)
        ])  # fmt: skip
        assert got[weights]["sampled"] == here.tolist(), weights
        assert got[weights]["sampled"] != got[weights]["greedy"], weights


_SERVER = """
import sys
for name in ("torchao", "transformers"):
    sys.modules[name] = None
from torch_precompile_cli import main
code = main(sys.argv[1:])
imported = [
    m for m in ("torchao", "transformers", "torch._dynamo", "torch._inductor.compile_fx", "sympy")
    if sys.modules.get(m) is not None
]
print("IMPORTED", imported, file=sys.stderr, flush=True)
sys.exit(code)
"""


def test_serve_answers_a_completion_from_a_quantized_file(
    built: dict[str, Any], trained: dict[str, Any], tmp_path: Path
) -> None:
    """``torch-precompile serve`` over the int4 file, no torchao, transformers or compiler
    in its process: a greedy completion is the file's own greedy tokens, decoded."""
    server = Server(built["int4"], script=_SERVER, env=no_compiler_env(tmp_path))
    try:
        ids = trained["prompts"][3].tolist()
        status, body = server.request(
            "POST",
            "/v1/completions",
            {"model": "int4", "prompt": ids, "max_tokens": 10, "temperature": 0},
        )
    finally:
        log = server.stop()
    assert status == 200, body
    out = Precompile.load(built["int4"]).generate(torch.tensor([ids]), max_new_tokens=10)
    want = built["tokenizer"].decode(out[0, PROMPT:].tolist(), skip_special_tokens=True)
    assert body["choices"][0]["text"] == want and want
    assert "IMPORTED []" in log, log[-2000:]


# --- quality, as the field measures it ----------------------------------------------


def test_quantized_files_stay_close_to_the_fp32_file(
    built: dict[str, Any], trained: dict[str, Any]
) -> None:
    """16 prompts, 24 greedy tokens, each quantized file against the fp32 file: at the
    first differing token each side's is in the other's top 5; the mean |logprob
    difference| of the agreed tokens and the agreed length are printed (pytest -s)."""
    prompts = trained["prompts"]
    fp32, fp32_logits = served(built["fp32"], prompts)
    means = {}
    for weights in FORMATS:
        tokens, logits = served(built[weights], prompts)
        walks = [walk(tokens[r], logits[r], fp32[r], fp32_logits[r]) for r in range(16)]
        assert all(ok for _, _, ok in walks), (weights, [(n, ok) for n, _, ok in walks])
        diffs = [d for _, ds, _ in walks for d in ds]
        agreed = [n for n, _, _ in walks]
        means[weights] = sum(diffs) / len(diffs)
        print(
            f"\n{weights} vs fp32: mean |logprob diff| {means[weights]:.4f} over {len(diffs)} "
            f"tokens; agreed before the first difference {agreed} (of {NEW}); "
            f"{sum(n == NEW for n in agreed)}/16 all {NEW}"
        )
    # int8's rounding is a 16th of int4's step: its outputs are the closer.
    assert means["int8"] < means["int4"]
