"""``torch-precompile build``: a model saved with ``save_pretrained`` into one artifact file.

The directory's ``config.json`` says which library wrote it: a diffusers model
names its class (``_class_name``); anything else is a transformers model, loaded
through an Auto class (``AutoModel`` unless ``--task`` or ``--class`` picks
another). The example inputs are random tensors of the given names, dtypes and
shapes, or a default read from the config (token ids, 2 x 16, for a text model;
2 images of the config's size for a vision model). Each step's progress and time
go to stderr as it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from .. import _compat
from .._errors import ModelDirectoryError

DEFAULT_BATCH, DEFAULT_SEQ = 2, 16


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One example input: ``input_ids:int64:2x16`` (an empty shape is a scalar)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> InputSpec:
        parts = text.split(":")
        if len(parts) != 3 or not parts[0].isidentifier():
            raise ValueError(
                f"--input {text!r}: expected NAME:DTYPE:SHAPE, such as input_ids:int64:2x16 "
                "(an empty SHAPE is a scalar: timestep:int64:)"
            )
        name, dtype_name, shape = parts
        try:
            sizes = tuple(int(s) for s in shape.split("x")) if shape else ()
        except ValueError:
            raise ValueError(
                f"--input {text!r}: SHAPE must be sizes joined by x, such as 2x16"
            ) from None
        return cls(name, parse_dtype(dtype_name), sizes)


@dataclasses.dataclass(frozen=True)
class DynamicSpec:
    """A dimension captured dynamically: ``input_ids:1`` or ``input_ids:1:2:128``."""

    name: str
    dim: int
    low: int | None = None
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> DynamicSpec:
        parts = text.split(":")
        try:
            if len(parts) not in (2, 4):
                raise ValueError
            numbers = [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(
                f"--dynamic {text!r}: expected NAME:DIM or NAME:DIM:MIN:MAX, such as "
                "input_ids:1:2:128 (or --dynamic alone for every dimension)"
            ) from None
        return cls(parts[0], *numbers)


def parse_dtype(name: str) -> torch.dtype:
    """``float16`` -> ``torch.float16``; a clear error for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"unknown dtype {name!r}: use a torch dtype name (float32, bfloat16, int64)"
        )
    return dtype


def build(
    directory: str,
    output: str,
    *,
    model_class: str | None = None,
    task: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    dynamic: Sequence[str] | bool = (),
    inputs: Sequence[str] = (),
    seed: int = 0,
    stream: TextIO = sys.stderr,
) -> int:
    """Load the saved model, precompile it on example inputs and save it to ``output``.

    Returns the file's size in bytes. ``dynamic=True`` makes every dimension
    dynamic; strings (``input_ids:1:2:128``) mark single dimensions.
    """
    from .. import Precompile

    specs = [InputSpec.parse(s) for s in inputs]
    marks = [] if isinstance(dynamic, bool) else [DynamicSpec.parse(s) for s in dynamic]
    cast = parse_dtype(dtype) if dtype else None
    config = _read_config(directory)
    start = time.perf_counter()
    with _step(stream, f"loading {directory}") as note:
        model = _load(directory, config, model_class, task).to(device=device, dtype=cast).eval()
        note(f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters")
    kwargs = _example_inputs(model, config, specs, device, cast, seed)
    for mark in marks:
        if mark.name not in kwargs:
            raise ValueError(
                f"--dynamic names {mark.name!r}, which is not an input ({_names(kwargs)})"
            )
        _compat.mark_dynamic(kwargs[mark.name], mark.dim, mark.low, mark.high)
    shapes = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in kwargs.items())
    with _step(stream, f"precompiling on {shapes}"), torch.no_grad():
        artifact = Precompile.compile(
            model, (), kwargs, dynamic=True if dynamic is True else None, verbose=True
        )
    with _step(stream, f"saving {output}"):
        Precompile.save(output, artifact)
    from ..runtime.artifact import human_size

    size = os.path.getsize(output)
    print(
        f"torch-precompile build: wrote {output} ({human_size(size)}) in "
        f"{time.perf_counter() - start:.1f} s",
        file=stream,
        flush=True,
    )
    return size


@contextlib.contextmanager
def _step(stream: TextIO, what: str) -> Iterator[Any]:
    """Print ``what`` as it starts and its time when it ends (``note`` adds a detail)."""
    notes: list[str] = []
    print(f"torch-precompile build: {what} ...", file=stream, flush=True)
    start = time.perf_counter()
    yield notes.append
    detail = f" ({'; '.join(notes)})" if notes else ""
    print(
        f"torch-precompile build: {what}: done in {time.perf_counter() - start:.1f} s{detail}",
        file=stream,
        flush=True,
    )


