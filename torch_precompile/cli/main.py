"""The ``torch-precompile`` command line: ``build``, ``inspect`` and ``bench`` an artifact file.

``build`` precompiles a model saved with ``save_pretrained`` into one file
(see ``_build``).

``inspect`` reads the header only and never unpickles (``cli/inspect_header.py``).
``bench`` loads the artifact (which runs code from the file, as
``Precompile.load`` does) and times it on random inputs built from the
recorded input signature.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._errors import PrecompileError
from .inspect_header import header, inspect_command
from .model_dir import add_build_options, options_from, resolve_serve_path
from .serve import add_serve, serve
from .text import one_line, terminal_text

PROG = "torch-precompile"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 error)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Build, look at and time torch_precompile artifacts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_build(sub)
    _add_generate(sub)
    add_serve(sub)
    add_build_options(sub.choices["serve"])  # serve MODEL_DIR builds its file first
    p_inspect = sub.add_parser(
        "inspect", help="print an artifact's header (never unpickles: safe on untrusted files)"
    )
    p_inspect.add_argument("path")
    p_inspect.add_argument("--json", action="store_true", help="print the header as JSON")
    p_inspect.add_argument(
        "--verify",
        action="store_true",
        help="also check the whole file's SHA-256 (reads every byte; default: the header's)",
    )
    p_bench = sub.add_parser(
        "bench", help="load an artifact and time load, first call and steady calls"
    )
    p_bench.add_argument("path")
    p_bench.add_argument("--iters", type=int, default=50, help="timed steady calls (default 50)")
    p_bench.add_argument(
        "--warmup", type=int, default=3, help="untimed calls after the first (default 3)"
    )
    p_bench.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p_bench.add_argument("--json", action="store_true", help="print the timings as JSON")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            return _build(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            resolve_serve_path(args)  # MODEL_DIR: its cached generator file, built if needed
            return serve(args)
        if args.command == "inspect":
            return inspect_command(args.path, as_json=args.json, verify=args.verify)
        return _bench(
            args.path, iters=args.iters, warmup=args.warmup, seed=args.seed, as_json=args.json
        )
    except BrokenPipeError:  # `... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except (PrecompileError, OSError, ValueError, TypeError, IndexError, RuntimeError) as exc:
        # IndexError: a token id past the vocabulary (the embedding's lookup).
        path = args.directory if args.command == "build" else args.path
        print(f"{PROG}: error: {one_line(exc, path)}", file=sys.stderr)
        return 1


def _add_build(sub: Any) -> None:
    p = sub.add_parser(
        "build",
        help="precompile a model saved with save_pretrained (transformers, diffusers) to one file",
    )
    p.add_argument("directory", help="the directory save_pretrained wrote")
    p.add_argument("-o", "--output", required=True, help="the artifact file to write")
    p.add_argument(
        "--task", help="the Auto class by task: causal-lm -> AutoModelForCausalLM (transformers)"
    )
    p.add_argument(
        "--class",
        dest="model_class",
        help="the class to load with: AutoModelForMaskedLM, GPT2LMHeadModel, UNet2DModel "
        "(default: AutoModel; diffusers: the config's class)",
    )
    p.add_argument("--dtype", help="cast the model (and float inputs): float32, bfloat16, ...")
    p.add_argument("--device", default="cpu", help="device to compile for (default cpu)")
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME:DTYPE:SHAPE",
        help="an example input, repeatable: input_ids:int64:2x16 (default: token ids 2x16 for "
        "a text model, 2 images for a vision model)",
    )
    p.add_argument(
        "--dynamic",
        action="append",
        nargs="?",
        const="all",
        default=[],
        metavar="NAME:DIM[:MIN:MAX]",
        help="capture a dimension dynamically, repeatable (alone: every dimension)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random example inputs")
    p.add_argument(
        "--generator",
        action="store_true",
        help="build the generator file serve runs (a decoder LM, its tokenizer and "
        "generation_config): the file serve DIRECTORY would build into its cache",
    )
    add_build_options(p, device=False)


def _build(args: argparse.Namespace) -> int:
    if args.generator:
        from .generator_build import build_generator

        build_generator(args.directory, args.output, options_from(args))
        return 0
    from .build import build

    build(
        args.directory,
        args.output,
        model_class=args.model_class,
        task=args.task,
        dtype=args.dtype,
        device=args.device,
        dynamic=True if "all" in args.dynamic else args.dynamic,
        inputs=args.input,
        seed=args.seed,
    )
    return 0


def _add_generate(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text (or token ids) with a file of compile_generator, streaming",
    )
    p.add_argument("path", help="a file saved from compile_generator")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="the prompt text (the file must hold a tokenizer)")
    which.add_argument("--ids", help="the prompt's token ids, comma-separated: 1,2,3")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="at most this many (default: the model's generation_config, else 20)",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--do-sample",
        action="store_const",
        const=True,
        help="sample (default: as the model's generation_config says, else greedy)",
    )
    how.add_argument("--greedy", dest="do_sample", action="store_const", const=False)
    # Each left out: the model's (its generation_config at build), else transformers'.
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="0: off (sampling default: 50)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling")


def _generate(args: argparse.Namespace) -> int:
    """Load a generator and print its continuation of one prompt as it is made: the
    text (prompt included) with its tokenizer, else the token ids."""
    import torch

    from .. import Precompile
    from ..runtime.generator import Generator

    generator = Precompile.load(args.path)
    if not isinstance(generator, Generator):
        raise ValueError(
            f"{args.path} is not a generator: build one with "
            "torch_precompile.generation.compile_generator"
        )
    tokenizer = None
    if args.prompt is not None:
        tokenizer = generator.tokenizer()
        ids = tokenizer.encode(args.prompt).ids
    else:
        ids = [int(t) for t in args.ids.split(",") if t.strip()]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    eos = set(generator.spec.eos_token_id)
    tokens = list(ids)
    shown = ""
    ended = False

    def show(token: torch.Tensor) -> None:
        nonlocal shown, ended
        if ended:
            return
        value = int(token[0])
        ended = value in eos
        if tokenizer is None:
            print(("," if tokens else "") + str(value), end="", flush=True)
            tokens.append(value)
            return
        tokens.append(value)
        text = tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):  # a character's bytes still to come
            print(terminal_text(text[len(shown) :]), end="", flush=True)
            shown = text

    prompt = torch.tensor([ids])
    generator._check(prompt, None, args.max_new_tokens, 0)  # a refusal before any output
    if tokenizer is None:
        print(",".join(str(t) for t in ids), end="", flush=True)
    else:
        shown = tokenizer.decode(ids)
        print(terminal_text(shown), end="", flush=True)
    try:
        generator.generate(
            prompt,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            streamer=show,
        )
    except BaseException:
        print(flush=True)  # the partial line ends before the one-line error
        raise
    if tokenizer is not None and tokenizer.decode(tokens) != shown:
        print(terminal_text(tokenizer.decode(tokens)[len(shown) :]), end="")
    print()
    return 0


# -------------------------------------------------------------------- bench


def _bench(path: str, *, iters: int, warmup: int, seed: int, as_json: bool) -> int:
    import torch

    from .. import Precompile
    from ..runtime.signature import example_call

    header(path)  # a non-artifact fails here (header only), before anything is unpickled
    start = time.perf_counter()
    artifact = Precompile.load(path)
    load_s = time.perf_counter() - start
    runtime = artifact.runtime
    args, kwargs = example_call(
        runtime.signature,
        artifact.signature.parameters or {},
        skip_first=runtime.bound_self is not None,
        seed=seed,
    )
    grad = torch.enable_grad if artifact.training else torch.no_grad
    with grad():
        start = time.perf_counter()
        artifact(*args, **kwargs)
        first_s = time.perf_counter() - start
        for _ in range(warmup):
            artifact(*args, **kwargs)
        steady = []
        for _ in range(max(1, iters)):
            start = time.perf_counter()
            artifact(*args, **kwargs)
            steady.append(time.perf_counter() - start)
    result = {
        "path": os.path.abspath(path),
        "load_s": load_s,
        "first_call_s": first_s,
        "steady_median_s": statistics.median(steady),
        "steady_mean_s": statistics.fmean(steady),
        "steady_min_s": min(steady),
        "iters": len(steady),
        "threads": torch.get_num_threads(),
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['path']}\n"
            f"load:         {load_s * 1e3:9.1f} ms  "
            "(Precompile.load: header, system check, each used section checked once, "
            "kernels, weights)\n"
            f"first call:   {first_s * 1e3:9.3f} ms\n"
            f"steady call:  {result['steady_median_s'] * 1e3:9.3f} ms median, "
            f"{result['steady_min_s'] * 1e3:.3f} ms min, over {len(steady)} calls "
            f"({result['threads']} threads; random inputs from the recorded signature)"
        )
    return 0
