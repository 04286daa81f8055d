"""Tensor-parallel generation on 2 ranks: eager TP, torch.compile TP and our TP generator.

A Llama of about 0.5B parameters (16 layers, hidden 1024, 16 heads, 4 key/value
heads, MLP 8192, vocabulary 32000; random init, seeded; bfloat16 on CUDA,
float32 on the CPU) parallelised over the job's ranks with
``parallelize_module`` (``q/k/v``, ``gate/up`` column-wise; ``o``, ``down``
row-wise). Greedy, batch ``--batch`` (rows after the first left-padded by 2
tokens each), a prompt of ``--prompt`` tokens, ``--new-tokens`` new ones.

- ``eager``: transformers' ``generate`` on the TP model (its default dynamic cache);
- ``compile``: the same with ``model.forward = torch.compile(model.forward)``;
- ``ours``: ``compile_generator`` on the TP model (rank 0 builds; the other
  ranks write their shards), then a *fresh* ``torchrun`` job (fresh processes
  and process group, empty Inductor cache; Python's bytecode written first, as a
  pip install leaves it) loads it with ``Precompile.load`` on every rank and
  runs ``generate``.

For each: ``first_token_s``, wall seconds from the model (or, for ``ours``,
the ``Precompile.load`` call, after the GPU's context and the communicator are
up: ``setup_s``) to the first token of the first ``generate``
(``torch.compile``'s JIT and our load included), and ``decode_tokens_per_s``
of a warm run, ``(new_tokens - 1) / (t(new_tokens) - t(1))`` (the prefill
left out), the median of ``--repeats``; the slowest rank. ``ours``' tokens (and
``eager``'s) are compared with the *unsharded* model's ``generate`` on rank 0:
``equal_tokens`` counts equal new tokens over all rows, ``equal_prefix`` the
tokens before the first difference of each row (bf16 may drift).

Usage (CUDA: NCCL, each rank sees its own GPU as ``cuda:0``; CPU: gloo)::

    torchrun --nproc-per-node 2 benchmarks/tp_generation.py --out tp_generation.json
    torchrun --nproc-per-node 2 benchmarks/tp_generation.py --tiny --out /tmp/tp.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import child_env

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T_START = time.perf_counter()
# The job's GPUs as torchrun found them (the serving job is started with these).
VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES", "")


def _one_gpu_per_rank() -> None:
    """Each rank sees its own GPU as ``cuda:0``: a CUDA artifact runs on the device
    index it was compiled on (rank 0's ``cuda:0``). Before importing torch."""
    if "LOCAL_RANK" in os.environ and os.environ.get("TP_BENCH_CPU") != "1":
        local = int(os.environ["LOCAL_RANK"])
        devices = VISIBLE.split(",") if VISIBLE else None
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[local] if devices else str(local)


_one_gpu_per_rank()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def llama_config(tiny: bool) -> Any:
    import transformers

    if tiny:
        size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
        size |= dict(num_key_value_heads=2, intermediate_size=128, vocab_size=1000)
    else:
        size = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16)
        size |= dict(num_key_value_heads=4, intermediate_size=8192, vocab_size=32000)
    # No end token: every mode generates exactly the tokens asked for.
    return transformers.LlamaConfig(
        **size, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None
    )


