"""Generation from a fresh process: ``model.generate`` eager, JIT and precompiled.

For each model (random init from a config, fixed seed; batch 1, greedy):

1. build (own process): build the model, ``compile_for_generation``, save the
   artifact and the state dict (so every later process builds the same model);
2. one fresh process per mode and repeat, with empty ``TORCHINDUCTOR_CACHE_DIR``
   and ``TRITON_CACHE_DIR``. The parent takes ``time.time()`` just before the
   spawn; the child reports

   - ``first_token_s``: wall time from spawn to the end of a ``max_new_tokens=1``
     ``generate`` (synchronised): import, model build, load/compile, prefill;
   - ``tokens_per_s``: ``new_tokens`` / time of one full ``generate``
     (``min_new_tokens = max_new_tokens = new_tokens``, prefill included), timed
     after one untimed full ``generate`` (warm-up: JIT compiles of the decode step
     are excluded here, included in ``first_token_s`` only as far as the prefill).

Modes: ``eager``; ``torch.compile`` (``model.forward = torch.compile(model.forward)``,
default mode); ``hf_static`` (transformers' static cache,
``cache_implementation="static"``: generate compiles the decode step with its
default ``CompileConfig``, reduce-overhead; CUDA only); ``precompile``
(``Precompile.load(path, model=model)`` + ``generate_with``);
``precompile_standalone`` (``Precompile.load(path)``, the file's weights; the
model is still built and initialised, to drive ``generate``);
``precompile_shell`` (``Precompile.load(path)``, and ``generate`` driven by a
shell of the model built on the ``meta`` device: no weights allocated or
initialised). Greedy tokens of each mode are compared with eager's.
``generator``: the generator artifact (``compile_generator``: the KV cache as
plain tensors the file's runtime owns), loaded with ``Precompile.load(path)``
and served by ``gen.generate`` in a process that never imports transformers
(checked: the child records what it imported), the device's lazy set-up run
beside the load (``runtime/warm.py``, on by default on CUDA); ``generator_cold``:
the same without it (``TORCH_PRECOMPILE_WARM_UP=0``). ``floor``: ``import torch``,
the CUDA context and one kernel, what every mode pays. ``--batches 1,4``
measures each batch size; a batch of more than one row is left-padded (row
``r`` starts with ``4 r`` pad tokens), as servers send it, and every row's
tokens are compared with eager's. ``--parallel-builds`` builds the models'
artifacts side by side before any measurement (the measurements stay one
process at a time).
``--layers N`` builds each model with N decoder layers (its own folder under
``--workdir``), for quick checks of a size's per-process costs.
``--single-batch`` builds the batch-1 programs only (4 variants, not 8);
``--ours-mode reduce-overhead --ours-static`` builds and runs the precompile
modes with CUDA graphs and a ``StaticCache`` (the match of ``hf_static``).

Usage (repository root)::

    PYTHONPATH=. python benchmarks/generation.py --models gpt2,llama --device cuda
    PYTHONPATH=. python benchmarks/generation.py --tiny --device cpu --new-tokens 4
    PYTHONPATH=. python benchmarks/generation.py --models gpt2,llama --batches 1,4 \
        --modes floor,eager,hf_static,precompile,generator --ours-mode reduce-overhead \
        --ours-static --parallel-builds
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from harness import child_env, write_result

SEED = 0
MODES = (
    "floor",
    "eager",
    "torch.compile",
    "hf_static",
    "precompile",
    "precompile_standalone",
    "precompile_shell",
    "generator",
    "generator_cold",
)
PAD_STEP = 4  # row r of a batch starts with PAD_STEP * r pad tokens
# The sizes users run, by their published configs (random init): Qwen2.5-0.5B,
# Llama-3.2-3B, Llama-3.1-8B.
SIZES = {
    "qwen05": (
        "Qwen2Config",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    "llama3b": (
        "LlamaConfig",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
    "llama8b": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
}
# HBM bandwidth (bytes/s) by device name, for the decode's share of the bound.
HBM = {"H100": 3.35e12, "H200": 4.8e12}


def make_config(name: str, tiny: bool, layers: int = 0):
    """The model's config; ``layers`` (not 0): that many decoder layers instead."""
    config = _config(name, tiny)
    if layers:
        for key in ("num_hidden_layers", "n_layer"):
            if hasattr(config, key):
                setattr(config, key, layers)
    return config


