"""Building a :class:`~torch_precompile.runtime.generator.Generator` (transformers present).

The step compiled is :class:`_Step`: the model's forward over a static key/value
cache whose tensors are arguments (a ``StaticCache`` made inside the traced
forward around them, so its writes go into the caller's tensors and nothing
is allocated), returning the last position's logits. The programs bundled
(``rows.py``): a prefill (prompt 2..L) of batch 1..N and, where the model allows it,
the slot decode step of ``serve`` (``start`` of shape ``(batch,)``, ``slots.py``), which
off a GPU is ``generate``'s decode step too (a one-token prompt's as well): two
programs. A GPU build, a model without the slot step (Bloom, Falcon) and a
tensor-parallel one have a decode step of their own (prompt 1); on a GPU each program
is one of batch 1 and one of 2..N.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from .. import Precompile, _compat, _progress_on_stderr
from .._compat.local_collectives import local_collectives
from .._errors import QuantizationError
from ..runtime.attention_backends import tracing_attention
from ..runtime.generator import Generator
from ..runtime.generator_spec import GeneratorSpec
from ..stages.size_one import takes_one
from .build_progress import BuildProgress, thread_free_options
from .decode_attention import grouped_decode_attention, groups_on
from .decode_matmul import int8_options, one_row_step, step_decompositions
from .model_settings import chat_fields, length_fields, sampling_fields
from .quantize import quantized_view
from .rows import Program, decodes_by_slots, mark, plan
from .slots import slot_example, slots_work
from .step import _Step
from .torch_only import refuse_foreign_ops, refuse_library_imports, torch_only_decompositions
from .views import fused_projections

log = logging.getLogger("torch_precompile")


def _cache_layout(model: torch.nn.Module, max_length: int) -> tuple[list[tuple[int, int]], str]:
    """Heads and head dimension of each cache tensor, and the cache's dtype, from one
    eager step of the model on a ``StaticCache``."""
    from transformers.cache_utils import StaticCache

    cache = StaticCache(model.config, max_cache_len=max_length)
    device = next(model.parameters()).device
    # A tensor-parallel model: the other ranks are not running this step, so its
    # collectives are answered on this rank (only the cache's shapes are read).
    alone = local_collectives() if _mesh_size(model) > 1 else contextlib.nullcontext()
    with torch.no_grad(), alone:
        model(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
            past_key_values=cache,
            use_cache=True,
        )
    shapes: list[tuple[int, int]] = []
    dtype = None
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            shapes.append((int(t.shape[1]), int(t.shape[-1])))
            dtype = t.dtype
    return shapes, str(dtype).removeprefix("torch.")


def _free_size(taken: set[int], low: int, high: int, multiple_of: int = 1) -> int:
    """A size in ``low..high`` equal to none of ``taken`` (Dynamo's duck sizing
    would tie a dynamic size to an equal static one and specialise it)."""
    for n in range(low, high + 1):
        if n not in taken and n % multiple_of == 0:
            return n
    raise ValueError(
        f"no example size in {low}..{high} differs from the model's sizes: use a larger max_length"
    )


def _mesh_size(model: torch.nn.Module) -> int:
    """The size of the mesh a tensor-parallel model's parameters live on (1: none)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return 1


