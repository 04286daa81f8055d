"""The lean load's GPU code: CUDA graphs (``_compat/lean/cudagraphs.py``) and Triton
kernels launched without Triton (``_compat/lean/triton_kernels.py``), against eager.

The recording spec read off Inductor's compiled graph is checked everywhere; the
rest needs a CUDA GPU and is skipped without one. On the GPU machine::

    python -m pytest tests/test_cuda_runtime.py -v -rs
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import script_json

from torch_precompile import Precompile
from torch_precompile.lean import cudagraphs as lean_cudagraphs
from torch_precompile.lean.cudagraphs import CUDAGraphRunner, CUDAGraphSpec
from torch_precompile.lean_writer.specs import cudagraph_spec

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (lean CUDA graphs and statically launched Triton kernels)",
)


# ----------------------------------------------- the recording spec (any machine)


def _graph(**fields: Any) -> Any:
    base = {
        "cudagraph_info": types.SimpleNamespace(cudagraph_fail_reasons=[]),
        "device_idxs": {0},
        "fx_kwargs": {"static_input_idxs": [0, 2]},
        "partition_maps": None,
    }
    base.update(fields)
    return types.SimpleNamespace(**base)


def test_spec_of_a_recordable_graph() -> None:
    spec, why = cudagraph_spec(_graph())
    assert why is None and spec == CUDAGraphSpec((0, 2), 0, None)


def test_spec_of_partitions_maps_the_static_inputs_of_each() -> None:
    maps = [
        types.SimpleNamespace(input_index_mapping=[0, 1]),
        types.SimpleNamespace(input_index_mapping=[None, 2, 3]),
    ]
    spec, why = cudagraph_spec(_graph(partition_maps=maps))
    assert why is None and spec is not None
    assert spec.partitions == ((0,), (1,))  # partition-local indices of inputs 0 and 2


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"cudagraph_info": None}, "carries no CUDA-graph information"),
        (
            {"cudagraph_info": types.SimpleNamespace(cudagraph_fail_reasons=["mutated inputs"])},
            "Inductor skips CUDA graphs: mutated inputs",
        ),
        ({"device_idxs": {0, 1}}, "CUDA graphs over devices [0, 1]"),
        ({"partition_maps": []}, "no graph partition to record"),
        ({"kernel_free_cudagraph": True}, "launches no kernel"),  # torch 2.14+
    ],
)
def test_spec_refusals_say_why(fields: dict[str, Any], reason: str) -> None:
    spec, why = cudagraph_spec(_graph(**fields))
    assert spec is None and why is not None and reason in why


# ------------------------------------------------------- CUDA graphs (GPU only)


def _affine(inputs: list[Any], received: list[Any] | None) -> list[torch.Tensor]:
    """A graph's boxed call: ``x @ w + b`` (``w`` and ``b`` are its static inputs)."""
    x, w, b = inputs
    if received is not None:
        received.extend(inputs)
    inputs.clear()
    return [torch.addmm(b, x, w)]


@needs_cuda
def test_runner_warms_up_records_then_replays_new_inputs() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 8, device="cuda")
    b = torch.randn(8, device="cuda")
    runner = CUDAGraphRunner(_affine, static_inputs=(1, 2), device_index=0)
    before = dict(lean_cudagraphs.STATS)
    for step in range(4):
        x = torch.randn(4, 16, device="cuda")
        (out,) = runner.call_list([x, w, b])
        torch.testing.assert_close(out, x @ w + b)
        recorded = lean_cudagraphs.STATS["recorded"] - before["recorded"]
        replayed = lean_cudagraphs.STATS["replayed"] - before["replayed"]
        # Call 1 runs as compiled (warm-up); call 2 records and replays the recording
        # for its outputs (a capture runs no kernel); later calls replay.
        assert (recorded, replayed) == [(0, 0), (1, 1), (1, 2), (1, 3)][step]


