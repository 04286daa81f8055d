"""``torch-precompile build --generator MODEL_DIR -o FILE``: a checkpoint directory into
a generator file, the one ``serve MODEL_DIR`` builds into its cache.

The model is transformers' ``AutoModelForCausalLM`` of the directory (its
``generation_config.json`` read with it: the sampling defaults and the end
tokens), the tokenizer its ``AutoTokenizer`` (a fast one: its chat template and
special tokens go into the file). Progress goes to ``stream`` as the programs
compile (``cli/progress.py``); the end says the file's size, what it holds and
the time.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from .._errors import ModelDirectoryError
from .model_dir import BuildOptions, read_model_dir
from .progress import build_progress


def build_generator(
    directory: str,
    output: str,
    options: BuildOptions,
    *,
    stream: TextIO = sys.stderr,
    config: dict[str, Any] | None = None,
) -> int:
    """Build ``directory``'s generator for ``options`` and save it to ``output``; returns
    the file's size in bytes. ``output`` appears whole at the end or not at all."""
    from .. import Precompile
    from ..runtime.artifact import human_size

    config = config if config is not None else read_model_dir(directory)
    options = options.resolved(config)
    began = time.perf_counter()
    with build_progress(stream) as progress:
        check_family(directory, config)  # before any line: the error alone
        progress.line(f"loading {directory}")
        model, tokenizer = _load(directory, options)
        parameters = sum(p.numel() for p in model.parameters())
        progress.line(
            f"{type(model).__name__}, {parameters:,} parameters, {options.dtype} on "
            f"{options.device}: building a generator of batch 1..{options.max_batch}, "
            f"{options.max_length} positions ({time.perf_counter() - began:.1f} s so far)"
        )
        from ..generation import compile_generator

        generator = compile_generator(
            model,
            max_batch=int(options.max_batch or 1),
            max_length=int(options.max_length or 2),
            mode=options.mode,
            tokenizer=tokenizer,
        )
        progress.line(f"saving {output}")
        Precompile.save(output, generator)
        size = os.path.getsize(output)
        spec = generator.spec
        held = [
            f"{len(generator.step.variants) or 1} programs",
            "the tokenizer",
            "a chat template" if spec.chat_template else "no chat template",
            "the generation_config's settings" if spec.sampling or spec.lengths else "",
        ]
        progress.line(
            f"wrote {output} ({human_size(size)}: a {type(model).__name__} generator, "
            f"{', '.join(h for h in held if h)}; batch 1..{spec.max_batch}, "
            f"{spec.max_length} positions, {spec.dtype} on {spec.device}) in "
            f"{time.perf_counter() - began:.1f} s"
        )
    return size


def check_family(directory: str, config: dict[str, Any]) -> None:
    """A one-line error unless transformers has a causal LM class of ``config``'s model type."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = str(config.get("model_type"))
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        known = "a model type transformers does not know"
        if model_type in transformers.CONFIG_MAPPING:
            known = f"{transformers.CONFIG_MAPPING[model_type].__name__}, not a decoder LM"
        raise ModelDirectoryError(
            f"{directory}: model_type {model_type!r} ({known}) has no causal LM class in "
            f"transformers {transformers.__version__}: a generator serves a decoder "
            "language model (AutoModelForCausalLM: Llama, Qwen2, Mistral, GPT-2, ...)"
        )


def _load(directory: str, options: BuildOptions) -> tuple[Any, Any]:
    """The causal LM and fast tokenizer of ``directory``, or a one-line error saying why
    not (a slow-only tokenizer, a checkpoint transformers cannot read)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the build's own lines say it
    dtype = getattr(torch, str(options.dtype), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype {options.dtype!r} is not a torch dtype (float32, bfloat16)")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=dtype
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelDirectoryError(f"{directory}: transformers could not load it: {first}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelDirectoryError(
            f"{directory}: its tokenizer ({type(tokenizer).__name__}) has no fast version "
            "(tokenizer.json), which the generator file holds: save one with "
            "AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(...)"
        )
    return model.to(options.device).eval(), tokenizer