def _config(name: str, tiny: bool):
    import transformers

    if name == "gpt2":
        if tiny:
            return transformers.GPT2Config(
                n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=256
            )
        return transformers.GPT2Config()
    if name == "llama":
        if tiny:
            return transformers.LlamaConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=512,
                max_position_embeddings=256,
            )
        return transformers.LlamaConfig(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=2048,
        )
    if name in SIZES:
        cls, fields = SIZES[name]
        return getattr(transformers, cls)(**fields)
    raise ValueError(f"unknown model {name!r}")


def build_model(a, state_path: str | None, shell: bool = False):
    import torch
    import transformers

    config = make_config(a.model, a.tiny, a.layers)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(SEED)
    cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "qwen05": transformers.Qwen2ForCausalLM,
    }.get(a.model, transformers.LlamaForCausalLM)
    with torch.device("meta" if shell else a.device):
        model = cls(config)
    model = model.to(dtype).eval()
    if state_path is not None and not shell and os.path.exists(state_path):
        state = torch.load(state_path, map_location=a.device, weights_only=True)
        model.load_state_dict(state)
    model.generation_config.pad_token_id = model_meta(model)["pad"]
    return model


def model_meta(model) -> dict:
    """What a child that does not import transformers needs to build the same inputs."""
    eos, vocab = model.config.eos_token_id, model.config.vocab_size
    pad = eos if eos is not None and eos < vocab else 0  # tiny configs keep GPT-2's eos id
    return {"vocab": vocab, "pad": pad, "eos": eos, "bytes_per_token": weight_bytes(model)}


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once (tied ones once),
    less an untied input embedding, of which a step gathers one row per token."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def make_inputs(meta: dict, a):
    """(ids, mask) of ``a.batch`` rows, left-padded, from a fixed seed (torch only)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, meta["vocab"], (a.batch, a.prompt), generator=gen)
    mask = torch.ones_like(ids)
    for r in range(1, a.batch):
        pad = min(PAD_STEP * r, a.prompt - 1)
        ids[r, :pad] = meta["pad"]
        mask[r, :pad] = 0
    return ids.to(a.device), mask.to(a.device)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(run, a, meta: dict) -> tuple[dict, Any]:
    """``run(n)`` generates n tokens: the first token from spawn, a warm-up (CUDA graphs
    are recorded there), then a timed run; decode is that run less a one-token run
    (the prefill and first token). Returns the figures and the timed run's output."""
    run(1)
    sync(a.device)
    first_token_s = time.time() - a.t0
    t = time.perf_counter()
    run(a.new_tokens)
    sync(a.device)
    warmup_s = time.perf_counter() - t
    t = time.perf_counter()
    out = run(a.new_tokens)
    sync(a.device)
    dt = time.perf_counter() - t
    t = time.perf_counter()
    run(1)
    sync(a.device)
    decode_s = (dt - (time.perf_counter() - t)) / max(1, a.new_tokens - 1)
    figures = {
        "first_token_s": first_token_s,
        "decode_ms_per_token": decode_s * 1e3,
        "decode_tokens_per_s": a.batch / decode_s,
        "hbm_share": hbm_share(meta, 1 / decode_s),
        "warmup_generate_s": warmup_s,
        "generate_s": dt,
        "tokens_per_s": a.new_tokens * a.batch / dt,
    }
    return figures, out


def ours_generate_kwargs(a) -> dict:
    """What ``generate`` is given in the precompile modes (and told at build)."""
    return {"cache_implementation": "static"} if a.ours_static else {}


