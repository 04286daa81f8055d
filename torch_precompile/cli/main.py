"""The ``torch-precompile`` command line: ``build``, ``inspect`` and ``bench`` an artifact file.

``build`` precompiles a model saved with ``save_pretrained`` into one file
(see ``_build``).

``inspect`` reads the header only (``file.read.open_artifact``, then the typed
``file.header.Header``): it checks the header's SHA-256, which pins every
section's, and never unpickles, so it is safe on untrusted files and does not
import the compiler; ``--verify`` also checks the whole file's SHA-256 (every
byte read). ``bench`` loads the artifact (which runs code from the file, as
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
from ..file.header import Header
from ..file.layout import looks_like_artifact
from ..file.read import read_info, read_prefix
from ..file.reader import open_artifact
from ..serve.command import add_serve, serve

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
            return serve(args)
        if args.command == "inspect":
            return _inspect(args.path, as_json=args.json, verify=args.verify)
        return _bench(
            args.path, iters=args.iters, warmup=args.warmup, seed=args.seed, as_json=args.json
        )
    except BrokenPipeError:  # `... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except (PrecompileError, OSError, ValueError, TypeError, IndexError, RuntimeError) as exc:
        # IndexError: a token id past the vocabulary (the embedding's lookup).
        path = args.directory if args.command == "build" else args.path
        print(f"{PROG}: error: {_one_line(exc, path)}", file=sys.stderr)
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


def _build(args: argparse.Namespace) -> int:
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
    p.add_argument("--max-new-tokens", type=int, default=20, help="at most this many (default 20)")
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling")


def _generate(args: argparse.Namespace) -> int:
    """Load a generator and print its continuation of one prompt as it is made: the
    text (prompt included) with its tokenizer, else the token ids."""
    import torch

    from ..runtime.generator import Generator
    from ..serialization.load import load

    generator = load(args.path)
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
            print(_text(text[len(shown) :]), end="", flush=True)
            shown = text

    prompt = torch.tensor([ids])
    generator._check(prompt, None, args.max_new_tokens, 0)  # a refusal before any output
    if tokenizer is None:
        print(",".join(str(t) for t in ids), end="", flush=True)
    else:
        shown = tokenizer.decode(ids)
        print(_text(shown), end="", flush=True)
    try:
        generator.generate(
            prompt,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            streamer=show,
        )
    except BaseException:
        print(flush=True)  # the partial line ends before the one-line error
        raise
    if tokenizer is not None and tokenizer.decode(tokens) != shown:
        print(_text(tokenizer.decode(tokens)[len(shown) :]), end="")
    print()
    return 0


def _text(text: str) -> str:
    """Generated text safe for a terminal: lines and tabs kept, every other control
    or format character (an ANSI escape the model wrote) escaped by :func:`printable`."""
    return "\n".join("\t".join(printable(p) for p in line.split("\t")) for line in text.split("\n"))


def _one_line(exc: BaseException, path: str) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{path}: {exc.strerror}"
    return printable(text, limit=2000)


# Characters a terminal may act on: C0/C1 controls (ANSI escapes start with ESC),
# DEL, and the invisible format characters that reorder text (bidi overrides).
_UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def printable(text: str, *, limit: int | None = None) -> str:
    """``text`` safe to write to a terminal: control and format characters (ANSI escape
    sequences, bidi overrides, newlines) shown as ``\\x1b``-style escapes, and cut at
    ``limit`` characters."""
    import unicodedata

    out = "".join(
        ch.encode("unicode_escape").decode("ascii")
        if not " " <= ch <= "~" and unicodedata.category(ch) in _UNPRINTABLE_CATEGORIES
        else ch
        for ch in text
    )
    if limit is not None and len(out) > limit:
        out = f"{out[:limit]}... ({len(out) - limit} more characters)"
    return out


def _printable_tree(value: Any) -> Any:
    """``value`` (decoded JSON) with every string made printable and cut to a sane length."""
    if isinstance(value, str):
        return printable(value, limit=_FIELD_LIMIT)
    if isinstance(value, dict):
        return {printable(str(k), limit=_FIELD_LIMIT): _printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_tree(v) for v in value]
    return value


_FIELD_LIMIT = 500
_LINE_LIMIT = 4000


# ------------------------------------------------------------------ inspect


def header(path: str, *, verify: bool = False) -> dict[str, Any]:
    """Everything ``inspect`` shows, as one JSON-able dict (no unpickling).

    Reads the fixed fields and the header, checked against the header's SHA-256
    (a file of format version 1, which has none, is checked whole); with
    ``verify``, the whole file's SHA-256 is checked too (every byte is read)."""
    try:
        if verify:
            info = read_info(path)
        else:
            with open_artifact(path) as reader:
                info = reader.info
    except PrecompileError as exc:
        prefix = read_prefix(path, 2)
        if prefix[:1] == b"\x80" and not looks_like_artifact(prefix):
            raise type(exc)(
                f"{path} is not a torch_precompile artifact: it looks like a pickle (a file of "
                "torch's save_compiled_function?); inspect never unpickles, load it with "
                "Precompile.load(path, model=...)"
            ) from None
        raise
    return {
        **_generator_record(path, info),
        "path": os.path.abspath(path),
        "format_version": info.format_version,
        "signed": info.signed,
        "file_size": info.file_size,
        "sections": [
            {"name": s["name"], "length": s["length"], **_digest_of(s)} for s in info.sections
        ],
        "meta": info.meta,
    }


