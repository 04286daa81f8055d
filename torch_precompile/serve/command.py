"""The ``serve`` subcommand: load the file, warm the engine up, listen."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()


def add_serve(sub: Any) -> None:
    """Register ``serve FILE [--host] [--port] [--model-name] [--max-queue]``."""
    p = sub.add_parser(
        "serve",
        help="serve a generator file over HTTP as OpenAI's API (continuous batching)",
    )
    p.add_argument("path", help="a file saved from compile_generator")
    p.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)"
    )
    p.add_argument("--port", type=int, default=8000, help="the port (default 8000)")
    p.add_argument("--model-name", default=None, help="the model's name (default: the file's stem)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for a slot; past it, 503 (default 64)",
    )


def serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; a file the server cannot batch is refused (exit status 1)."""
    from ..runtime.generator import Generator
    from ..serialization.load import load
    from .engine import Engine

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {args.max_queue}")
    began = time.perf_counter()
    generator = load(args.path)
    loaded = time.perf_counter()
    if not isinstance(generator, Generator):
        raise ValueError(
            f"{args.path} is not a generator: build one with "
            "torch_precompile.generation.compile_generator"
        )
    tokenizer = generator.tokenizer() if generator.tokenizer_json is not None else None
    engine = Engine(generator, max_queue=args.max_queue, tokenizer=tokenizer)
    engine.start()
    warm = time.perf_counter()
    name = args.model_name or Path(args.path).stem
    app = _app(engine, name, tokenizer)
    import uvicorn

    stack = time.perf_counter()

    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2
    )
    logging.getLogger("torch_precompile").info("serve: ready")
    print(
        f"serving {name} ({generator!r}) at http://{args.host}:{args.port}/v1, "
        f"ready {time.perf_counter() - _T0:.2f} s after import (load {loaded - began:.2f} s, "
        f"warm-up {warm - loaded:.2f} s, HTTP stack {stack - warm:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn shut down, then raises the Ctrl-C it caught
        pass
    finally:
        engine.stop()
    return 0


def _app(engine: Any, name: str, tokenizer: Any) -> Any:
    from .app import build_app
    from .chat import chat_renderer
    from .protocol import ApiError

    spec = engine.spec

    def no_text(_: Any) -> list[int]:
        raise ApiError(
            400, "this model's file holds no tokenizer: send the prompt as token ids", "prompt"
        )

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    render = no_text
    if spec.chat_template is None:

        def render(_: Any) -> list[int]:
            raise ApiError(
                400,
                "this model's file holds no chat template (its tokenizer had none at build): "
                "use /v1/completions",
                "messages",
            )

    elif tokenizer is not None:
        chat = chat_renderer(spec.chat_template, dict(spec.chat_tokens))

        def render(messages: list[dict[str, Any]]) -> list[int]:
            return tokenizer.encode(chat(messages), add_special_tokens=False).ids

    return build_app(engine, name=name, encode=encode if tokenizer else no_text, render=render)
