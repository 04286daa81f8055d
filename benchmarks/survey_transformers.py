"""Survey: which Hugging Face ``transformers`` architectures go through the staged flow.

Each model is built from a tiny random-init config (nothing is downloaded), in
eval mode, float32, under ``torch.no_grad()``, and goes through
``Precompile.compile``, an in-process comparison with eager, ``Precompile.save``
and ``Precompile.load`` in one fresh interpreter that imports ``transformers``
but constructs none of its modules (``nn.Module.__init__`` raises there for any
class whose module starts with ``transformers``, except in a library module's
top-level code run by an import) and, by default, has no C++
compiler. Every output tensor (a ``DynamicCache``'s included) is compared with
eager at ``rtol=atol=1e-4``.

Usage (repository root)::

    python benchmarks/survey_transformers.py [--models mistral,bart] [--extra] [--out DIR] [--json]

``--extra`` adds variants (sliding windows, ALiBi, left padding) and more
architectures (Mixtral, BLOOM, GPT-J, Mamba, DeBERTa-v2, ...).

Prints one line per model: capture / in-process / save / fresh-load status and
the largest difference, or the failing step's error type and first line. A
``CaptureError`` is a graph break in the library (the construct is named); a
failure after a successful capture is ours. Exits 1 if any model fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 1000
RTOL = ATOL = 1e-4


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _images(size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))


def _models() -> dict[str, tuple[Callable[[], torch.nn.Module], tuple, dict]]:
    import transformers as T

    small = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
    )
    decoder = dict(small, num_key_value_heads=2, max_position_embeddings=64)
    vit = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    seq2seq = dict(
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        vocab_size=VOCAB,
    )
    text = (_ids(2, 16),)
    return {
        "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**decoder)), text, {}),
        "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**decoder)), text, {}),
        "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**decoder, head_dim=16)), text, {}),
        "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**decoder, head_dim=16)), text, {}),
        "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**decoder, head_dim=16)), text, {}),
        "phi3": (
            lambda: T.Phi3ForCausalLM(
                T.Phi3Config(**decoder, pad_token_id=0, bos_token_id=1, eos_token_id=2)
            ),
            text,
            {},
        ),
        "gpt_neox": (
            lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**small, max_position_embeddings=64)),
            text,
            {},
        ),
        "opt": (
            lambda: T.OPTForCausalLM(
                T.OPTConfig(
                    hidden_size=64,
                    num_hidden_layers=2,
                    ffn_dim=128,
                    num_attention_heads=4,
                    vocab_size=VOCAB,
                    max_position_embeddings=64,
                    word_embed_proj_dim=64,
                )
            ),
            text,
            {},
        ),
        "falcon": (
            lambda: T.FalconForCausalLM(
                T.FalconConfig(
                    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB
                )
            ),
            text,
            {},
        ),
        "bart": (
            lambda: T.BartForConditionalGeneration(
                T.BartConfig(**seq2seq, max_position_embeddings=64)
            ),
            text,
            {"decoder_input_ids": _ids(2, 8, seed=1)},
        ),
        "whisper": (
            lambda: T.WhisperModel(
                T.WhisperConfig(
                    **seq2seq,
                    num_mel_bins=16,
                    max_source_positions=8,
                    max_target_positions=32,
                    pad_token_id=0,
                    bos_token_id=1,
                    eos_token_id=2,
                    decoder_start_token_id=1,
                )
            ),
            (torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)),),
            {"decoder_input_ids": _ids(2, 8, seed=1)},
        ),
        "clip": (
            lambda: T.CLIPModel(
                T.CLIPConfig(
                    text_config=dict(
                        small, max_position_embeddings=16, bos_token_id=1, eos_token_id=2
                    ),
                    vision_config=dict(vit),
                    projection_dim=32,
                )
            ),
            (),
            {"input_ids": _ids(2, 16), "pixel_values": _images()},
        ),
        "roberta": (
            lambda: T.RobertaModel(T.RobertaConfig(**small, max_position_embeddings=64)),
            text,
            {},
        ),
        "albert": (lambda: T.AlbertModel(T.AlbertConfig(**small, embedding_size=32)), text, {}),
        "swin": (
            lambda: T.SwinModel(
                T.SwinConfig(
                    image_size=32,
                    patch_size=4,
                    embed_dim=16,
                    depths=[1, 1],
                    num_heads=[2, 2],
                    window_size=4,
                )
            ),
            (_images(),),
            {},
        ),
        "deit": (lambda: T.DeiTModel(T.DeiTConfig(**vit)), (_images(),), {}),
        "segformer": (
            lambda: T.SegformerModel(
                T.SegformerConfig(
                    num_encoder_blocks=2,
                    depths=[1, 1],
                    sr_ratios=[2, 1],
                    hidden_sizes=[16, 32],
                    patch_sizes=[7, 3],
                    strides=[4, 2],
                    num_attention_heads=[1, 2],
                    mlp_ratios=[2, 2],
                )
            ),
            (_images(),),
            {},
        ),
        "wav2vec2": (
            lambda: T.Wav2Vec2Model(
                T.Wav2Vec2Config(
                    hidden_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=128,
                    conv_dim=(16, 16),
                    conv_stride=(5, 2),
                    conv_kernel=(10, 3),
                    num_conv_pos_embeddings=16,
                    num_conv_pos_embedding_groups=4,
                )
            ),
            (),
            {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(0))},
        ),
    }


def _extra_models() -> dict[str, tuple[Callable[[], torch.nn.Module], tuple, dict]]:
    """Variants and more architectures (``--extra``): sliding windows, ALiBi, padding
    masks, mixture of experts, state-space models, more encoders."""
    import transformers as T

    small = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
    )
    decoder = dict(small, num_key_value_heads=2, max_position_embeddings=64)
    text = (_ids(2, 16),)
    left_padded = torch.ones(2, 16, dtype=torch.long)
    left_padded[1, :5] = 0
    audio = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    return {
        "llama_left_padded": (
            lambda: T.LlamaForCausalLM(T.LlamaConfig(**decoder)),
            text,
            {"attention_mask": left_padded},
        ),
        "mistral_sliding": (
            lambda: T.MistralForCausalLM(T.MistralConfig(**decoder, sliding_window=4)),
            text,
            {},
        ),
        "gemma2_sliding": (
            lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**decoder, head_dim=16, sliding_window=4)),
            text,
            {},
        ),
        "gemma3_text": (
            lambda: T.Gemma3ForCausalLM(
                T.Gemma3TextConfig(**decoder, head_dim=16, sliding_window=4)
            ),
            text,
            {},
        ),
        "mixtral": (
            lambda: T.MixtralForCausalLM(
                T.MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2)
            ),
            text,
            {},
        ),
        "falcon_alibi": (
            lambda: T.FalconForCausalLM(
                T.FalconConfig(
                    hidden_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    vocab_size=VOCAB,
                    alibi=True,
                    new_decoder_architecture=False,
                )
            ),
            text,
            {"attention_mask": left_padded},
        ),
        "bloom": (
            lambda: T.BloomForCausalLM(
                T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)
            ),
            text,
            {},
        ),
        "gptj": (
            lambda: T.GPTJForCausalLM(
                T.GPTJConfig(
                    n_embd=64,
                    n_layer=2,
                    n_head=4,
                    rotary_dim=8,
                    vocab_size=VOCAB,
                    bos_token_id=1,
                    eos_token_id=2,
                )
            ),
            text,
            {},
        ),
        "mamba": (
            lambda: T.MambaForCausalLM(
                T.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, state_size=8)
            ),
            text,
            {},
        ),
        "deberta_v2": (
            lambda: T.DebertaV2Model(
                T.DebertaV2Config(
                    **small,
                    max_position_embeddings=64,
                    relative_attention=True,
                    pos_att_type=["p2c", "c2p"],
                )
            ),
            text,
            {},
        ),
        "electra": (
            lambda: T.ElectraModel(
                T.ElectraConfig(**small, embedding_size=32, max_position_embeddings=64)
            ),
            text,
            {},
        ),
        "modernbert": (
            lambda: T.ModernBertModel(
                T.ModernBertConfig(
                    **small,
                    max_position_embeddings=64,
                    local_attention=8,
                    pad_token_id=0,
                    bos_token_id=1,
                    eos_token_id=2,
                    cls_token_id=1,
                    sep_token_id=2,
                )
            ),
            text,
            {},
        ),
        "dinov2": (
            lambda: T.Dinov2Model(
                T.Dinov2Config(
                    hidden_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    image_size=32,
                    patch_size=8,
                )
            ),
            (_images(),),
            {},
        ),
        "hubert": (
            lambda: T.HubertModel(T.HubertConfig(**audio)),
            (),
            {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(0))},
        ),
    }


def output_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in an output: tuples, lists, mappings and plain objects (caches)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 8:
        return []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = list(vars(value).values())
    else:
        return []
    return [t for item in items for t in output_tensors(item, depth + 1)]


def max_diff(got: Any, want: Any) -> float:
    """Largest absolute difference; raises AssertionError if types, counts or values differ."""
    if type(got) is not type(want):
        raise AssertionError(f"output type {type(got).__name__}, eager {type(want).__name__}")
    got_t, want_t = output_tensors(got), output_tensors(want)
    if len(got_t) != len(want_t) or not want_t:
        raise AssertionError(f"{len(got_t)} output tensors, eager {len(want_t)}")
    for g, w in zip(got_t, want_t):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)
    return max((g.float() - w.float()).abs().max().item() for g, w in zip(got_t, want_t))


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# Runs in a fresh interpreter: argv = cases JSON (name -> {path, ref}), this file's path.
_FRESH = r"""
import importlib.util, json, sys, traceback
import torch
import transformers  # the saved code refers to it; no model of it is built here
from torch_precompile import Precompile