def _digest_of(section: dict[str, Any]) -> dict[str, Any]:
    """A section's digest fields as the table records them (plain or tree SHA-256)."""
    return {k: section[k] for k in ("sha256", "sha256_tree", "tree_chunk") if k in section}


def _generator_record(path: str, info: Any) -> dict[str, Any]:
    """``{"generator": ...}``, the spec a generator file records (JSON, checked against its
    SHA-256 as every section read here) and whether its tokenizer is inside; ``{}`` for
    a file of another kind."""
    from ..runtime.generator import SPEC_SECTION, TOKENIZER_SECTION, GeneratorSpec

    names = {s["name"] for s in info.sections}
    if SPEC_SECTION not in names:
        return {}
    with open_artifact(path) as reader:
        raw = reader.read(SPEC_SECTION)
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    spec = GeneratorSpec.from_json(data, path)
    record = {
        "max_batch": spec.max_batch,
        "max_length": spec.max_length,
        "eos_token_id": list(spec.eos_token_id),
        "pad_token_id": spec.pad_token_id,
        "dtype": spec.dtype,
        "device": spec.device,
        "model_type": spec.model_type,
        "tokenizer": TOKENIZER_SECTION in names,
    }
    return {"generator": record}


def _generator_lines(record: dict[str, Any]) -> list[str]:
    """The text view of a generator's spec, shown before the rest of the header."""
    g = _printable_tree(record)
    eos = ", ".join(map(str, g["eos_token_id"])) or "none"
    return [
        f"generator: {g['model_type'] or 'decoder'}, max_batch {g['max_batch']}, "
        f"max_length {g['max_length']}, {g['dtype']} on {g['device']}",
        f"  eos_token_id {eos}, pad_token_id {g['pad_token_id']}, tokenizer "
        f"{'inside' if g['tokenizer'] else 'not inside (token ids in and out)'}",
    ]


def _inspect(path: str, *, as_json: bool, verify: bool = False) -> int:
    data = header(path, verify=verify)
    if as_json:
        # ensure_ascii: every control character is written as a \u escape.
        print(json.dumps(data, indent=2, sort_keys=False, ensure_ascii=True))
        return 0
    # A field of the wrong type raises ArtifactCorruptedError naming it (`--json`
    # still prints the header as it is). Strings are escaped before anything reads them.
    typed = Header.decode(data["format_version"], _printable_tree(data["meta"]), path)
    if "generator" in data:
        print("\n".join(_generator_lines(data["generator"])))
    print(format_header(data, typed))
    return 0