def compile_generator(
    model: torch.nn.Module,
    *,
    max_batch: int,
    max_length: int,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    tokenizer: Any = None,
    fuse_projections: bool = False,
    weights: str | None = None,
    verbose: bool = False,
) -> Generator:
    """A generator for a decoder language model (``...ForCausalLM``) that serves itself.

    Batches of 1..``max_batch`` rows, prompt plus new tokens up to ``max_length``
    positions; save it with ``Precompile.save(path, generator)`` and
    ``Precompile.load(path)`` returns it, ready to ``generate`` without the
    model's library. ``tokenizer`` (a fast transformers tokenizer) is saved
    with it for text in, text out.

    A tensor-parallel model (``parallelize_module`` over a 1-D mesh) is built on
    one rank: its collectives are answered on that rank while the cache's
    shapes are read, and the step is traced for every rank at once. Each
    rank's cache holds its own heads. The other ranks write their shards with
    :func:`save_generator_shard`; every rank of a job of the same size loads
    the file and calls ``generate`` with the same tokens.

    ``mode`` and ``options`` are Inductor's, as in ``torch.compile``; the options
    hold for the whole capture. For decode at the speed of memory on CUDA, as
    gpt-fast: ``mode="reduce-overhead"`` (a CUDA graph per step) and
    ``options={"coordinate_descent_tuning": True}`` (each one-row matmul, with a
    bias or without, a tuned Triton reduction rather than a cuBLAS GEMV:
    ``decode_matmul.py``). On a GPU each decode step's grouped-query attention
    reads the cache's key/value heads without repeating them
    (``decode_attention.py``), and the prefill is traced without cuDNN's attention,
    which plans each new prompt length (``runtime/attention_backends.py``; kept when
    it is the only backend enabled).

    ``fuse_projections=True`` (not for a tensor-parallel model) traces the step
    through a view of the model whose attention ``q/k/v_proj`` and MLP
    ``gate/up_proj`` are one matmul each (``views.py``): three fewer kernels a
    layer, the same function (bf16 sums in another order). The build then holds
    those weights twice. Not the default: on an H200 it decoded the Qwen2.5-0.5B
    shape 8% slower, though its kernels were busy 10% less (docs/measurements.md).

    ``weights="int8"`` (per output channel) or ``"int4"`` (groups of 64 inputs)
    quantizes the decoder's ``nn.Linear`` weights at build with torchao
    (``quantize.py``; on the CPU the head and token embedding int8 too): the file holds
    plain int8 / packed int4 tensors and its step calls torch's own weight-only
    matmuls, so serving needs torch alone. A layer the format cannot hold is a
    :class:`~torch_precompile.QuantizationError` naming it. On CUDA an int8 build
    turns ``coordinate_descent_tuning`` on unless ``options`` names it: without it the
    weight's conversion is not fused into the one-row product (0.57x bf16's decode on
    an H200, 1.38x with it; docs/measurements.md).
    """
    if max_batch < 1 or max_length < 2:
        raise ValueError(
            f"max_batch must be 1 or more and max_length 2 or more, got "
            f"{max_batch} and {max_length}"
        )
    tokenizer_json = None
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
            tokenizer, "_tokenizer", None
        )
        if backend is None or not hasattr(backend, "to_str"):
            raise TypeError(
                f"tokenizer {type(tokenizer).__name__} has no tokenizers backend: pass a fast "
                "tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True))"
            )
        tokenizer_json = backend.to_str().encode()
    shapes, dtype = _cache_layout(model, max_length)
    device = next(model.parameters()).device
    world = _mesh_size(model)
    traced, fused = model, 0
    if fuse_projections and world == 1:
        traced, fused = fused_projections(model)
        log.info("generator: %d groups of projections fused", fused)
    elif fuse_projections:
        log.warning(
            "generator: fuse_projections is not applied to a tensor-parallel model (its "
            "shards hold the model's own projections); building it unfused"
        )
    quantized = None
    if weights is not None:
        if world > 1 or fused:
            raise QuantizationError(
                f"weights={weights!r} is not built with "
                f"{'tensor parallelism' if world > 1 else 'fuse_projections=True'} yet: "
                "build the quantized generator on one device, projections unfused"
            )
        traced, quantized = quantized_view(model, weights)
        log.info("generator: %d linear layers hold %s weights", quantized.layers, weights)
        options = int8_options(options, weights, device)
    step = _Step(traced, max_length).eval()
    refused = slots_work(step, shapes, dtype) if world == 1 else "tensor parallel"
    if refused:
        log.info("generator: no slot decode step (serve refuses the file): %s", refused)
    taken = {int(d) for t in (*step.parameters(), *step.buffers()) for d in t.shape}
    taken |= {n for s in shapes for n in s} | {max_length, len(shapes)}
    # and the config's own numbers: a size equal to one the model computes with (a
    # mixture's experts per token, the top-k of its routing) is tied to it, and a
    # batch-1 prefill traced at a length of 2 beside a top-2 router served that length only
    taken |= {v for v in vars(model.config).values() if type(v) is int and v > 0}
    prompt = _free_size(taken, 2, max_length)
    batch = _free_size(taken | {prompt}, 2, 10**6)

    def example(program: Program) -> tuple[Any, ...]:
        b, s = program.batch, program.length
        if program.slot:  # one token a row, each row its own offset (slots.py)
            args = slot_example(b, max_length, shapes, dtype, device)
            ids, mask, positions, start, *cache = args
            rows: tuple[Any, ...] = (mask, start, *cache)
        else:
            ids = torch.randint(0, 2, (b, s), device=device)
            mask = torch.zeros((b, max_length), dtype=torch.long, device=device)
            mask[:, : s + 1] = 1
            positions = torch.arange(1, s + 1, device=device).repeat(b, 1)  # no _base guard
            start = torch.tensor(1, device=device)
            cache = [
                torch.zeros((b, h, max_length, d), dtype=getattr(torch, dtype), device=device)
                for h, d in shapes
            ]
            rows, args = (mask, *cache), (ids, mask, positions, start, *cache)
        for tensor in cache:  # written in place by every step, CUDA graphs or not
            _compat.mark_static_address(tensor)
        mark(program, ids, positions, *rows)
        return args

    # One program for many sizes where the capture allows (rows.py); a file of one row
    # needs no program for more (a batch past max_batch is refused); where the model
    # takes the slot step, off a GPU, it is generate's decode step too.
    held = sum(t.numel() * t.element_size() for t in (*step.parameters(), *step.buffers()))
    one_row = one_row_step(weights, dtype, held)
    programs = plan(max_batch, batch, prompt, device.type, world, not refused, one_row)
    if world > 1:
        # Tensor parallel: DTensor's sharding rules guard a prompt's rows on whether
        # they split evenly over the mesh (``Ne(Mod(batch, 2), 0)``), so the prefill
        # is compiled at a batch that does too.
        even = _free_size(taken | {prompt, batch}, 2, 10**6, multiple_of=world)
        name = f"prefill, batch {even} (rows split over the mesh)"
        programs.append((Program(name, even, prompt), []))
    examples = [(example(p), p, rest) for p, rest in programs]
    variants = []
    tables = {
        prefill: {**torch_only_decompositions(), **step_decompositions(options, device, prefill)}
        for prefill in (True, False)
    }
    # On a GPU a decode step's grouped-query attention reads the cache's own heads
    # (decode_attention.py); a tensor-parallel step's heads are its shards', left as traced.
    grouped = groups_on(device) and world == 1
    options = thread_free_options(options)
    began = time.perf_counter()
    took: list[float] = []
    names: list[str] = []
    with torch.no_grad(), _compat.inductor_options(options), _dropped_guards_once():
        todo = list(examples)
        while todo:
            args, program, instead = todo.pop(0)
            prefill = args[0].shape[1] > 1
            n = len(variants) + 1
            progress = BuildProgress(program.name, n, n + len(todo), began)
            log.info("generator: compiling %s", progress, extra={"progress": progress})
            start = time.perf_counter()
            with tracing_attention(device, prefill):
                rest = (mode, options, tables[prefill], fused > 0, grouped, verbose)
                variants.append(_compile_step(step, args, *rest, program.marked))
            took.append(time.perf_counter() - start)
            names.append(program.name)
            if program.marked and not takes_one(variants[-1]):
                # an operator of this torch branched on a size of 1: the programs it left
                log.info("generator: %s leaves a size of 1 out", program.name)
                todo[:0] = [(example(p), p, []) for p in instead]
    log.info(
        "generator: %d programs compiled in %.1f s (%s)",
        len(variants),
        time.perf_counter() - began,
        ", ".join(f"{name} {t:.1f} s" for name, t in zip(names, took)),
        extra={"progress": None, "programs": dict(zip(names, took))},
    )
    config = model.config
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    spec = GeneratorSpec(
        max_batch=max_batch,
        max_length=max_length,
        kv_shapes=tuple(shapes),
        dtype=dtype,
        device=str(device),
        eos_token_id=tuple([eos] if isinstance(eos, int) else (eos or [])),
        pad_token_id=pad,
        model_type=str(getattr(config, "model_type", "")),
        slots=not refused,
        decode_by_slots=decodes_by_slots(not refused, device.type),
        sampling=sampling_fields(model),
        lengths=length_fields(model),
        **chat_fields(tokenizer),
        **({} if quantized is None else quantized.spec_fields()),
    )
    generator = Generator(Precompile.precompile(variants), spec, tokenizer_json)
    refuse_library_imports(generator, model)  # the file it makes serves with torch alone
    return generator