@needs_cuda
def test_static_inputs_are_read_in_place_and_moved_ones_record_again() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 8, device="cuda")
    b = torch.randn(8, device="cuda")
    x = torch.randn(4, 16, device="cuda")
    runner = CUDAGraphRunner(_affine, static_inputs=(1, 2), device_index=0)
    for _ in range(2):
        runner.call_list([x, w, b])
    w.mul_(2)  # updated in place (an optimizer step): the recording reads it
    (out,) = runner.call_list([x, w, b])
    torch.testing.assert_close(out, x @ w + b)
    recorded = lean_cudagraphs.STATS["recorded"]
    w2 = w.clone()  # the weights moved: warm-up, then a new recording
    for _ in range(2):
        (out,) = runner.call_list([x, w2, b])
        torch.testing.assert_close(out, x @ w2 + b)
    assert lean_cudagraphs.STATS["recorded"] == recorded + 1


@needs_cuda
def test_an_output_overwritten_by_the_next_replay_raises() -> None:
    w = torch.randn(16, 8, device="cuda")
    b = torch.randn(8, device="cuda")
    runner = CUDAGraphRunner(_affine, static_inputs=(1, 2), device_index=0)
    x = torch.randn(4, 16, device="cuda")
    for _ in range(2):
        runner.call_list([x, w, b])
    (first,) = runner.call_list([x, w, b])
    kept = first.clone()
    runner.call_list([torch.randn(4, 16, device="cuda"), w, b])
    with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
        first.sum().item()
    torch.testing.assert_close(kept, x @ w + b)


@needs_cuda
def test_partitions_are_each_recorded() -> None:
    """With graph partitions, ``install`` wraps each partition function (Inductor's
    ``recursively_apply_fns``) in its own runner; the graph's call stays as it is."""
    w = torch.randn(16, 8, device="cuda")
    b = torch.randn(8, device="cuda")
    partitions: list[Any] = [lambda inputs: _affine(inputs, None)]

    def apply(wrappers: list[Any]) -> None:
        partitions[:] = [wrap(fn) for wrap, fn in zip(wrappers, partitions, strict=True)]

    def call(inputs: list[Any], received: list[Any] | None) -> Any:
        return partitions[0](inputs)

    spec = CUDAGraphSpec(static_inputs=(1, 2), device_index=0, partitions=((1, 2),))
    assert lean_cudagraphs.install(call, apply, spec) is call
    before = lean_cudagraphs.STATS["recorded"]
    for _ in range(3):
        x = torch.randn(4, 16, device="cuda")
        (out,) = call([x, w, b], None)
        torch.testing.assert_close(out, x @ w + b)
    assert lean_cudagraphs.STATS["recorded"] == before + 1