def _read_config(directory: str) -> dict[str, Any]:
    path = Path(directory)
    if not path.is_dir():
        raise ModelDirectoryError(
            f"{directory} is not a directory: give the directory a model was saved to with "
            "save_pretrained (it holds config.json and the weights)"
        )
    config = path / "config.json"
    if not config.is_file():
        if (path / "model_index.json").is_file():
            raise ModelDirectoryError(
                f"{directory} holds a diffusers pipeline (model_index.json), not one model: "
                f"build one of its components, such as {path / 'unet'}"
            )
        found = sorted(p.name for p in path.iterdir())[:8]
        raise ModelDirectoryError(
            f"{directory} holds no saved model: there is no config.json (found: "
            f"{', '.join(found) or 'nothing'}); save one with model.save_pretrained({directory!r})"
        )
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirectoryError(f"{config} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelDirectoryError(f"{config} does not hold a model config (a JSON object)")
    return data


def auto_class_name(task: str) -> str:
    """``causal-lm`` -> ``AutoModelForCausalLM``; ``sequence-classification`` likewise."""
    special = {"lm": "LM", "seq2seq": "Seq2Seq", "ctc": "CTC"}
    words = [special.get(w, w.capitalize()) for w in task.lower().replace("_", "-").split("-")]
    return "AutoModelFor" + "".join(words)


def _load(
    directory: str, config: dict[str, Any], model_class: str | None, task: str | None
) -> torch.nn.Module:
    if "_diffusers_version" in config:
        import diffusers

        library, name = diffusers, model_class or str(config.get("_class_name"))
    else:
        import transformers

        library = transformers
        name = model_class or (auto_class_name(task) if task else "AutoModel")
    cls = getattr(library, name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        hint = (
            " (--task causal-lm gives AutoModelForCausalLM)"
            if library.__name__ == "transformers"
            else ""
        )
        raise ModelDirectoryError(
            f"{library.__name__} has no model class {name!r} to load {directory} with{hint}"
        )
    try:
        return cls.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelDirectoryError(f"{name}.from_pretrained({directory!r}) failed: {first}") from exc


def _names(kwargs: dict[str, Any]) -> str:
    return ", ".join(kwargs) or "none"


def _example_inputs(
    model: torch.nn.Module,
    config: dict[str, Any],
    specs: Sequence[InputSpec],
    device: str,
    cast: torch.dtype | None,
    seed: int,
) -> dict[str, torch.Tensor]:
    """Random tensors for ``specs``, or the config's default inputs."""
    if not specs:
        specs = _default_specs(config, cast or torch.float32)
    if not specs:
        raise ModelDirectoryError(
            f"no default inputs for a {type(model).__name__} (its config has no vocab_size or "
            "image_size): name them, such as --input sample:float32:2x4x32x32 --input "
            "timestep:int64:"
        )
    generator = torch.Generator().manual_seed(seed)
    vocab = int(_text_config(config).get("vocab_size") or 2)
    out = {}
    for spec in specs:
        if spec.dtype.is_floating_point:
            value = torch.randn(spec.shape, generator=generator).to(cast or spec.dtype)
        elif "mask" in spec.name:
            value = torch.ones(spec.shape, dtype=spec.dtype)
        else:
            high = vocab if spec.name.endswith("ids") else 2
            value = torch.randint(0, high, spec.shape, generator=generator, dtype=spec.dtype)
        out[spec.name] = value.to(device)
    return out


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) and "vocab_size" not in config else config


def _default_specs(config: dict[str, Any], dtype: torch.dtype) -> list[InputSpec]:
    if "vocab_size" in _text_config(config):
        ids = [InputSpec("input_ids", torch.int64, (DEFAULT_BATCH, DEFAULT_SEQ))]
        if config.get("is_encoder_decoder"):
            ids.append(InputSpec("decoder_input_ids", torch.int64, (DEFAULT_BATCH, DEFAULT_SEQ)))
        return ids
    size, channels = config.get("image_size"), config.get("num_channels")
    if isinstance(size, int) and isinstance(channels, int):
        return [InputSpec("pixel_values", dtype, (DEFAULT_BATCH, channels, size, size))]
    return []