def build_model(a: argparse.Namespace, device: str, mesh: Any | None) -> Any:
    """The seeded model (the same weights on every rank), parallelised over ``mesh``."""
    import transformers
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(a.seed)
    model = transformers.LlamaForCausalLM(llama_config(a.tiny)).eval()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = model.to(dtype=dtype, device=device)
    if mesh is not None:
        plan: dict[str, Any] = {}
        for i in range(model.config.num_hidden_layers):
            layer = f"model.layers.{i}"
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{layer}.self_attn.{name}"] = ColwiseParallel()
            plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel()
            plan[f"{layer}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{layer}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
    return model


def inputs(a: argparse.Namespace, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``--batch`` rows of ``--prompt`` tokens; row ``r`` left-padded by ``2 r``."""
    g = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(3, vocab, (a.batch, a.prompt), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, a.batch):
        mask[r, : 2 * r] = 0
        ids[r, : 2 * r] = 0
    return ids.to(device), mask.to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, device: str) -> tuple[float, Any]:
    dist.barrier()
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def measure(generate: Any, a: argparse.Namespace, device: str, t0: float) -> dict[str, Any]:
    """First token from ``t0`` (cold), then warm runs: decode tokens/s."""
    _, _ = timed(lambda: generate(1), device)
    first = time.perf_counter() - t0
    generate(a.new_tokens)  # warm-up (JIT recompiles for new lengths happen here)
    ones, fulls, tokens = [], [], None
    for _ in range(a.repeats):
        ones.append(timed(lambda: generate(1), device)[0])
        t, tokens = timed(lambda: generate(a.new_tokens), device)
        fulls.append(t)
    decode = statistics.median(fulls) - statistics.median(ones)
    return {
        "first_token_s": first,
        "decode_tokens_per_s": (a.new_tokens - 1) / decode if decode > 0 else None,
        "generate_s": statistics.median(fulls),
        "tokens": tokens.tolist(),
    }


def hf_generate(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    def run(n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )

    return run


def compare(tokens: list[list[int]], reference: list[list[int]], prompt: int) -> dict[str, Any]:
    equal = prefix = total = 0
    for row, ref in zip(tokens, reference, strict=True):
        new, want = row[prompt:], ref[prompt:]
        total += len(want)
        equal += sum(x == y for x, y in zip(new, want, strict=False))
        for x, y in zip(new, want, strict=False):
            if x != y:
                break
            prefix += 1
    return {"equal_tokens": equal, "equal_prefix": prefix, "new_tokens": total}


def slowest(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record with the slowest rank's times."""
    out = dict(results[0])
    out["first_token_s"] = max(r["first_token_s"] for r in results)
    rates = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]
    out["decode_tokens_per_s"] = min(rates) if rates else None
    out["same_tokens_on_every_rank"] = all(r["tokens"] == results[0]["tokens"] for r in results)
    return out


def run_mode(make: Any, a: argparse.Namespace, device: str) -> dict[str, Any]:
    """One mode measured on every rank; a failure (the same on every rank: tracing
    fails alike) is recorded rather than ending the job."""
    t0 = time.perf_counter()
    try:
        record = measure(make(), a, device, t0)
    except Exception as exc:  # recorded in the results
        record = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    everyone = gather(record)
    failed = [r for r in everyone if "error" in r]
    return failed[0] if failed else slowest(everyone)


def gather(record: dict[str, Any]) -> list[dict[str, Any]]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    return everyone


def serve(a: argparse.Namespace, device: str) -> None:
    """The fresh job: load our generator on every rank, measure, write a record per rank."""
    from torch_precompile import Precompile

    rank = dist.get_rank()
    # What a server has done before it loads: the GPU's context and the process
    # group's communicator up (both lazy until first used), timed on their own.
    t_setup = time.perf_counter()
    torch.zeros(1, device=device)
    dist.barrier()
    setup_s = time.perf_counter() - t_setup
    t0 = time.perf_counter()
    generator = Precompile.load(Path(a.serve) / "generator.pt")
    load_s = time.perf_counter() - t0
    ids, mask = inputs(a, a.vocab, device)

    def run(n: int) -> torch.Tensor:
        return generator.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
        )

    record = measure(run, a, device, t0)
    record["load_s"] = load_s
    record["setup_s"] = setup_s  # CUDA context and communicator, before the load
    record["compiler_imported"] = "torch._dynamo" in sys.modules
    record["since_process_start_s"] = time.perf_counter() - T_START
    record["lean"] = all(
        type(v.compiled_function).__name__ == "LeanCompiledFunction"
        for v in generator.step.variants
    )
    record["transformers_imported"] = "transformers" in sys.modules
    (Path(a.serve) / f"serve-rank{rank}.json").write_text(json.dumps(record))


# What a serving rank imports (a load of a tensor-parallel generator: DTensor, sympy).
SERVING_IMPORTS = "import torch.distributed.tensor, torch_precompile.serialization.load"


