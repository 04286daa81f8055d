"""``torch-precompile inspect``: an artifact's header, read without unpickling.

Reads the fixed fields and the header (``file.reader.open_artifact``, then the
typed ``file.header.Header``), checked against the header's SHA-256, which pins
every section's; never unpickles, so it is safe on untrusted files and does not
import the compiler.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .._errors import PrecompileError
from ..file.header import Header
from ..file.layout import looks_like_artifact, looks_like_torch_compiled_file
from ..file.read_whole import read_info, read_prefix
from ..file.reader import open_artifact
from .text import LINE_LIMIT, printable, printable_tree


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
        prefix = read_prefix(path, 16)
        if looks_like_torch_compiled_file(prefix) and not looks_like_artifact(prefix):
            raise type(exc)(
                f"{path} is not a torch_precompile artifact: it looks like a pickle or a file of "
                "torch's save_compiled_function; inspect never unpickles, load it with "
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
    from ..file.sections import GENERATOR, GENERATOR_TOKENIZER
    from ..runtime.generator_spec import GeneratorSpec

    names = {s["name"] for s in info.sections}
    if GENERATOR not in names:
        return {}
    with open_artifact(path) as reader:
        raw = reader.read(GENERATOR)
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
        "tokenizer": GENERATOR_TOKENIZER in names,
        "sampling": dict(spec.sampling),  # the model's generation_config settings
        "lengths": dict(spec.lengths),
        "weights": _weights_record(spec),
    }
    return {"generator": record}


def _weights_record(spec: Any) -> dict[str, Any]:
    """The decoder's linear weights: their format and bytes (quantized or not)."""
    if not spec.weights:
        return {"format": spec.dtype}
    return {
        "format": spec.weights,
        "group": spec.weight_group,  # inputs one scale covers; 0: a whole output row
        "quantized_layers": spec.quantized_layers,
        "bytes": spec.quantized_bytes,  # with their scales (and int4's zeros)
        "float_bytes": spec.float_bytes,  # the same weights in the model's dtype
        "head_bytes": spec.head_bytes,  # the int8 head and token embedding (0: not)
        "head_float_bytes": spec.head_float_bytes,
    }


def _generator_lines(record: dict[str, Any]) -> list[str]:
    """The text view of a generator's spec, shown before the rest of the header."""
    g = printable_tree(record)
    eos = ", ".join(map(str, g["eos_token_id"])) or "none"
    own = ", ".join(f"{k} {v}" for k, v in g["sampling"].items()) or "none (transformers')"
    lengths = ", ".join(f"{k} {v}" for k, v in g.get("lengths", {}).items())
    lengths = lengths or "20 (transformers')"
    return [
        f"generator: {g['model_type'] or 'decoder'}, max_batch {g['max_batch']}, "
        f"max_length {g['max_length']}, {g['dtype']} on {g['device']}",
        f"  eos_token_id {eos}, pad_token_id {g['pad_token_id']}, tokenizer "
        f"{'inside' if g['tokenizer'] else 'not inside (token ids in and out)'}",
        f"  sampling defaults (the model's generation_config): {own}",
        f"  new tokens when a call does not say: {lengths}",
        f"  linear weights: {_weights_line(g.get('weights', {}))}",
    ]


def _weights_line(w: dict[str, Any]) -> str:
    if "bytes" not in w:
        return f"{w.get('format', '?')} (not quantized)"
    per = "per output channel" if not w["group"] else f"groups of {w['group']} inputs"
    line = (
        f"{w['format']} {per}, {w['quantized_layers']} layers, {w['bytes']:,} bytes with "
        f"scales ({w['float_bytes']:,} in the model's dtype, "
        f"{w['bytes'] / max(w['float_bytes'], 1):.2f}x)"
    )
    if w.get("head_bytes"):
        line += (
            f"; head and token embedding int8 per row, {w['head_bytes']:,} bytes "
            f"({w['head_float_bytes']:,} in the model's dtype)"
        )
    return line


def inspect_command(path: str, *, as_json: bool, verify: bool = False) -> int:
    data = header(path, verify=verify)
    if as_json:
        # ensure_ascii: every control character is written as a \u escape.
        print(json.dumps(data, indent=2, sort_keys=False, ensure_ascii=True))
        return 0
    # A field of the wrong type raises ArtifactCorruptedError naming it (`--json`
    # still prints the header as it is). Strings are escaped before anything reads them.
    typed = Header.decode(data["format_version"], printable_tree(data["meta"]), path)
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
    from .. import Guards
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
    lines += import_lines(typed.imports)
    if typed.timings:
        lines.append("timings:   " + ", ".join(f"{k} {v:.2f} s" for k, v in typed.timings.items()))
    for i, variant in enumerate(typed.variants):
        guards = Guards.from_json(list(variant.guards))
        which = f"variant {i} ({'training' if variant.training else 'inference'}) " * typed.bundle
        lines.append(f"{which}guards ({len(guards)}), by stage:")
        lines += [f"  {line}" for line in str(guards).splitlines()]
    # Strings from the file, escaped and cut line by line.
    return "\n".join(printable(line, limit=LINE_LIMIT) for line in lines)


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


def import_lines(imports: dict[str, dict[str, list[str]]] | None) -> list[str]:
    """The packages a load imports (``meta.imports``, recorded at save from the pickles'
    opcodes, the skeleton and the compiled code), beside the standard library's; then
    those only PyTorch's full path or Dynamo's own guards would import, and the places
    that name a package other than torch and this one."""
    if imports is None:
        return ["imports:   not recorded (a file saved before they were)"]
    lines = []
    fallback = "  only PyTorch's full path or Dynamo's guards:"
    labels = (("load", "imports:  "), ("fallback", fallback))
    for part, label in labels:
        table = imports.get(part, {})
        packages = sorted({m.split(".")[0] for m in table})
        stdlib = [p for p in packages if p in sys.stdlib_module_names]
        others = [p for p in packages if p not in stdlib]
        text = ", ".join(others) or "none"
        if stdlib:
            text += f" (and the standard library's {', '.join(stdlib)})"
        if part == "load":
            text += " at load"
        lines.append(f"{label} {text}")
        for module, places in table.items():
            if module.split(".")[0] not in (*stdlib, "torch", "torch_precompile"):
                lines.append(f"    {module}: {'; '.join(places)}")
    return lines


def _cuda(cuda: Any) -> str:
    if not cuda:
        return ""
    if isinstance(cuda, dict):
        return f"CUDA {cuda.get('name', '')} capability {cuda.get('capability', '?')}".replace(
            "  ", " "
        )
    return f"CUDA {cuda}"
