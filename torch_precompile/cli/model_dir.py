"""A checkpoint directory to a generator file: ``serve MODEL_DIR``'s cache.

``serve`` given a directory (``save_pretrained``'s, or a Hugging Face cache
snapshot) builds its generator file once into the cache directory
(``~/.cache/torch_precompile``; ``TORCH_PRECOMPILE_CACHE`` moves it) and serves
that file; a later start with the same checkpoint and options finds it. The
file's name holds a digest of what the build depends on: the checkpoint's
bytes, torch's version and the machine (``runtime/machine.py``'s record), the
package's version and the build options. Starts that meet one build take turns
through a lock file beside it: the first builds, the others wait (and say so)
and take the file it wrote. The file is written under a temporary name and
renamed at the end (``file/write.py``), so a build that fails or is killed
leaves no file a later start would take.

Looking a file up reads ``config.json`` and hashes the files; it imports neither
transformers nor the compiler (``cli/generator_build.py`` does, when it builds).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .._errors import ModelDirectoryError

DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_LENGTH = 2048  # or the model's max_position_embeddings where that is smaller
CACHE_ENV = "TORCH_PRECOMPILE_CACHE"
_KEY_VERSION = 1  # bumped when what the key covers changes
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """What a generator build is asked for (``None``: the checkpoint's or the default)."""

    max_batch: int | None = None
    max_length: int | None = None
    dtype: str | None = None
    device: str = "cpu"
    mode: str | None = None

    def resolved(self, config: dict[str, Any]) -> BuildOptions:
        """Every field concrete, from ``config`` (``config.json``) where left out."""
        _check_options(self)
        text = _text_config(config)
        positions = text.get("max_position_embeddings") or text.get("n_positions")
        length = self.max_length or min(DEFAULT_MAX_LENGTH, int(positions or DEFAULT_MAX_LENGTH))
        dtype = self.dtype or text.get("dtype") or text.get("torch_dtype") or "float32"
        return dataclasses.replace(
            self,
            max_batch=self.max_batch or DEFAULT_MAX_BATCH,
            max_length=length,
            dtype=str(dtype).removeprefix("torch."),
        )


def add_build_options(parser: argparse.ArgumentParser, *, device: bool = True) -> None:
    """The generator build's options (``device=False``: the parser has ``--dtype`` and
    ``--device`` already)."""
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help=f"a generator's rows at once, serve's slots (default {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="a generator's positions, prompt and new tokens (default: the model's "
        f"max_position_embeddings, at most {DEFAULT_MAX_LENGTH})",
    )
    if device:
        parser.add_argument(
            "--dtype", default=None, help="the weights' dtype (default: the checkpoint's)"
        )
        parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default cpu)")
    parser.add_argument(
        "--mode", default=None, help="Inductor's mode, as torch.compile's (reduce-overhead, ...)"
    )


