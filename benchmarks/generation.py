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
``--single-batch`` builds the batch-1 programs only (4 variants, not 8);
``--ours-mode reduce-overhead --ours-static`` builds and runs the precompile
modes with CUDA graphs and a ``StaticCache`` (the match of ``hf_static``).

Usage (repository root)::

    PYTHONPATH=. python benchmarks/generation.py --models gpt2,llama --device cuda
    PYTHONPATH=. python benchmarks/generation.py --tiny --device cpu --new-tokens 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 0
MODES = (
    "eager",
    "torch.compile",
    "hf_static",
    "precompile",
    "precompile_standalone",
    "precompile_shell",
)


def make_config(name: str, tiny: bool):
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
    raise ValueError(f"unknown model {name!r}")


def build_model(a, state_path: str | None, shell: bool = False):
    import torch
    import transformers

    config = make_config(a.model, a.tiny)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(SEED)
    cls = transformers.GPT2LMHeadModel if a.model == "gpt2" else transformers.LlamaForCausalLM
    with torch.device("meta" if shell else a.device):
        model = cls(config)
    model = model.to(dtype).eval()
    if state_path is not None and not shell:
        state = torch.load(state_path, map_location=a.device, weights_only=True)
        model.load_state_dict(state)
    model.generation_config.pad_token_id = model.config.eos_token_id
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, config.vocab_size, (1, a.prompt), generator=gen).to(a.device)
    return model, ids


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def ours_generate_kwargs(a) -> dict:
    """What ``generate`` is given in the precompile modes (and told at build)."""
    return {"cache_implementation": "static"} if a.ours_static else {}


def child_build(a) -> dict:
    import torch

    from torch_precompile import Precompile
    from torch_precompile.generation import compile_for_generation

    model, ids = build_model(a, None)
    torch.save(model.state_dict(), os.path.join(a.dir, "state.pt"))
    t = time.perf_counter()
    artifact = compile_for_generation(
        model, ids, single_batch=a.single_batch, mode=a.ours_mode, **ours_generate_kwargs(a)
    )
    compile_s = time.perf_counter() - t
    path = os.path.join(a.dir, "artifact.pt")
    Precompile.save(path, artifact)
    return {"compile_s": compile_s, "artifact_bytes": os.path.getsize(path)}


def child_measure(a) -> dict:
    import torch
    import transformers  # noqa: F401  (timed as a phase of its own)

    phases = {"imports": time.time() - a.t0}  # seconds from spawn, cumulative
    if a.device == "cuda":  # the CUDA context, which every mode pays
        torch.zeros(1, device=a.device)
        sync(a.device)
        phases["cuda_init"] = time.time() - a.t0
    shell = a.mode == "precompile_shell"
    model, ids = build_model(a, os.path.join(a.dir, "state.pt"), shell=shell)
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
        from torch_precompile._trace import recording

        profile = cProfile.Profile() if a.profile_load else None
        if profile is not None:
            profile.enable()
        with recording() as trace:  # each phase, section read and checksum of the load
            loaded = (
                Precompile.load(path, model=model)
                if a.mode == "precompile"
                else Precompile.load(path)
            )
        extra_result["load_trace"] = {
            kind: [[e.name, e.nbytes, round(e.seconds, 4)] for e in trace.of(kind)]
            for kind in ("phase", "read", "hash")
        }
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
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            **extra,
        )

    if ctx is not None:
        ctx.__enter__()
    try:
        with torch.no_grad():
            gen(1)
            sync(a.device)
            first_token_s = time.time() - a.t0
            t = time.perf_counter()
            gen(a.new_tokens)  # warm-up
            sync(a.device)
            warmup_s = time.perf_counter() - t
            t = time.perf_counter()
            out = gen(a.new_tokens)
            sync(a.device)
            dt = time.perf_counter() - t
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return {
        "first_token_s": first_token_s,
        "phases_from_spawn_s": phases,
        "warmup_generate_s": warmup_s,
        "generate_s": dt,
        "tokens_per_s": a.new_tokens / dt,
        "tokens": out[0, ids.shape[1] :].tolist(),
        **extra_result,
    }


def child(a) -> None:
    try:
        result = child_build(a) if a.child == "build" else child_measure(a)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)


