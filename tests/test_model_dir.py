"""``torch-precompile serve MODEL_DIR`` and ``build --generator``: a checkpoint directory
served in one command, its generator file built once into the cache.

One tiny Qwen2 (2 layers, width 64) is saved with ``save_pretrained`` beside the
320-token BPE of test_generator and a chat template. Two servers start on it at
once in fresh processes (one builds, the other waits for that build); a third
start, where transformers cannot be imported and at another thread count, finds
the file. Answers are compared with transformers' greedy ``generate`` on the
same chat prompt, through the ``openai`` SDK. A changed weight is a new build,
which is killed midway and leaves no file; bad directories are refused in one
line; ``build --generator`` writes the file explicitly, built at 2 threads and
served greedy-equal at 1.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("filelock")

from conftest import ROOT  # noqa: E402
from test_generator import SMALL, _tokenizer  # noqa: E402
from test_serve import _SERVER, TEMPLATE, Server  # noqa: E402

from torch_precompile import Precompile  # noqa: E402
from torch_precompile.cli.model_dir import (  # noqa: E402
    BuildOptions,
    cache_key,
    checkpoint_digest,
)

# One row: a build of two programs (these tests are of the command and its cache, not
# of batching, which test_generator and test_serve cover).
MAX_BATCH, MAX_LENGTH = 1, 64
PROGRAMS = 2  # the prefill and the slot step (generate's decode step too), at batch 1
BUILD = ["--max-batch", str(MAX_BATCH), "--max-length", str(MAX_LENGTH)]
QUESTION = [{"role": "user", "content": "the cat sat on"}]


class Start(Server):
    """``serve`` in a fresh process (``Server``'s requests and stop), given the time a build
    takes and its own environment: the cache directory, the thread count."""

    def __init__(
        self, path: Path, *args: str, env: dict[str, str], lean: bool = False, wait: bool = True
    ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        head = ["-c", _SERVER] if lean else ["-m", "torch_precompile"]
        command = [sys.executable, *head, "serve", str(path), "--port", str(self.port), *args]
        self.log = path.parent / f"{path.name}-{self.port}.log"
        self.began = time.monotonic()
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                command, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stderr=log
            )
        if wait:
            self.wait_ready(900)

    def wait_ready(self, seconds: float) -> float:
        """Seconds from the process's start to its first healthy answer."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if self.request("GET", "/health")[0] == 200:
                    self.ready_s = time.monotonic() - self.began
                    return self.ready_s
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"no /health within {seconds} s:\n{self.log.read_text()}")


def _save_checkpoint(directory: Path) -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(num_key_value_heads=2, **{**SMALL, "vocab_size": 320})
    model = transformers.Qwen2ForCausalLM(config).eval()
    tokenizer = _tokenizer()
    tokenizer.chat_template = TEMPLATE
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("model_dir")
    directory = root / "tiny-qwen2"
    model, tokenizer = _save_checkpoint(directory)
    return {"dir": directory, "model": model, "tokenizer": tokenizer, "root": root}