cases, survey = json.loads(sys.argv[1]), sys.argv[2]
spec = importlib.util.spec_from_file_location("survey", survey)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
original_init = torch.nn.Module.__init__

def importing_library():
    # A library module's top-level code (transformers.activations builds a few
    # activation modules at import) is importing, not building a model.
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and str(
            frame.f_globals.get("__name__", "")
        ).startswith("transformers"):
            return True
        frame = frame.f_back
    return False

def guarded_init(self, *args, **kwargs):
    if type(self).__module__.startswith("transformers") and not importing_library():
        raise AssertionError(f"{type(self).__qualname__} was constructed at load")
    original_init(self, *args, **kwargs)

torch.nn.Module.__init__ = guarded_init
results = {}
for name, case in cases.items():
    step = "load"
    try:
        art = Precompile.load(case["path"])
        step = "call"
        args, kwargs, want = torch.load(case["ref"], weights_only=False)
        with torch.no_grad():
            got = art(*args, **kwargs)
        step = "compare"
        results[name] = {"ok": True, "max_diff": mod.max_diff(got, want)}
    except Exception as exc:
        results[name] = {"ok": False, "step": step, "error": mod._error(exc),
                         "traceback": traceback.format_exc()[-4000:]}
print("@@RESULTS@@" + json.dumps(results))
"""


def _no_compiler_env(root: str) -> dict[str, str]:
    bin_dir = os.path.join(root, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    os.symlink(sys.executable, os.path.join(bin_dir, "python"))
    cache = os.path.join(root, "inductor-cache")
    os.makedirs(cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.update(
        PATH=bin_dir,
        CC="/bin/false",
        CXX="/bin/false",
        TORCHINDUCTOR_CACHE_DIR=cache,
        PYTHONPATH=ROOT,
    )
    return env


def survey(
    names: list[str], out_dir: str, compiler: bool, fresh_only: bool = False
) -> dict[str, dict]:
    from torch_precompile import CaptureError, Precompile

    logging.getLogger("transformers").setLevel(logging.ERROR)
    models = {**_models(), **_extra_models()}
    rows: dict[str, dict] = {}
    cases: dict[str, dict[str, str]] = {}
    for name in names:
        build, args, kwargs = models[name]
        row = rows[name] = {"capture": "-", "in_process": "-", "save": "-", "fresh": "-"}
        path, ref = os.path.join(out_dir, f"{name}.pt2"), os.path.join(out_dir, f"{name}.ref")
        if fresh_only:
            if os.path.exists(path) and os.path.exists(ref):
                cases[name] = {"path": path, "ref": ref}
            else:
                row["error"] = f"no saved artifact in {out_dir}"
            continue
        step = "build"
        try:
            torch.manual_seed(0)
            model = build().eval()
            with torch.no_grad():
                want = model(*args, **kwargs)
                step = "capture"
                t0 = time.perf_counter()
                try:
                    artifact = Precompile.compile(model, args, kwargs)
                except CaptureError:
                    row["capture"] = "graph break"
                    raise
                row["capture"] = f"ok {time.perf_counter() - t0:.0f}s"
                step = "in_process"
                row["in_process_diff"] = max_diff(artifact(*args, **kwargs), want)
                row["in_process"] = "ok"
            step = "save"
            Precompile.save(path, artifact)
            row["save"] = "ok"
            torch.save((args, kwargs, want), ref)
            cases[name] = {"path": path, "ref": ref}
        except Exception as exc:
            if row[step if step != "build" else "capture"] == "-":
                row[step if step != "build" else "capture"] = "FAIL"
            row["error"] = f"{step}: {_error(exc)}"
            row["traceback"] = traceback.format_exc()[-4000:]
        print(f"  {name}: {row.get('error', 'built')}", file=sys.stderr, flush=True)
    if cases:
        env = _no_compiler_env(tempfile.mkdtemp(dir=out_dir)) if not compiler else None
        env = env or dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.run(
            [sys.executable, "-c", _FRESH, json.dumps(cases), os.path.abspath(__file__)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULTS@@")]
        if not marker:
            for name in cases:
                rows[name]["fresh"] = "FAIL"
                rows[name]["error"] = f"fresh process died ({proc.returncode})"
                rows[name]["traceback"] = proc.stderr[-4000:]
        else:
            for name, res in json.loads(marker[0][len("@@RESULTS@@") :]).items():
                row = rows[name]
                if res["ok"]:
                    row["fresh"] = "ok"
                    row["fresh_diff"] = res["max_diff"]
                else:
                    row["fresh"] = "FAIL"
                    row["error"] = f"fresh {res['step']}: {res['error']}"
                    row["traceback"] = res["traceback"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--out", default="", help="keep artifacts in DIR (default: temporary)")
    parser.add_argument("--with-compiler", action="store_true", help="leave CC/PATH as they are")
    parser.add_argument("--extra", action="store_true", help="add the variants and extra models")
    parser.add_argument(
        "--fresh-only", action="store_true", help="only load what --out DIR already holds"
    )
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print failing tracebacks")
    opts = parser.parse_args()
    known = list(_models()) + list(_extra_models())
    names = [n for n in opts.models.split(",") if n] or list(_models())
    if opts.extra:
        names += [n for n in _extra_models() if n not in names]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(known)}")
    if opts.fresh_only and not opts.out:
        parser.error("--fresh-only needs --out DIR")
    out_dir = opts.out or tempfile.mkdtemp(prefix="survey-")
    os.makedirs(out_dir, exist_ok=True)
    try:
        rows = survey(names, out_dir, opts.with_compiler, opts.fresh_only)
    finally:
        if not opts.out:
            shutil.rmtree(out_dir, ignore_errors=True)
    print(f"{'model':<18} {'capture':<12} {'in-proc':<8} {'save':<5} {'fresh':<6} max diff / error")
    failed = 0
    for name, row in rows.items():
        ok = "error" not in row
        failed += not ok
        tail = f"{row['fresh_diff']:.2e}" if ok else row["error"]
        print(
            f"{name:<18} {row['capture']:<12} {row['in_process']:<8} {row['save']:<5} "
            f"{row['fresh']:<6} {tail}"
        )
        if not ok and opts.verbose:
            print(row["traceback"])
    if opts.json:
        print(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