def spawn(a, role: str, model: str, workdir: str, mode: str = "") -> dict:
    caches = tempfile.mkdtemp(prefix="caches-")
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    argv = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            role,
            "--model",
            model,
            "--dir",
            workdir,
            "--mode",
            mode,
            "--new-tokens",
            str(a.new_tokens),
            "--prompt",
            str(a.prompt),
            "--device",
            a.device,
        ]
        + (["--tiny"] if a.tiny else [])
        + (["--single-batch"] if a.single_batch else [])
        + (["--ours-static"] if a.ours_static else [])
        + (["--ours-mode", a.ours_mode] if a.ours_mode else [])
        + (["--profile-load"] if a.profile_load else [])
    )
    t0 = time.time()
    argv += ["--t0", repr(t0)]
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
        lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            result = json.loads(lines[-1][len("RESULT ") :])
        else:
            result = {"error": f"exit {p.returncode}, no result", "stderr": p.stderr[-3000:]}
    except subprocess.TimeoutExpired:
        result = {"error": f"timeout after {a.timeout} s"}
    result["process_s"] = time.time() - t0
    shutil.rmtree(caches, ignore_errors=True)
    return result


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
    import torch

    results: dict = {
        "device": a.device,
        "device_name": torch.cuda.get_device_name()
        if a.device == "cuda" and torch.cuda.is_available()
        else "cpu",
        "torch": torch.__version__,
        "argv": sys.argv,
        "batch": 1,
        "prompt": a.prompt,
        "new_tokens": a.new_tokens,
        "tiny": a.tiny,
        "single_batch": a.single_batch,
        "ours_mode": a.ours_mode,
        "ours_static": a.ours_static,
        "models": {},
    }
    try:
        import transformers

        results["transformers"] = transformers.__version__
    except ImportError:
        pass
    modes = [m for m in a.modes.split(",") if m]
    for model in [m for m in a.models.split(",") if m]:
        workdir = tempfile.mkdtemp(prefix=f"gen-{model}-")
        entry: dict = {}
        print(f"[{model}] build ...", flush=True)
        entry["build"] = spawn(a, "build", model, workdir)
        print(
            f"[{model}] build: "
            + json.dumps({k: v for k, v in entry["build"].items() if k != "traceback"})[:500],
            flush=True,
        )
        results["models"][model] = entry
        for mode in modes:
            if mode.startswith("precompile") and "error" in entry["build"]:
                entry[mode] = {"error": "build failed: " + entry["build"]["error"]}
                continue
            runs = []
            for _ in range(a.repeats):
                r = spawn(a, "measure", model, workdir, mode)
                runs.append(r)
                print(
                    f"[{model}] {mode}: "
                    + json.dumps(
                        {k: v for k, v in r.items() if k not in ("tokens", "load_profile")}
                    )[:600],
                    flush=True,
                )
            entry[mode] = summarize(runs)
            write(a, results, modes)  # what is measured so far survives a time limit
        eager_tokens = next(
            (r["tokens"] for r in entry.get("eager", {}).get("runs", []) if "tokens" in r), None
        )
        for mode in modes:
            toks = [r.get("tokens") for r in entry.get(mode, {}).get("runs", []) if "tokens" in r]
            if eager_tokens is not None and toks:
                entry[mode]["tokens_equal_eager"] = all(t == eager_tokens for t in toks)
                entry[mode]["tokens_matching_prefix"] = min(
                    next((i for i, (x, y) in enumerate(zip(t, eager_tokens)) if x != y), len(t))
                    for t in toks
                )
        results["models"][model] = entry
        shutil.rmtree(workdir, ignore_errors=True)
        write(a, results, modes)


def write(a, results: dict, modes: list[str]) -> None:

    table = [
        f"Generation, batch 1, prompt {a.prompt}, {a.new_tokens} new tokens, greedy; "
        f"device {results['device_name']}, torch {results['torch']}, "
        f"transformers {results.get('transformers')}; median of {a.repeats} fresh "
        "process(es), empty compiler caches",
        "",
        "| model | mode | first token from spawn (s) | tokens/s | tokens == eager | note |",
        "|---|---|---:|---:|---|---|",
    ]
    for model, entry in results["models"].items():
        b = entry["build"]
        note = (
            f"build: compile_for_generation {b['compile_s']:.1f} s, "
            f"file {b['artifact_bytes'] / 1e6:.1f} MB"
            if "error" not in b
            else f"build error: {b['error'][:200]}"
        )
        table.append(f"| {model} | build | | | | {note} |")
        for mode in modes:
            e = entry.get(mode, {})
            if "first_token_s" in e:
                run = next(r for r in e["runs"] if "error" not in r)
                phases = ", ".join(
                    f"{k} {v:.2f}" for k, v in run.get("phases_from_spawn_s", {}).items()
                )
                table.append(
                    f"| {model} | {mode} | {e['first_token_s']:.2f} | {e['tokens_per_s']:.1f} | "
                    f"{e.get('tokens_equal_eager', '')} | from spawn: {phases} |"
                )
            else:
                err = str(e.get("error", "")).replace("|", "/").replace("\n", " ")[:200]
                table.append(f"| {model} | {mode} | | | | error: {err} |")
    md = "\n".join(table)
    results["table_md"] = md
    print(md)
    out_dir = a.out or os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "generation.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
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
    p.add_argument("--tiny", action="store_true", help="tiny configs, for a quick end-to-end check")
    p.add_argument("--single-batch", action="store_true", help="build the batch-1 programs only")
    p.add_argument("--ours-mode", default=None, help="compile_for_generation's mode")
    p.add_argument(
        "--ours-static", action="store_true", help="precompile modes: build and run a StaticCache"
    )
    p.add_argument(
        "--profile-load", action="store_true", help="cProfile Precompile.load (into the JSON)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    p.add_argument("--out", default=None, help="folder for generation.json (default $OUT or .)")
    # child-only
    p.add_argument("--child", default=None, choices=("build", "measure"), help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt2", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
    else:
        parent(a)


if __name__ == "__main__":
    main()