def _greedy_reply(case: dict[str, Any], new: int) -> str:
    """transformers' greedy ``generate`` (eager) on the chat prompt, decoded as serve does."""
    tokenizer, model = case["tokenizer"], case["model"]
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
        )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def _chat(server: Server, new: int = 8) -> str:
    reply = server.client().chat.completions.create(
        model="tiny-qwen2", messages=QUESTION, max_tokens=new, temperature=0
    )
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def served(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Two starts at once on the directory (one builds, the other waits), both asked."""
    cache = checkpoint["root"] / "cache"
    env = {"TORCH_PRECOMPILE_CACHE": str(cache), "OMP_NUM_THREADS": "2"}
    first = Start(checkpoint["dir"], *BUILD, env=env, wait=False)
    second = Start(checkpoint["dir"], *BUILD, env=env, wait=False)
    try:
        ready = [first.wait_ready(900), second.wait_ready(900)]
        replies = [_chat(first), _chat(second)]
    finally:
        logs = [first.stop(), second.stop()]
    return {"cache": cache, "env": env, "ready": ready, "replies": replies, "logs": logs}


def test_serve_model_dir_builds_once_for_two_starts_and_answers_as_transformers(
    checkpoint: dict[str, Any], served: dict[str, Any]
) -> None:
    want = _greedy_reply(checkpoint, 8)
    assert served["replies"] == [want, want]
    builders = [log for log in served["logs"] if "building tiny-qwen2-" in log]
    waiters = [log for log in served["logs"] if "another process is building" in log]
    assert len(builders) == 1 and len(waiters) == 1, served["logs"]
    assert "built by the other process" in waiters[0]
    # The build's progress: each program, n of m, the time; the end: size, contents, time.
    for n in range(1, PROGRAMS + 1):
        found = rf"compiling [a-z ,.0-9]+ \({n} of {PROGRAMS}\), \d+ s elapsed"
        assert re.search(found, builders[0])
    end = re.search(
        r"wrote .*tiny-qwen2-\w+\.pt \(([\d.]+ [KM]iB): a Qwen2ForCausalLM", builders[0]
    )
    assert end and f"{PROGRAMS} programs, the tokenizer, a chat template" in builders[0], builders[
        0
    ]
    files = [p for p in served["cache"].iterdir() if p.suffix == ".pt"]
    assert len(files) == 1 and not [p for p in served["cache"].iterdir() if ".tmp-" in p.name]


def test_a_second_start_finds_the_file_without_transformers_at_another_thread_count(
    checkpoint: dict[str, Any], served: dict[str, Any]
) -> None:
    env = {**served["env"], "OMP_NUM_THREADS": "2"}
    again = Start(checkpoint["dir"], *BUILD, "--threads", "1", env=env, lean=True)
    try:
        reply = _chat(again)
        models = again.request("GET", "/v1/models")[1]
    finally:
        log = again.stop()
    assert "built before" in log and "building" not in log, log
    assert "IMPORTED []" in log, log  # no transformers, no Dynamo, no Inductor
    assert reply == served["replies"][0]  # built at 2 threads, served at 1
    assert [m["id"] for m in models["data"]] == ["tiny-qwen2"], models  # the directory's name
    build_s = max(served["ready"])
    assert again.ready_s < build_s / 4, (again.ready_s, build_s)


def test_a_changed_weight_builds_a_new_file_and_a_killed_build_leaves_none(
    checkpoint: dict[str, Any], served: dict[str, Any]
) -> None:
    from safetensors.torch import load_file, save_file

    changed = checkpoint["root"] / "changed"
    shutil.copytree(checkpoint["dir"], changed)
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    weights[name][0, 0] += 1.0
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    options = BuildOptions(MAX_BATCH, MAX_LENGTH, "float32", "cpu", None)
    keys = {cache_key(checkpoint_digest(str(d)), options) for d in (checkpoint["dir"], changed)}
    assert len(keys) == 2
    before = set(served["cache"].iterdir())
    start = Start(changed, *BUILD, env=served["env"], wait=False)
    deadline = time.monotonic() + 600
    while f"(1 of {PROGRAMS})" not in start.log.read_text():  # killed in its first compile
        assert start.proc.poll() is None and time.monotonic() < deadline, start.log.read_text()
        time.sleep(0.5)
    assert "no generator file for it" in start.log.read_text()  # not the first one's file
    start.proc.send_signal(signal.SIGKILL)
    start.proc.wait()
    new = {p.name for p in set(served["cache"].iterdir()) - before}
    assert new and all(n.startswith("changed-") and n.endswith(".pt.build.lock") for n in new), new


def _refused(path: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "serve", str(path), *BUILD],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("torch-precompile: error: "), proc.stderr
    return lines[0]


def test_a_bad_directory_is_one_line_naming_what_is_missing(
    checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    env = {"TORCH_PRECOMPILE_CACHE": str(tmp_path / "cache")}
    empty = tmp_path / "empty"
    checkpoint["tokenizer"].save_pretrained(empty)
    assert "has no config.json" in _refused(empty, env)

    untokenized = tmp_path / "untokenized"
    checkpoint["model"].save_pretrained(untokenized)
    line = _refused(untokenized, env)
    assert "has no tokenizer" in line and "tokenizer.save_pretrained" in line, line

    t5 = tmp_path / "t5"  # an encoder-decoder: transformers has no causal LM of it
    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    transformers.T5Model(config).save_pretrained(t5)
    checkpoint["tokenizer"].save_pretrained(t5)
    line = _refused(t5, env)
    assert "model_type 't5' (T5Config" in line and "no causal LM class" in line, line
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.pt"))


def test_build_generator_writes_the_file_which_serves_greedy_equal_at_any_thread_count(
    checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "llm.pt"
    build = ["build", "--generator", str(checkpoint["dir"]), "-o", str(out), *BUILD]
    proc = subprocess.run(
        [sys.executable, "-m", "torch_precompile", *build],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"({PROGRAMS} of {PROGRAMS})" in proc.stderr and f"wrote {out} (" in proc.stderr, (
        proc.stderr
    )
    model = checkpoint["model"]
    prompts = [torch.tensor([[5, 17, 33, 4, 9, 100]]), torch.tensor([[7, 7, 8, 60, 2, 11]])]
    with torch.no_grad():
        wants = [
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )
            for ids in prompts
        ]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            generator = Precompile.load(out)
            for ids, want in zip(prompts, wants):
                got = generator.generate(ids, max_new_tokens=12, do_sample=False)
                assert torch.equal(got, want), (n, got, want)
    finally:
        torch.set_num_threads(threads)
    line = _refused(out, {})  # a built file has its limits: the build's options are refused
    assert "--max-batch --max-length: build options apply to a model directory" in line, line


def test_the_help_answers_without_importing_torch() -> None:
    probe = (
        "import sys\n"
        "from torch_precompile_cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print('IMPORTED', sorted(m for m in ('torch', 'torch_precompile') if m in sys.modules))\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["--help"], ["serve", "--help"], ["build", "-h"]):
        proc = subprocess.run(
            [sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        assert "IMPORTED []" in proc.stdout, proc.stdout
    serve_help = subprocess.run(
        [sys.executable, "-c", probe, "serve", "--help"], env=env, capture_output=True, text=True
    ).stdout
    assert "--threads" in serve_help and "--max-batch" in serve_help, serve_help
    bare = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert bare.returncode == 2 and "required: command" in bare.stderr, bare.stderr


def test_progress_is_one_updating_line_on_a_terminal_and_plain_lines_in_a_log() -> None:
    import io
    import logging

    from torch_precompile.cli.progress import build_progress
    from torch_precompile.generation.build_progress import BuildProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log = logging.getLogger("torch_precompile")
    shown = {}
    for stream in (Terminal(), io.StringIO()):
        began = time.perf_counter() - 3
        with build_progress(stream) as progress:
            progress.line("loading tiny")
            for n, name in enumerate(["prefill, batch 1", "decode, batch 1"], 1):
                step = BuildProgress(name, n, 2, began)
                log.info("generator: compiling %s", step, extra={"progress": step})
                log.info("inductor: compiling forward")  # a stage's record: not shown
            log.info("generator: 2 programs compiled in 3.0 s", extra={"progress": None})
        shown[type(stream).__name__] = stream.getvalue()
    tty, plain = shown["Terminal"], shown["StringIO"]
    assert "\r\x1b[Ktorch-precompile: compiling decode, batch 1 (2 of 2), 3 s elapsed" in tty
    assert tty.endswith("\ntorch-precompile: generator: 2 programs compiled in 3.0 s\n"), tty
    assert "\r" not in plain and "inductor" not in plain + tty
    assert plain.splitlines() == [
        "torch-precompile: loading tiny",
        "torch-precompile: generator: compiling prefill, batch 1 (1 of 2), 3 s elapsed",
        "torch-precompile: generator: compiling decode, batch 1 (2 of 2), 3 s elapsed",
        "torch-precompile: generator: 2 programs compiled in 3.0 s",
    ]