def child_build(a) -> dict:
    import torch

    from torch_precompile import Precompile
    from torch_precompile.generation import compile_for_generation

    began = time.perf_counter()
    model = build_model(a, None)
    meta = model_meta(model)
    with open(os.path.join(a.dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    out: dict = {"model_s": time.perf_counter() - began}
    if not a.weights:  # a quantized build's eager side is the same seed's float model
        began = time.perf_counter()
        torch.save(model.state_dict(), os.path.join(a.dir, "state.pt"))
        out["state_save_s"] = time.perf_counter() - began
    modes = a.modes.split(",")
    if any(m.startswith("precompile") for m in modes):
        a.batch = 1
        ids, _ = make_inputs(meta, a)
        t = time.perf_counter()
        artifact = compile_for_generation(
            model, ids, single_batch=a.single_batch, mode=a.ours_mode, **ours_generate_kwargs(a)
        )
        out["compile_s"] = time.perf_counter() - t
        path = os.path.join(a.dir, "artifact.pt")
        Precompile.save(path, artifact)
        out["artifact_bytes"] = os.path.getsize(path)
    if any(m.startswith("generator") for m in modes):
        from torch_precompile.generation import compile_generator

        t = time.perf_counter()
        generator = compile_generator(
            model,
            max_batch=max(int(b) for b in a.batches.split(",")),
            max_length=a.prompt + a.new_tokens,
            mode=a.ours_mode,
            options=json.loads(a.ours_options) if a.ours_options else None,
            fuse_projections=a.fused,
            weights=a.weights,
        )
        out["generator_compile_s"] = time.perf_counter() - t
        if a.weights:  # a step reads the packed weights and scales, not the float ones
            spec = generator.spec
            meta["bytes_per_token"] += spec.quantized_bytes - spec.float_bytes
            with open(os.path.join(a.dir, "meta.json"), "w") as f:
                json.dump(meta, f)
        path = os.path.join(a.dir, "generator.pt")
        t = time.perf_counter()
        Precompile.save(path, generator)
        out["generator_save_s"] = time.perf_counter() - t
        out["generator_bytes"] = os.path.getsize(path)
    # A build that dies (a kill for memory shows as "exit -9") is judged against these.
    out["peak_host_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    if a.device == "cuda":
        out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def child_floor(a) -> dict:
    """``import torch``, the CUDA context and one kernel: what every mode pays first."""
    import torch

    x = torch.ones(8, device=a.device)
    (x * 2).sum().item()
    return {"first_token_s": time.time() - a.t0, "tokens_per_s": 0.0, "tokens": []}


def trace_summary(trace) -> dict:
    """A load's trace: every phase; the reads and checksums of 1 MB or more, and the
    count, bytes and seconds of all of them."""
    out: dict = {"phase": [[e.name, round(e.seconds, 4)] for e in trace.of("phase")]}
    for kind in ("read", "hash"):
        events = trace.of(kind)
        out[kind] = [[e.name, e.nbytes, round(e.seconds, 4)] for e in events if e.nbytes >= 1 << 20]
        out[kind + "_all"] = [
            len(events),
            sum(e.nbytes for e in events),
            round(sum(e.seconds for e in events), 4),
        ]
    return out


def child_generator(a) -> dict:
    """The generator artifact, served by torch and torch_precompile alone."""
    import torch

    from torch_precompile import Precompile

    phases = {"imports": time.time() - a.t0}
    with open(os.path.join(a.dir, "meta.json")) as f:
        meta = json.load(f)
    ids, mask = make_inputs(meta, a)
    phases["inputs"] = time.time() - a.t0
    path = os.path.join(a.dir, "generator.pt")
    from torch_precompile.file.trace import recording

    profiler = cProfile.Profile() if a.profile_load else None
    began = time.perf_counter()
    with recording() as trace:  # each phase, section read and checksum of the load
        if profiler is not None:
            profiler.enable()
        gen = Precompile.load(path)
        sync(a.device)
        if profiler is not None:
            profiler.disable()
    load_s = time.perf_counter() - began
    extra = {"load_profile": _stats(profiler, "cumulative", 40)} if profiler else {}
    load_trace = trace_summary(trace)
    phases["load"] = time.time() - a.t0

    def run(n: int):
        return gen.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=meta["pad"],
            do_sample=False,
        )

    with torch.no_grad():
        figures, out = timed_generate(run, a, meta)
        heavy = ("transformers", "torch._dynamo", "torch._inductor.compile_fx", "sympy")
        imported = [m for m in heavy if m in sys.modules]  # the profiler imports Dynamo
        profile = decode_profile(run, a) if a.device == "cuda" else {}
        if a.profile_decode:  # the host's side of decode: Python per token, by function
            profiler = cProfile.Profile()
            profiler.enable()
            run(64)
            sync(a.device)
            profiler.disable()
            extra["decode_host_profile_64_tokens"] = _stats(profiler, "tottime", 30)
    with open(os.path.join(a.dir, f"generator_tokens_b{a.batch}.json"), "w") as f:
        json.dump(out[:, a.prompt :].tolist(), f)
    return {
        **figures,
        "phases_from_spawn_s": phases,
        "load_s": load_s,
        "load_gb_per_s": os.path.getsize(path) / load_s / 1e9,
        "file_bytes": os.path.getsize(path),
        "load_trace": load_trace,
        **profile,
        **extra,
        "tokens": out[:, a.prompt :].tolist(),
        "imported": imported,
    }


def _stats(profiler: cProfile.Profile, key: str, lines: int) -> str:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(lines)
    return text.getvalue()[-12000:]


def hbm_share(meta: dict, steps_per_s: float) -> float | None:
    """Decode's share of the HBM bound: weight bytes per step (one step reads them once
    for every row) over the card's bandwidth; the KV cache's reads, small at these
    lengths, are left out."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    bandwidth = next((v for k, v in HBM.items() if k in name), None)
    return None if bandwidth is None else meta["bytes_per_token"] * steps_per_s / bandwidth


def decode_profile(run, a) -> dict:
    """Where a decode token goes on the GPU (profiler): a one-token run (the prefill and
    its token) and a run of ``n`` tokens; per decode token, the kernels and busy time of
    the longer run less the shorter's, over ``n - 1``. Kernels named by their time in the
    decode tokens."""
    from torch.profiler import ProfilerActivity, profile

    n = 33
    try:
        counted = []
        for tokens in (1, n):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run(tokens)
                sync(a.device)
            counted.append([e for e in prof.events() if e.device_type.name == "CUDA"])
        prefill, longer = counted
        top: dict = {}
        for sign, kernels in ((1, longer), (-1, prefill)):
            for e in kernels:
                top[e.name[:60]] = top.get(e.name[:60], 0.0) + sign * e.device_time
        busy_us = sum(e.device_time for e in longer) - sum(e.device_time for e in prefill)
        return {
            "profile_tokens": n,
            "prefill_kernels": len(prefill),
            "prefill_gpu_busy_ms": sum(e.device_time for e in prefill) / 1e3,
            "kernels_per_token": (len(longer) - len(prefill)) / (n - 1),
            "gpu_busy_ms_per_token": busy_us / (n - 1) / 1e3,
            "top_kernels_us": dict(sorted(top.items(), key=lambda kv: -kv[1])[:8]),
        }
    except Exception as e:  # the profile is extra: a failure is reported, not fatal
        return {"profile_error": f"{type(e).__name__}: {e}"}


def child_check(a) -> dict:
    """vLLM's check at batch 1: eager's greedy output (with its scores) against the
    generator's (its own programs fed its own tokens); each side's token at the first
    difference must be in the other's top-5."""
    import torch

    from torch_precompile import Precompile
    from torch_precompile.generation.numerics import (
        check_logprobs_close,
        generator_topk,
        topk_of_scores,
    )

    model = build_model(a, os.path.join(a.dir, "state.pt"))
    with open(os.path.join(a.dir, "meta.json")) as f:
        ids, mask = make_inputs(json.load(f), a)
    with open(os.path.join(a.dir, "generator_tokens_b1.json")) as f:
        theirs = json.load(f)[0]
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=len(theirs),
            min_new_tokens=len(theirs),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        ours = out.sequences[0, ids.shape[1] :].tolist()
        eager_topk = topk_of_scores(out.logits)
        del model
        gen = Precompile.load(os.path.join(a.dir, "generator.pt"))
        gen_topk = generator_topk(gen, ids[0], theirs)
    first = next((j for j, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
    try:
        found = check_logprobs_close(
            ours, eager_topk, theirs, gen_topk, name_0="eager", name_1="generator"
        )
        verdict = "equal" if found is None else f"close (first differ at {found.index})"
    except AssertionError as e:
        verdict = f"NOT close: {e}"
    teacher_forced_equal = sum(
        t[0] == x for t, x in zip(gen_topk, theirs)
    )  # the generator's programs fed its tokens give back its own argmax
    return {
        "check": verdict,
        "first_difference": first,
        "equal_tokens": sum(x == y for x, y in zip(ours, theirs)),
        "generator_argmax_reproduced": f"{teacher_forced_equal}/{len(theirs)}",
        "first_token_s": 0.0,
        "tokens_per_s": 0.0,
    }


def child_measure(a) -> dict:
    if a.mode == "check":
        return child_check(a)
    if a.mode == "floor":
        return child_floor(a)
    if a.mode in ("generator", "generator_cold"):  # the warm-up set in its env by start()
        return child_generator(a)
    import torch
    import transformers  # noqa: F401  (timed as a phase of its own)

    phases = {"imports": time.time() - a.t0}  # seconds from spawn, cumulative
    if a.device == "cuda":  # the CUDA context, which every mode pays
        torch.zeros(1, device=a.device)
        sync(a.device)
        phases["cuda_init"] = time.time() - a.t0
    shell = a.mode == "precompile_shell"
    model = build_model(a, os.path.join(a.dir, "state.pt"), shell=shell)
    with open(os.path.join(a.dir, "meta.json")) as f:
        meta = json.load(f)
    ids, mask = make_inputs(meta, a)
    phases["model"] = time.time() - a.t0
    extra: dict = {}
    extra_result: dict = {}
    ctx = None
    if a.mode == "torch.compile":
        model.forward = torch.compile(model.forward)
    elif a.mode == "hf_static":
        if a.device != "cuda":
            raise RuntimeError(
                "hf_static compiles only on CUDA (transformers' auto-compile criteria)"
            )
        extra["cache_implementation"] = "static"
    elif a.mode in ("precompile", "precompile_standalone", "precompile_shell"):
        from torch_precompile import Precompile
        from torch_precompile.generation import generate_with

        path = os.path.join(a.dir, "artifact.pt")
        # standalone: the artifact computes with the file's weights (the model only drives generate)
        from torch_precompile.file.trace import recording

        profile = cProfile.Profile() if a.profile_load else None
        if profile is not None:
            profile.enable()
        with recording() as trace:  # each phase, section read and checksum of the load
            loaded = (
                Precompile.load(path, model=model)
                if a.mode == "precompile"
                else Precompile.load(path)
            )
        extra_result["load_trace"] = trace_summary(trace)
        if profile is not None:
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
            extra_result["load_profile"] = text.getvalue()[-12000:]
        ctx = generate_with(model, loaded)
        extra.update(ours_generate_kwargs(a))
        phases["load"] = time.time() - a.t0
    elif a.mode != "eager":
        raise ValueError(a.mode)

    def gen(n: int):
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            **extra,
        )

    if ctx is not None:
        ctx.__enter__()
    try:
        with torch.no_grad():
            figures, out = timed_generate(gen, a, meta)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return {
        **figures,
        "phases_from_spawn_s": phases,
        "tokens": out[:, ids.shape[1] :].tolist(),
        **extra_result,
    }


def child(a) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(
        max(5.0, a.timeout - 15), exit=False
    )  # a hang explains itself
    if a.stacks_every:  # where a long build spends its time, into its folder
        _sample_stacks(os.path.join(a.dir, f"stacks-{a.child}.txt"), a.stacks_every)
    try:
        result = child_build(a) if a.child == "build" else child_measure(a)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)


def _sample_stacks(path: str, every: float) -> None:
    """Append the main thread's Python stack to ``path`` every ``every`` seconds, from a
    daemon thread holding the GIL (faulthandler's repeated dumps read the frames
    without it, and crashed the builds they were to explain)."""
    import threading

    main = threading.main_thread().ident

    def sample() -> None:
        began = time.perf_counter()
        while True:
            time.sleep(every)
            frame = sys._current_frames().get(main)
            if frame is None:
                return
            with open(path, "a") as f:
                f.write(f"--- {time.perf_counter() - began:.0f} s\n")
                f.writelines(traceback.format_stack(frame))

    threading.Thread(target=sample, daemon=True).start()


def child_argv(a, role: str, model: str, workdir: str, mode: str, batch: int) -> list[str]:
    return (
        [sys.executable, os.path.abspath(__file__), "--child", role, "--model", model]
        + ["--dir", workdir, "--mode", mode, "--new-tokens", str(a.new_tokens)]
        + ["--prompt", str(a.prompt), "--device", a.device, "--batch", str(batch)]
        + ["--batches", a.batches, "--modes", a.modes]
        + (["--tiny"] if a.tiny else [])
        + (["--layers", str(a.layers)] if a.layers else [])
        + (["--single-batch"] if a.single_batch else [])
        + (["--ours-static"] if a.ours_static else [])
        + (["--ours-mode", a.ours_mode] if a.ours_mode else [])
        + (["--ours-options", a.ours_options] if a.ours_options else [])
        + (["--weights", a.weights] if a.weights else [])
        + (["--fused"] if a.fused else [])
        + (["--profile-load"] if a.profile_load else [])
        + (["--profile-decode"] if a.profile_decode else [])
        + (["--stacks-every", str(a.stacks_every)] if a.stacks_every else [])
    )


def start(a, role: str, model: str, workdir: str, mode: str = "", batch: int = 1):
    """A child process with empty compiler caches, and what ``finish`` needs."""
    caches = tempfile.mkdtemp(prefix="caches-")
    env = child_env(caches)
    env.pop("TORCH_PRECOMPILE_WARM_UP", None)  # the package's default, but in generator_cold
    if mode == "generator_cold":
        env["TORCH_PRECOMPILE_WARM_UP"] = "0"
    t0 = time.time()
    argv = [*child_argv(a, role, model, workdir, mode, batch), "--t0", repr(t0)]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    limit = a.build_timeout if role == "build" and a.build_timeout else a.timeout
    return proc, t0, caches, limit


def finish(a, started) -> dict:
    proc, t0, caches, limit = started
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, limit - (time.time() - t0)))
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            result = json.loads(lines[-1][len("RESULT ") :])
        else:
            result = {"error": f"exit {proc.returncode}, no result", "stderr": stderr[-3000:]}
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        result = {"error": f"timeout after {limit} s"}
    result["process_s"] = time.time() - t0
    shutil.rmtree(caches, ignore_errors=True)
    return result