def options_from(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(
        max_batch=args.max_batch,
        max_length=args.max_length,
        dtype=args.dtype,
        device=args.device or "cpu",
        mode=args.mode,
    )


def read_model_dir(directory: str) -> dict[str, Any]:
    """``config.json`` of a checkpoint to build a generator of, and a one-line error for a
    directory that is none: no config, no model type, no tokenizer, no weights."""
    path = Path(directory)
    config_path = path / "config.json"
    if not config_path.is_file():
        found = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))[:8]
        raise ModelDirectoryError(
            f"{directory} has no config.json, so it holds no saved model (found: "
            f"{', '.join(found) or 'nothing'}): give the directory save_pretrained wrote, "
            "or a Hugging Face cache snapshot"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirectoryError(f"{config_path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelDirectoryError(
            f"{config_path} names no model_type: it is not a transformers model's config"
        )
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelDirectoryError(
            f"{directory} has no tokenizer (no tokenizer.json or tokenizer_config.json), which "
            "serve needs for text and chat: save it beside the model with "
            f"tokenizer.save_pretrained({directory!r})"
        )
    if not any(_weight_file(p.name) for p in path.iterdir()):
        raise ModelDirectoryError(
            f"{directory} has no weights (no *.safetensors or *.bin): save them with "
            f"model.save_pretrained({directory!r})"
        )
    return config


def _weight_file(name: str) -> bool:
    return name.endswith((".safetensors", ".bin")) and not name.startswith(".")


def checkpoint_digest(directory: str) -> str:
    """SHA-256 over the checkpoint's files (names and bytes; hidden files left out). A file
    of a Hugging Face cache snapshot is a link to a blob named by its content's hash: that
    name stands for its bytes."""
    root = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(str(relative.as_posix()).encode() + b"\0")
        target = Path(os.path.realpath(path))
        if path.is_symlink() and target.parent.name == "blobs":
            digest.update(b"blob:" + target.name.encode())
        else:
            with target.open("rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def cache_root() -> Path:
    """Where built generator files are kept: ``$TORCH_PRECOMPILE_CACHE``, else
    ``$XDG_CACHE_HOME/torch_precompile``, else ``~/.cache/torch_precompile``."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torch_precompile"


def model_name(directory: str) -> str:
    """The model's name for ``serve``: the directory's, or ``org/name`` of a Hugging Face
    cache snapshot (``.../models--org--name/snapshots/<revision>``)."""
    path = Path(os.path.abspath(directory))
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name or "model"


def cache_key(digest: str, options: BuildOptions) -> str:
    """The digest a cached file is named by: the checkpoint, torch, the machine, the
    package and the build options (all resolved)."""
    import torch

    from .. import __version__
    from ..runtime.machine import current_system

    cuda = options.device.startswith("cuda")
    index = int(options.device.split(":")[1]) if cuda and ":" in options.device else 0
    system = current_system(include_cuda=False)
    if cuda and torch.cuda.is_available():
        system["cuda"] = {
            "device_name": torch.cuda.get_device_name(index),
            "capability": torch.cuda.get_device_capability(index),
            "cuda_version": torch.version.cuda,
        }
    record = {
        "key": _KEY_VERSION,
        "checkpoint": digest,
        "system": system,
        "package": __version__,
        "options": dataclasses.asdict(options),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def cached_generator(
    directory: str, options: BuildOptions, stream: TextIO = sys.stderr
) -> tuple[str, bool]:
    """The path of ``directory``'s generator file for ``options`` in the cache, built first
    if no start has built it (or waited for, if another start is building it); and whether
    this call built it."""
    from filelock import FileLock, Timeout

    config = read_model_dir(directory)
    options = options.resolved(config)
    start = time.perf_counter()
    digest = checkpoint_digest(directory)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_name(directory)).strip("-.") or "model"
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}-{cache_key(digest, options)[:24]}.pt"
    if path.is_file():
        _say(
            stream,
            f"{directory}: the generator file {path} (built before; the checkpoint "
            f"hashed in {time.perf_counter() - start:.1f} s)",
        )
        return str(path), False
    lock = FileLock(str(path) + ".build.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(stream, f"another process is building {path}: waiting for it (lock {lock.lock_file})")
        lock.acquire()
    try:
        if path.is_file():
            _say(stream, f"{directory}: the generator file {path} (built by the other process)")
            return str(path), False
        from .generator_build import build_generator, check_family

        check_family(directory, config)  # a directory it cannot build: the error alone
        _say(stream, f"{directory}: no generator file for it in {root}: building {path.name} once")
        build_generator(directory, str(path), options, stream=stream, config=config)
        return str(path), True
    finally:
        lock.release()


def _check_options(options: BuildOptions) -> None:
    if options.max_batch is not None and options.max_batch < 1:
        raise ValueError(f"--max-batch must be 1 or more, got {options.max_batch}")
    if options.max_length is not None and options.max_length < 2:
        raise ValueError(f"--max-length must be 2 or more, got {options.max_length}")


def _say(stream: TextIO, text: str) -> None:
    print(f"torch-precompile: {text}", file=stream, flush=True)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) and "vocab_size" not in config else config


def resolve_serve_path(args: argparse.Namespace) -> None:
    """``serve MODEL_DIR``: ``args.path`` becomes the cached generator file (built if
    needed) and ``args.model_name`` the model's name; ``serve FILE`` is left as it is."""
    if not os.path.isdir(args.path):
        given = [f"--{k.replace('_', '-')}" for k in ("max_batch", "max_length", "dtype", "mode")]
        given = [flag for flag in given if getattr(args, flag[2:].replace("-", "_")) is not None]
        if given or args.device != "cpu":
            raise ValueError(
                f"{' '.join(given or ['--device'])}: build options apply to a model directory; "
                f"{args.path} is a built file (its own limits: torch-precompile inspect)"
            )
        return
    directory = args.path
    args.path, _ = cached_generator(directory, options_from(args))
    if args.model_name is None:
        args.model_name = model_name(directory)