def format_header(data: dict[str, Any], typed: Header) -> str:
    """The human-readable view of :func:`header`'s dict and its typed header.

    Every string from the file is shown with its control characters escaped
    (no ANSI escape reaches the terminal) and cut at a sane length.
    """
    # Imported when used: the command line starts without torch until a command needs it.
    from ..guards import Guards
    from ..runtime.artifact import human_size, signature_lines
    from ..runtime.signature import CallSignature

    system = typed.system
    signed = "signed (HMAC-SHA256)" if data["signed"] else "unsigned"
    kind = "training" if typed.training else "inference"
    lines = [
        f"{data['path']}: torch_precompile artifact, format version {data['format_version']}, "
        f"{human_size(data['file_size'])}, {signed}",
        f"producer:  {typed.producer}",
        f"created:   {typed.created}",
        f"kind:      {kind}, device {typed.device_type}, captured from a {typed.kind}",
        "system:    "
        + ", ".join(
            part
            for part in (
                f"torch {system.get('torch')}" if system.get("torch") else "",
                f"Python {system.get('python')}" if system.get("python") else "",
                " ".join(str(system[k]) for k in ("platform", "os") if system.get(k)),
                f"CPU instruction set {system['cpu_isa']}" if system.get("cpu_isa") else "",
                _cuda(system.get("cuda")),
            )
            if part
        ),
        "signature:",
    ]
    recorded = CallSignature.from_dict(typed.variants[0].signature)
    lines += [f"  {line}" for line in signature_lines(recorded)]
    sizes = typed.sizes or {s["name"]: s["length"] for s in data["sections"]}
    lines.append("sizes:     " + ", ".join(f"{k} {human_size(int(v))}" for k, v in sizes.items()))
    lines += _load_paths(data, typed)
    if typed.timings:
        lines.append("timings:   " + ", ".join(f"{k} {v:.2f} s" for k, v in typed.timings.items()))
    for i, variant in enumerate(typed.variants):
        guards = Guards.from_json(list(variant.guards))
        which = f"variant {i} ({'training' if variant.training else 'inference'}) " * typed.bundle
        lines.append(f"{which}guards ({len(guards)}), by stage:")
        lines += [f"  {line}" for line in str(guards).splitlines()]
    # Strings from the file, escaped and cut line by line.
    return "\n".join(printable(line, limit=_LINE_LIMIT) for line in lines)


def _load_paths(data: dict[str, Any], typed: Header) -> list[str]:
    """Which load path each variant takes: lean, or PyTorch's full path and why."""
    names = {s["name"] for s in data["sections"]}
    lines = []
    for i, variant in enumerate(typed.variants):
        label = f"variant {i}:" if typed.bundle else "load path:"
        if typed.lean_section(i) in names:
            how = "lean (shipped kernels; no Dynamo, Inductor, AOTAutograd or Triton compiler)"
        else:
            why = variant.lean_refusal or "no lean section"
            how = f"PyTorch's full path ({why})"
        lines.append(f"{label:10s} {how}")
    return lines


def _cuda(cuda: Any) -> str:
    if not cuda:
        return ""
    if isinstance(cuda, dict):
        return f"CUDA {cuda.get('name', '')} capability {cuda.get('capability', '?')}".replace(
            "  ", " "
        )
    return f"CUDA {cuda}"


# -------------------------------------------------------------------- bench


def _bench(path: str, *, iters: int, warmup: int, seed: int, as_json: bool) -> int:
    import torch

    from ..runtime.signature import example_call
    from ..serialization.load import load

    header(path)  # a non-artifact fails here (header only), before anything is unpickled
    start = time.perf_counter()
    artifact = load(path)
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