def test_calls_not_recorded_run_as_compiled_and_others_still_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Inside ``not_recorded`` (a generator's prefill) a runner neither warms up, records
    nor replays a layout, however often it comes; outside, its second call records.
    On a machine without CUDA that recording fails and says so (the runner then
    runs as compiled): the attempt is what is checked there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, b = torch.randn(16, 8, device=device), torch.randn(8, device=device)
    runner = CUDAGraphRunner(_affine, static_inputs=(1, 2), device_index=0)
    before = dict(lean_cudagraphs.STATS)
    with caplog.at_level("WARNING", logger="torch_precompile"):
        for _ in range(3):
            x = torch.randn(4, 16, device=device)
            with lean_cudagraphs.not_recorded():
                (out,) = runner.call_list([x, w, b])
            torch.testing.assert_close(out, x @ w + b)
        assert before == lean_cudagraphs.STATS and not caplog.records
        for _ in range(2):
            (out,) = runner.call_list([x, w, b])
            torch.testing.assert_close(out, x @ w + b)
    if device == "cuda":
        assert lean_cudagraphs.STATS["recorded"] == before["recorded"] + 1
    else:
        assert "CUDA graph recording failed" in caplog.text


# ------------------------------------------ Triton kernels after a lean load (GPU)

_FRESH = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch_precompile import Precompile
    from torch_precompile.lean import cudagraphs as lean_cudagraphs

    art = Precompile.load(sys.argv[1])
    io = torch.load(sys.argv[2])
    outs = []
    with torch.no_grad():
        for x in io["inputs"]:
            outs.append(art(x, io["w"]).clone())
    for out, ref in zip(outs, io["expected"]):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    heavy = ["torch._dynamo", "torch._inductor.compile_fx", "sympy", "triton",
             "torch._inductor.runtime.triton_heuristics"]
    print(json.dumps({"lean": type(art.compiled_function).__name__,
                      "imported": [m for m in heavy if m in sys.modules],
                      "stats": lean_cudagraphs.STATS}))
    """
)


def _gelu_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w) * torch.sigmoid(x.sum(-1, keepdim=True))


@needs_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_triton_kernels_run_after_a_lean_load_as_eager(tmp_path: Path, mode: str | None) -> None:
    """A CUDA artifact loads in a fresh process without Triton, Inductor's compiler or
    Dynamo; its kernels (cubins launched by PyTorch's static launcher), and with
    ``mode="reduce-overhead"`` its CUDA graphs, give eager's results for new inputs."""
    torch.manual_seed(0)
    w = torch.randn(64, 32, device="cuda")
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        dyn = Precompile.dynamo(_gelu_mm, (x, w))
        compiled = Precompile.inductor(Precompile.aot_autograd(dyn), mode=mode)
        assert "triton" in compiled.as_text()  # Triton kernels, not extern calls only
        art = Precompile.precompile(compiled)
        inputs = [torch.randn(8, 64, device="cuda") for _ in range(4)]
        expected = [_gelu_mm(t, w) for t in inputs]
    path = tmp_path / "cuda.pt"
    Precompile.save(path, art, dyn.bytecode, compiled.guards)
    torch.save({"inputs": inputs, "w": w, "expected": expected}, tmp_path / "io.pt")
    result = script_json(_FRESH, path, tmp_path / "io.pt")
    assert result["lean"] == "LeanCompiledFunction", result
    assert result["imported"] == [], result
    if mode == "reduce-overhead":
        # Call 1 warms up, call 2 records (one graph, or one per Inductor partition)
        # and replays for its outputs, calls 3 and 4 replay each recording.
        recorded = result["stats"]["recorded"]
        assert recorded >= 1 and result["stats"]["replayed"] == 3 * recorded, result
    else:
        assert result["stats"] == {"recorded": 0, "replayed": 0}, result


class _StaticCacheStep(torch.nn.Module):
    """One decode step over a cache written in place and returned (HF's StaticCache)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor) -> Any:
        cache.index_copy_(1, pos, self.proj(x))
        return cache, (cache.sum(1) * 2).relu()


_FRESH_CACHE = textwrap.dedent(
    """
    import json, sys, torch
    from torch_precompile import Precompile
    from torch_precompile.lean import cudagraphs as lean_cudagraphs
    art = Precompile.load(sys.argv[1])
    io = torch.load(sys.argv[2])
    cache = io["cache"].clone()
    torch._dynamo.mark_static_address(cache)  # as HF's StaticCache marks its tensors
    results = []
    with torch.no_grad():
        for step, x in enumerate(io["xs"]):
            out, summary = art(x, cache, torch.tensor([step], device="cuda"))
            results.append([out is cache or out.data_ptr() == cache.data_ptr(),
                            (summary - io["summaries"][step]).abs().max().item()])
    print(json.dumps({"lean": type(art.compiled_function).__name__,
                      "cache_diff": (cache - io["final"]).abs().max().item(),
                      "results": results, "stats": lean_cudagraphs.STATS}))
    """
)


@needs_cuda
def test_reduce_overhead_with_a_static_cache_returned_loads_lean(tmp_path: Path) -> None:
    """``mode="reduce-overhead"`` on a step that writes a static cache in place and
    returns it: the lean path after a fresh load (no compiler), CUDA graphs recorded,
    the returned cache is the caller's tensor, and each step equals eager's."""
    torch.manual_seed(0)
    model = _StaticCacheStep().cuda().eval()
    cache = torch.zeros(2, 8, 16, device="cuda")
    torch._dynamo.mark_static_address(cache)
    xs = [torch.randn(2, 1, 16, device="cuda") for _ in range(5)]
    with torch.no_grad():
        art = Precompile.compile(
            model, (xs[0], cache, torch.tensor([0], device="cuda")), mode="reduce-overhead"
        )
        eager_cache, summaries = cache.clone(), []
        for step, x in enumerate(xs):
            summaries.append(model(x, eager_cache, torch.tensor([step], device="cuda"))[1])
    path = tmp_path / "static_cache.pt"
    Precompile.save(path, art)
    torch.save({"xs": xs, "cache": cache, "summaries": summaries, "final": eager_cache},
               tmp_path / "io.pt")  # fmt: skip
    result = script_json(_FRESH_CACHE, path, tmp_path / "io.pt")
    assert result["lean"] == "LeanCompiledFunction", result
    assert result["stats"]["recorded"] >= 1, result
    assert result["cache_diff"] < 1e-4, result
    for same, diff in result["results"]:
        assert same and diff < 1e-4, result


_FRESH_GENERATOR = textwrap.dedent(
    """
    import json, sys
    sys.modules["transformers"] = None
    import torch
    from torch_precompile import Precompile
    gen = Precompile.load(sys.argv[1])
    io = torch.load(sys.argv[2])
    out = gen.generate(io["ids"].cuda(), max_new_tokens=io["new"], eos_token_id=None)
    print(json.dumps({"tokens": out[:, io["ids"].shape[1]:].tolist()}))
    """
)


@needs_cuda
def test_a_kernel_tuned_two_ways_in_two_variants_launches_its_own_cubin(tmp_path: Path) -> None:
    """Coordinate descent tuning picks a configuration per graph, so one kernel source
    in two variants of a generator (prefill, decode) can win with two (warps, block).
    Each variant must launch its own binary: a file holding one cubin per source
    launched one variant's with the other's warps, and its first decode step failed
    ("CUDA driver error: invalid argument", H100, 2026-11-27). Tokens equal eager's
    (fp32, greedy) after a fresh load without transformers."""
    transformers = pytest.importorskip("transformers")
    from torch_precompile.generation import compile_generator

    torch.manual_seed(0)
    config = transformers.Qwen2Config(  # Qwen2.5-0.5B's widths, one layer: the shape it failed on
        num_hidden_layers=1,
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    config.eos_token_id = None
    model = transformers.Qwen2ForCausalLM(config).cuda().eval()
    gen = compile_generator(
        model, max_batch=1, max_length=128, options={"coordinate_descent_tuning": True}
    )
    path = tmp_path / "cdt.pt"
    Precompile.save(path, gen)
    ids = torch.randint(0, 151936, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model.generate(
            ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=16,
            do_sample=False,
        )  # fmt: skip
    torch.save({"ids": ids, "new": 16}, tmp_path / "io.pt")
    result = script_json(_FRESH_GENERATOR, path, tmp_path / "io.pt")
    assert result["tokens"] == eager[:, 40:].tolist(), result


# ------------------------------------------- the server's engine on the GPU (GPU only)


@needs_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_the_engine_gives_each_request_its_solo_tokens_on_the_gpu(
    tmp_path: Path, mode: str | None
) -> None:
    """Six requests in four slots (two queue), each equal to ``generate`` alone (fp32):
    the engine launches step N + 1 before it reads step N, so this checks that a
    token chosen on the device reaches the right slot, and that a run which ends
    (or a slot refilled) never takes a neighbour's row."""
    transformers = pytest.importorskip("transformers")
    import threading

    from test_generator import SMALL  # logits far from flat (initializer_range 0.5)

    from torch_precompile.engine.requests import Delta
    from torch_precompile.generation import compile_generator
    from torch_precompile.serve.engine import Engine
    from torch_precompile.serve.protocol import Job

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_key_value_heads=2, **{**SMALL, "vocab_size": 320})
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    Precompile.save(
        tmp_path / "g.pt", compile_generator(model, max_batch=4, max_length=64, mode=mode)
    )
    gen = Precompile.load(tmp_path / "g.pt")
    prompts = [[(5 * i + 3 * k) % 300 + 10 for k in range(3 + 4 * i)] for i in range(6)]
    lengths = [12, 3, 20, 1, 9, 16]  # runs end at different steps, freeing slots for the queue
    expected, distributions = [], []
    for p, n in zip(prompts, lengths):
        ran = gen.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=n,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
        )
        expected.append(ran.sequences[0, len(p) :].tolist())
        distributions.append([step[0].float().log_softmax(-1) for step in ran.logits])
    engine = Engine(gen, max_queue=8)
    engine.warm()
    stepping = threading.Thread(target=engine.run)
    stepping.start()
    got: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i: int) -> Any:
        def put(event: Any) -> None:
            assert isinstance(event, Delta), event
            got[i] += event.token_ids
            logprobs[i] += [e.logprob for e in event.logprobs]
            if event.finish is not None:
                done[i].set()

        return put

    try:
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            job = Job(False, "m", p, n, temperature=0, logprobs=2 if i % 2 else None)
            engine.open(dataclasses.replace(job, ignore_eos=True), sink(i))
        assert all(d.wait(120) for d in done), engine.load()
    finally:
        engine.stop()
        stepping.join(60)
    differ = [(i, g, e) for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not differ, f"requests whose tokens differ from generate's: {differ}"
    # Each step's log-probability is generate's. fp32 on a GPU: the engine's steps run
    # four rows (a GEMM) where generate runs one (a GEMV), summing in another order, so
    # logits of up to ~16 here differ in the fifth digit; a wrong row or step, by units.
    for i in range(1, len(prompts), 2):
        want = [float(d[t]) for d, t in zip(distributions[i], expected[i])]
        worst = max(abs(a - b) for a, b in zip(logprobs[i], want))
        assert logprobs[i] == pytest.approx(want, abs=1e-3), f"request {i}: off by {worst}"
    assert not any(logprobs[i] for i in range(0, len(prompts), 2))
    assert engine.load()["busy"] == 0 and not engine.reading


# ---------------------------------- the weights copied to the GPU and checked at once


@needs_cuda
@pytest.mark.parametrize("chunk", [1 << 16, 3 << 20, 16 << 20])
def test_copy_checked_puts_the_bytes_on_the_gpu_and_hashes_every_leaf(chunk: int) -> None:
    """``copy_checked`` (the load's weights): the span's bytes on the device once the
    check has answered, and the section's tree digest as ``tree_sha256`` computes it;
    one flipped byte, another."""
    import os

    from torch_precompile.file.treehash import TreeCheck, tree_sha256
    from torch_precompile.lean.standin.h2d import copy_checked

    data = bytearray(os.urandom((40 << 20) + 12345))
    good = tree_sha256(data, chunk)
    for lo, hi in [(0, len(data)), (1000, len(data) - 77), (5 << 20, 9 << 20)]:
        check = TreeCheck(memoryview(data), chunk, good)
        out = copy_checked(torch.frombuffer(data, dtype=torch.uint8), (lo, hi), "cuda", check)
        assert check.matches()  # waits for the copies, which run on after copy_checked
        assert out.device.type == "cuda" and bytes(out.cpu().numpy()) == bytes(data[lo:hi])
    data[len(data) // 2] ^= 1
    check = TreeCheck(memoryview(data), chunk, good)
    copy_checked(torch.frombuffer(data, dtype=torch.uint8), (0, len(data)), "cuda", check)
    assert not check.matches()


@needs_cuda
def test_a_cuda_file_loads_its_weights_checked_and_a_flipped_byte_is_the_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA artifact whose weights carry a tree digest (small leaves here) loads equal
    to eager; a byte flipped in the first, a middle or the last leaf of its weights is
    ``ArtifactCorruptedError`` from ``Precompile.load``."""
    from torch_precompile import ArtifactCorruptedError
    from torch_precompile.file import open_artifact, treehash

    monkeypatch.setattr(treehash, "CHUNK", 1 << 16)
    monkeypatch.setattr(treehash, "MIN_TREE", 1 << 20)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    ).cuda()
    x = torch.randn(4, 512, device="cuda")
    with torch.no_grad():
        dyn = Precompile.dynamo(model, x)
        compiled = Precompile.inductor(Precompile.aot_autograd(dyn))
        art, expected = Precompile.precompile(compiled), model(x)
    path = tmp_path / "w.pt"
    Precompile.save(path, art, dyn.bytecode, compiled.guards)
    with open_artifact(path) as reader:
        entry = next(s for s in reader.info.sections if s["name"] == "weights")
        start = reader.info.data_start + entry["offset"]
    assert entry["tree_chunk"] == 1 << 16 and entry["length"] > 20 * (1 << 16)
    with torch.no_grad():
        torch.testing.assert_close(Precompile.load(path)(x), expected)
    leaves = -(-entry["length"] // (1 << 16))
    for leaf in (0, leaves // 2, leaves - 1):
        data = bytearray(path.read_bytes())
        data[start + min(leaf * (1 << 16) + 4099, entry["length"] - 1)] ^= 1
        bad = tmp_path / f"bad{leaf}.pt"
        bad.write_bytes(bytes(data))
        with pytest.raises(ArtifactCorruptedError, match="section 'weights' fails its SHA-256"):
            Precompile.load(bad)


# ------------------------------------- a generator's prefill: the kernels it was built with


@needs_cuda
def test_a_gpu_generators_prefill_runs_no_cudnn_attention_nor_a_rotary_gemm(
    tmp_path: Path,
) -> None:
    """Built in bfloat16 (where torch 2.11 on an H200 picks cuDNN's attention, which plans
    each new prompt length): the loaded prefill launches no cuDNN kernel and no ``mm`` over
    an inner dimension of one (the rotary product, a broadcast multiply), and its logits
    are eager's at each prompt length."""
    transformers = pytest.importorskip("transformers")
    from test_generator import SMALL
    from torch.profiler import ProfilerActivity, profile

    from torch_precompile.generation import compile_generator

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_key_value_heads=2, **{**SMALL, "hidden_size": 256, "num_attention_heads": 4}
    )
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    Precompile.save(tmp_path / "g.pt", compile_generator(model, max_batch=2, max_length=64))
    gen = Precompile.load(tmp_path / "g.pt")
    for rows, length in ((1, 5), (1, 17), (2, 11), (1, 30)):
        ids = torch.randint(3, 1000, (rows, length), device="cuda")
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
        ) as p:
            ran = gen.generate(
                ids, max_new_tokens=1, return_dict_in_generate=True, output_logits=True
            )
            torch.cuda.synchronize()
        names = {e.key for e in p.key_averages()}
        assert not [n for n in names if "cudnn" in n.lower()], length
        inner_one = [
            e.input_shapes
            for e in p.events()
            if e.name in ("aten::mm", "aten::bmm")
            and e.input_shapes[:1]
            and e.input_shapes[0][-1:] == [1]
        ]
        assert not inner_one, (length, inner_one)
        with torch.no_grad():
            want = model(ids).logits[:, -1].float()
        got = ran.logits[0].float()
        off = (got - want).abs().max()  # bfloat16: two orders of sums, logits of ~10
        assert off <= 0.02 * want.abs().max() + 0.05, (length, off, want.abs().max())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
