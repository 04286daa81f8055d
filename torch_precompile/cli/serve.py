"""The ``serve`` subcommand: load the file, warm the engine up, listen."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

_T0 = time.perf_counter()


def add_serve(sub: Any) -> None:
    """Register ``serve FILE`` and its options (``--port``, ``--max-queue``, ...)."""
    p = sub.add_parser(
        "serve",
        help="serve a generator file over HTTP as OpenAI's API (continuous batching)",
    )
    p.add_argument(
        "path",
        help="a generator file (compile_generator's, build --generator's), or a model directory "
        "(save_pretrained's, a Hugging Face cache snapshot): its file is built once into "
        "~/.cache/torch_precompile (TORCH_PRECOMPILE_CACHE) and found there by later starts",
    )
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
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="the largest request body; past it, 413 (default 4 MiB: room for a "
        "128k-token prompt in any spelling)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TORCH_PRECOMPILE_API_KEY"),
        help="a key every request but /health must send as 'Authorization: Bearer KEY' "
        "(default: $TORCH_PRECOMPILE_API_KEY; none: open)",
    )
    from ..serve.tool_parsers import PARSERS

    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="the format the model writes tool calls in, read for tool_choice auto "
        "(default: the one its chat template names, if any)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=25.0,
        help="on SIGTERM, seconds the requests in flight may take to finish before the "
        "server stops (default 25: inside Kubernetes' 30 s grace period)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="prompt tokens prefilled between two decode steps, so a long prompt joining "
        "delays the running streams' next tokens by one chunk's time (0: a prompt at once; "
        "default 512)",
    )
    p.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="prefill every prompt whole, even where a free slot's cache holds its beginning "
        "(default: reused, as usage.prompt_tokens_details.cached_tokens says)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of the kernels (torch.set_num_threads; default: torch's, "
        "OMP_NUM_THREADS or the cores)",
    )


def serve(args: argparse.Namespace) -> int:
    """Serve until interrupted (SIGINT: at once; SIGTERM: after a drain); a file the
    server cannot batch is refused (exit status 1)."""
    from .. import Generator, Precompile
    from ..serve.engine import Engine

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if args.max_request_bytes is None:
        from ..serve.app import MAX_REQUEST_BYTES

        args.max_request_bytes = MAX_REQUEST_BYTES
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be 0 or more, got {args.drain_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be 1 or more, got {args.max_request_bytes}")
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be 1 or more, got {threads}")
        import torch

        torch.set_num_threads(threads)  # before the load: its copies and warm-up use them
    began = time.perf_counter()
    generator = Precompile.load(args.path)
    loaded = time.perf_counter()
    if not isinstance(generator, Generator):
        raise ValueError(
            f"{args.path} is not a generator: build one with "
            "torch_precompile.generation.compile_generator"
        )
    tokenizer = generator.tokenizer() if generator.tokenizer_json is not None else None
    if args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be 0 or more, got {args.prefill_chunk}")
    engine = Engine(
        generator,
        max_queue=args.max_queue,
        tokenizer=tokenizer,
        prefill_chunk=args.prefill_chunk,
        reuse=not args.no_prefix_reuse,
    )
    engine.warm()
    warm = time.perf_counter()
    name = args.model_name or Path(args.path).stem
    app = _app(engine, name, tokenizer, args)
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
    if engine.defaults:  # as vLLM says it
        print(
            f"the model's sampling settings, for requests that leave them out: {engine.defaults}",
            file=sys.stderr,
            flush=True,
        )
    server = uvicorn.Server(config)

    def interrupted(signum: int, frame: Any) -> None:
        server.force_exit = server.should_exit  # a second Ctrl-C: do not wait for streams
        server.should_exit = True
        engine.stop()

    def terminated(signum: int, frame: Any) -> None:
        if app.draining:  # a second SIGTERM: stop now
            interrupted(signum, frame)
            return
        app.draining = True
        drain = threading.Thread(
            target=_drain,
            args=(app, args.drain_timeout, lambda: interrupted(signum, None)),
            name="torch-precompile-drain",
            daemon=True,
        )
        drain.start()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, terminated)
    http = threading.Thread(target=_listen, args=(server, engine), name="torch-precompile-http")
    http.start()
    try:
        engine.run()  # this thread steps (Engine.run says why) until a signal or HTTP's end
    finally:  # the engine's end (an error included) ends HTTP too: never a server without it
        server.should_exit = True
        http.join()
    if not server.started:
        print(f"serve: could not listen on {args.host}:{args.port} (above)", file=sys.stderr)
        return 1
    return 0


def _drain(app: Any, timeout: float, stop: Any) -> None:
    """SIGTERM: new requests are 503s (``app.draining``); the ones in flight get up to
    ``timeout`` seconds to finish, then the server stops."""
    log = logging.getLogger("torch_precompile")
    log.warning("serve: draining (SIGTERM): %d requests in flight", app.inflight)
    deadline = time.monotonic() + timeout
    while app.inflight and time.monotonic() < deadline:
        time.sleep(0.02)
    if app.inflight:
        log.warning("serve: --drain-timeout %s s passed, %d still open", timeout, app.inflight)
    stop()


def _listen(server: Any, engine: Any) -> None:
    """HTTP on this thread; its end (a signal, or a port it cannot bind) ends the engine."""
    try:
        server.run()
    finally:
        engine.stop()


def _app(engine: Any, name: str, tokenizer: Any, args: argparse.Namespace) -> Any:
    from ..serve.app import build_app
    from ..serve.structured import Grammars
    from ..serve.tool_parsers import parser_for

    own = tokenizer.to_str() if tokenizer is not None else None
    parser = getattr(args, "tool_call_parser", None) or parser_for(engine.spec.chat_template)
    return build_app(
        engine,
        name=name,
        tokens=engine.tokens,
        max_request_bytes=args.max_request_bytes,
        api_key=args.api_key,
        grammars=Grammars(own, engine.spec.eos_token_id),
        tool_parser=parser,
    )