def spawn(a, role: str, model: str, workdir: str, mode: str = "", batch: int = 1) -> dict:
    return finish(a, start(a, role, model, workdir, mode, batch))


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": runs}
    if ok:
        out["first_token_s"] = statistics.median(r["first_token_s"] for r in ok)
        out["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
    else:
        out["error"] = runs[0].get("error") if runs else "no runs"
    return out


def parent(a) -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(3600, exit=False)

    results: dict = {
        "device": a.device,
        "device_name": torch.cuda.get_device_name()
        if a.device == "cuda" and torch.cuda.is_available()
        else "cpu",
        "torch": torch.__version__,
        "argv": sys.argv,
        "batches": a.batches,
        "prompt": a.prompt,
        "new_tokens": a.new_tokens,
        "tiny": a.tiny,
        "single_batch": a.single_batch,
        "ours_mode": a.ours_mode,
        "ours_static": a.ours_static,
        "fused": a.fused,
        "weights": a.weights,
        "models": {},
    }
    try:
        import transformers

        results["transformers"] = transformers.__version__
    except ImportError:
        pass
    modes = [m for m in a.modes.split(",") if m]
    batches = [int(b) for b in a.batches.split(",")]
    models = [m for m in a.models.split(",") if m]
    workdirs = {m: tempfile.mkdtemp(prefix=f"gen-{m}-") for m in models}
    builds = {}
    if a.workdir:  # builds kept there, and reused when already made (--modes '' builds only)
        layers = f"-{a.layers}-layers" if a.layers else ""
        layers += f"-{a.weights}" if a.weights else ""
        workdirs = {m: os.path.join(a.workdir, m + layers) for m in models}
        for m, d in workdirs.items():
            os.makedirs(d, exist_ok=True)
            if os.path.exists(os.path.join(d, "build.json")):
                with open(os.path.join(d, "build.json")) as f:
                    builds[m] = json.load(f)
    if a.parallel_builds:  # side by side, before any measurement
        started = {m: start(a, "build", m, workdirs[m]) for m in models if m not in builds}
        builds |= {m: finish(a, started[m]) for m in started}
    for model in models:
        workdir = workdirs[model]
        entry: dict = {}
        if model not in builds:
            print(f"[{model}] build ...", flush=True)
            builds[model] = spawn(a, "build", model, workdir)
        entry["build"] = builds[model]
        if a.workdir:  # a failed build is kept apart, and built again by the next run
            name = "build-error.json" if "error" in builds[model] else "build.json"
            with open(os.path.join(workdir, name), "w") as f:
                json.dump(builds[model], f)
        print(
            f"[{model}] build: "
            + json.dumps({k: v for k, v in entry["build"].items() if k != "traceback"})[:1500],
            flush=True,
        )
        if a.build_only:
            continue
        results["models"][model] = entry
        only = dict(item.split(":", 1) for item in a.model_modes.split(";") if item)
        model_modes = only[model].split(",") if model in only else modes
        for batch in batches:
            for mode in model_modes:
                key = f"{mode} b{batch}"
                if mode != "floor" and "error" in entry["build"]:
                    entry[key] = {"error": "build failed: " + entry["build"]["error"]}
                    continue
                if mode == "floor" and batch != batches[0]:
                    continue
                runs = []
                for _ in range(a.repeats):
                    r = spawn(a, "measure", model, workdir, mode, batch)
                    runs.append(r)
                    shown = {k: v for k, v in r.items() if k != "tokens" and "profile" not in k}
                    print(f"[{model}] {key}: " + json.dumps(shown)[:600], flush=True)
                entry[key] = summarize(runs)
                write(a, results, modes, batches)  # what is measured survives a time limit
            eager = next(
                (
                    r["tokens"]
                    for r in entry.get(f"eager b{batch}", {}).get("runs", [])
                    if "tokens" in r
                ),
                None,
            )
            for mode in modes:
                e = entry.get(f"{mode} b{batch}", {})
                toks = [r["tokens"] for r in e.get("runs", []) if r.get("tokens")]
                if eager is not None and toks and mode != "eager":
                    e["tokens_equal_eager"] = all(t == eager for t in toks)
                    e["rows_equal_eager"] = [sum(x == y for x, y in zip(t, eager)) for t in toks]
        checked = "check" in a.checks.split(",") and "generator" in model_modes
        if checked and 1 in batches:
            r = spawn(a, "measure", model, workdir, "check", 1)
            print(f"[{model}] check: " + json.dumps(r)[:600], flush=True)
            entry["check b1"] = r
            gen_entry = entry.get("generator b1")
            if gen_entry is not None:
                gen_entry["decode_check"] = r.get("check", r.get("error"))
        results["models"][model] = entry
        if not a.workdir:  # a --workdir build stays for the next run
            shutil.rmtree(workdir, ignore_errors=True)
        write(a, results, modes, batches)


def _rate(value: float | None) -> str:
    """A decode rate for the table; not positive when the two timings it is the
    difference of are within noise (a few tokens on a busy machine): shown as such."""
    if value is None:
        return ""
    return f"{value:.1f}" if value > 0 else "(noise)"


def write(a, results: dict, modes: list[str], batches: list[int]) -> None:
    table = [
        f"Generation, prompt {a.prompt}, {a.new_tokens} new tokens, greedy, batches "
        f"{a.batches} (left-padded: row r starts with {PAD_STEP} r pad tokens); "
        f"device {results['device_name']}, torch {results['torch']}, "
        f"transformers {results.get('transformers')}; median of {a.repeats} fresh "
        "process(es), empty compiler caches. tokens/s counts every row's tokens.",
        "",
        "| model | batch | mode | first token from spawn (s) | tokens/s | decode tokens/s "
        "| HBM bound share | load GB/s | rows == eager | note |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for model, entry in results["models"].items():
        b = entry["build"]
        if "error" in b:
            note = f"build error: {str(b['error'])[:200]}"
        else:
            note = "; ".join(
                f"{what} {b[k]:.1f} s, file {b[size] / 1e6:.1f} MB"
                for what, k, size in (
                    ("compile_for_generation", "compile_s", "artifact_bytes"),
                    ("compile_generator", "generator_compile_s", "generator_bytes"),
                )
                if k in b
            )
        table.append(f"| {model} | | build | | | | | | | {note} |")
        for batch in batches:
            for mode in modes:
                e = entry.get(f"{mode} b{batch}")
                if e is None:
                    continue
                if "first_token_s" in e:
                    run = next(r for r in e["runs"] if "error" not in r)
                    phases = ", ".join(
                        f"{k} {v:.2f}" for k, v in run.get("phases_from_spawn_s", {}).items()
                    )
                    if run.get("imported"):
                        phases += f"; imported {run['imported']}"
                    rows = e.get("rows_equal_eager")
                    same = "" if rows is None else f"{min(rows)}/{batch}"
                    share = run.get("hbm_share")
                    gbs = run.get("load_gb_per_s")
                    if "decode_check" in e:
                        phases += f"; {e['decode_check']}"
                    table.append(
                        f"| {model} | {batch} | {mode} | {e['first_token_s']:.2f} | "
                        f"{e['tokens_per_s']:.1f} | {_rate(run.get('decode_tokens_per_s'))} | "
                        f"{'' if share is None else f'{share:.0%}'} | "
                        f"{'' if gbs is None else f'{gbs:.1f}'} | {same} | {phases} |"
                    )
                else:
                    err = str(e.get("error", "")).replace("|", "/").replace("\n", " ")[:200]
                    table.append(f"| {model} | {batch} | {mode} | | | | | | | error: {err} |")
    md = "\n".join(table)
    results["table_md"] = md
    print(md)
    out_dir = a.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "generation.json")
    write_result(path, results)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="gpt2")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1", help="batch sizes (rows left-padded), e.g. 1,4")
    p.add_argument(
        "--parallel-builds", action="store_true", help="build every model before measuring"
    )
    p.add_argument("--tiny", action="store_true", help="tiny configs, for a quick end-to-end check")
    p.add_argument(
        "--layers", type=int, default=0, help="decoder layers of each model (0: its own)"
    )
    p.add_argument("--single-batch", action="store_true", help="build the batch-1 programs only")
    p.add_argument("--ours-mode", default=None, help="compile_for_generation's mode")
    p.add_argument(
        "--ours-options", default=None, help="compile_generator's Inductor options, as JSON"
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="generator: compile_generator(fuse_projections=True)",
    )
    p.add_argument(
        "--weights",
        default=None,
        choices=("int8", "int4"),
        help="generator: compile_generator(weights=...), weight-only quantized linears",
    )
    p.add_argument(
        "--ours-static", action="store_true", help="precompile modes: build and run a StaticCache"
    )
    p.add_argument(
        "--profile-load", action="store_true", help="cProfile Precompile.load (into the JSON)"
    )
    p.add_argument(
        "--profile-decode",
        action="store_true",
        help="generator: cProfile 64 decode tokens on the host (into the JSON)",
    )
    p.add_argument("--build-only", action="store_true", help="build, measure nothing")
    p.add_argument(
        "--stacks-every",
        type=float,
        default=0.0,
        help="each child writes its Python stacks every S seconds to its model's folder",
    )
    p.add_argument(
        "--workdir", default=None, help="keep each model's build in DIR/MODEL, reused if there"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    p.add_argument(
        "--build-timeout",
        type=float,
        default=0.0,
        help="seconds for a build child (0: --timeout); a 3B build with coordinate "
        "descent took 467 s on an H200, and one that passes the limit is lost",
    )
    p.add_argument(
        "--model-modes",
        default="",
        help="modes of some models only, e.g. 'qwen05:generator;llama3b:generator,hf_static'",
    )
    p.add_argument(
        "--checks", default="check", help="'check': vLLM's top-5 check of generator vs eager"
    )
    p.add_argument("--out", default=None, help="folder for generation.json (default $OUT or .)")
    # child-only
    p.add_argument("--child", default=None, choices=("build", "measure"), help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt2", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
    else:
        parent(a)


if __name__ == "__main__":
    main()