def start_serving_job(a: argparse.Namespace, workdir: Path, world: int, vocab: int) -> None:
    """Rank 0 starts a fresh ``torchrun`` job on the same GPUs and waits for it."""
    env = {  # this job's torchrun variables are not the new job's
        k: v
        for k, v in child_env(workdir / "caches").items()
        if not k.startswith(("TORCHELASTIC", "MASTER_", "GROUP_", "ROLE_"))
        and k
        not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
    }
    if VISIBLE:
        env["CUDA_VISIBLE_DEVICES"] = VISIBLE
    # Python's bytecode of what the serving job imports, written as a pip install
    # writes it: a machine image without it (the lent GPU machines' sympy) compiles
    # those modules from source in every process (1.9 s of a load on an H200 host).
    subprocess.run([sys.executable, "-c", SERVING_IMPORTS], env=env, check=True, timeout=300)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={world}", str(Path(__file__).resolve()), "--serve", str(workdir)]
    cmd += ["--vocab", str(vocab), "--batch", str(a.batch), "--prompt", str(a.prompt)]
    cmd += ["--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats), "--seed", str(a.seed)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    (workdir / "serve.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode != 0:
        raise RuntimeError(f"the serving job failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}")


def wait_for(path: Path, timeout: float) -> None:
    """Wait without a collective (rank 0 may be compiling or serving for long)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.5)


def main_job(a: argparse.Namespace, device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torch_precompile import Precompile
    from torch_precompile.generation import compile_generator, save_generator_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="tp_generation_"))
    if rank == 0:
        workdir.mkdir(parents=True, exist_ok=True)
    names = [str(workdir)]
    dist.broadcast_object_list(names, src=0)
    workdir = Path(names[0])
    results: dict[str, Any] = {}

    t0 = time.perf_counter()
    model = build_model(a, device, mesh)
    build_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    ids, mask = inputs(a, vocab, device)

    results["eager"] = run_mode(lambda: hf_generate(model, ids, mask), a, device)

    # Ours: rank 0 builds the generator; the other ranks write their shards.
    path = workdir / "generator.pt"
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        generator = compile_generator(
            model, max_batch=a.batch, max_length=a.prompt + a.new_tokens, mode=a.mode
        )
        Precompile.save(path, generator)
        del generator
    else:
        save_generator_shard(path, model)
    build_generator_s = time.perf_counter() - t0
    dist.barrier()

    forward = model.forward
    model.forward = torch.compile(forward)
    results["compile"] = run_mode(lambda: hf_generate(model, ids, mask), a, device)
    model.forward = forward
    torch.compiler.reset()

    done = workdir / "serve-done"
    if rank == 0:
        try:
            start_serving_job(a, workdir, world, vocab)
        finally:
            done.write_text("done")
    else:
        wait_for(done, a.timeout + 60)
    served = [json.loads((workdir / f"serve-rank{r}.json").read_text()) for r in range(world)]
    results["ours"] = slowest(served)
    results["ours"]["load_s"] = max(r["load_s"] for r in served)
    results["ours"]["load_s_per_rank"] = [r["load_s"] for r in served]
    results["ours"]["setup_s"] = max(r["setup_s"] for r in served)
    results["ours"]["compiler_imported"] = any(r["compiler_imported"] for r in served)
    results["ours"]["build_generator_s_rank0"] = build_generator_s if rank == 0 else None

    if rank == 0:
        del model
        unsharded = build_model(a, device, None)
        with torch.no_grad():
            reference = unsharded.generate(
                ids, attention_mask=mask, max_new_tokens=a.new_tokens, do_sample=False
            ).tolist()
        for mode in ("eager", "compile", "ours"):
            if "tokens" in results[mode]:
                tokens = results[mode].pop("tokens")
                results[mode]["vs_unsharded"] = compare(tokens, reference, a.prompt)
        results["ours"]["lean_on_every_rank"] = all(r["lean"] for r in served)
        results["ours"]["transformers_imported"] = any(r["transformers_imported"] for r in served)
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": world,
            "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(0)
            if device == "cuda"
            else f"{platform.machine()} CPU",
            "torch": torch.__version__,
            "config": llama_config(a.tiny).to_dict() | {"dtype": str(unsharded.dtype)},
            "parameters": sum(p.numel() for p in unsharded.parameters()),
            "batch": a.batch,
            "prompt": a.prompt,
            "new_tokens": a.new_tokens,
            "repeats": a.repeats,
            "build_model_s": build_s,
            "results": results,
        }
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
        print(
            json.dumps(
                {
                    k: {
                        m: v.get(m)
                        for m in ("first_token_s", "decode_tokens_per_s", "vs_unsharded")
                    }
                    for k, v in results.items()
                },
                indent=1,
            )
        )
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="tp_generation.json", help="the JSON of results")
    p.add_argument("--tiny", action="store_true", help="a tiny config, for a check on the CPU")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mode", default=None, help="compile_generator's mode (reduce-overhead: CUDA graphs)"
    )
    p.add_argument(
        "--workdir", default=None, help="where the generator files go (default: a temp dir)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the serving job")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny and "--new-tokens" not in " ".join(sys.argv):
        a.new_tokens = 8
    device = (
        "cuda" if torch.cuda.is_available() and os.environ.get("TP_BENCH_CPU") != "1" else "cpu"
    )
    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", 1))))
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(hours=1)
    )
    try:
        if a.serve:
            serve(a, device)
        else:
            main_job(a, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