def _compile_step(
    step: _Step,
    args: tuple[Any, ...],
    mode: str | None,
    options: dict[str, Any] | None,
    decompositions: dict[Any, Any],
    fused: bool,
    grouped: bool,
    verbose: bool,
    marked: bool,
) -> Any:
    """One variant of the step, stage by stage: ``grouped``, its one-query attentions
    read the cache's key/value heads unrepeated (Dynamo's graph rewritten); operators a
    model library registers are decomposed into torch's where they can be
    (``decompositions``, with the decode step's own), and the ATen graph is checked for
    any left (a served file could not call them) before Inductor runs. ``marked``:
    the example's marked dimensions are its only dynamic ones, reasoned about
    size-obliviously (``rows.py``)."""
    with _progress_on_stderr(verbose):
        if marked:
            captured = Precompile.dynamo(step, args, dynamic=None, size_oblivious=True)
        else:
            captured = Precompile.dynamo(step, args, dynamic=True)
        graph_module, rewritten = captured.graph_module, 0
        if grouped:
            graph_module, rewritten = grouped_decode_attention(graph_module)
        if rewritten:
            log.info("generator: %d decode attentions read the cache's heads unrepeated", rewritten)
        joint = Precompile.aot_autograd(
            graph_module, captured.guards, decompositions=decompositions
        )
        refuse_foreign_ops(joint.joint_graph, step.model)
        graph = joint.joint_graph
        if fused:  # each part of a group computes the group's product (views.py): once here
            graph = _compat.without_duplicates(graph)
        compiled = Precompile.inductor(graph, joint.guards, mode=mode, options=options)
        return Precompile.precompile(compiled)


class _OnceFilter(logging.Filter):
    """Holds back the "guards not re-checked after load" record of each variant."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "guards are not re-checked after load" in str(record.msg):
            self.held.append(record)
            return False
        return True


@contextlib.contextmanager
def _dropped_guards_once() -> Iterator[None]:
    """Each variant's stage logs the guards it could not keep; a build says it once, for
    the variant that dropped the most (the variants share their guards)."""
    once = _OnceFilter()
    log.addFilter(once)
    try:
        yield
    finally:
        log.removeFilter(once)
    if once.held:
        log.handle(max(once.held, key=lambda r: r.args[0] if r.args else 0))


def save_generator_shard(path: Any, model: torch.nn.Module) -> str:
    """Write this rank's shard of a tensor-parallel ``model`` beside the generator file ``path``.

    The rank that built the generator wrote the code file and its own shard
    with ``Precompile.save(path, generator)``; every other rank of the job calls
    this (no compile, no collective). The shard holds this rank's slice of the
    weights under the names the generator's step gives them. Returns the path
    written.
    """
    return Precompile.save_shard(path, _Step(model, 0))
