"""Two real clients against ``torch-precompile serve``: EleutherAI's lm-eval and guidellm.

1. build (this process, transformers present; ``--dir`` reuses a built one):
   tests/fixtures/trained_lm.py's Llama (trained here on the GPL's text, with its
   byte-level BPE), a chat template set, ``save_pretrained`` into ``DIR/model``,
   loaded back and built with ``compile_generator`` (``--slots`` slots) into
   ``DIR/trained.pt``;
2. the server in a fresh process (transformers not importable in it), on a free port;
3. lm-eval (``--venv``'s ``lm_eval``; its own venv, so its dependencies leave this
   one's alone), model ``local-completions`` against ``/v1/completions``, the
   tokenizer ``DIR/model``, over the task YAMLs in ``benchmarks/clients/``:
   ``clients_mc`` (multiple choice: ``loglikelihood`` requests, ``echo`` with
   ``logprobs`` 1 and ``max_tokens`` 1, the last token dropped) and
   ``clients_gen`` (``generate_until``: greedy, stop strings), ``--limit``
   documents each, twice (``RUNS``): text one prompt a request, then token ids 4
   prompts a request (one list), 2 requests at once; every loglikelihood and
   generation it got is checked against the eager transformers model's own;
4. guidellm (the same venv): a synthetic chat sweep, concurrency ``--concurrency``
   (1,4), ``--requests`` each, ``--prompt-tokens`` in and ``--output-tokens`` out,
   the processor ``DIR/model``.

Errors are counted by the clients (lm-eval exits non-zero on a request that
failed after its retries; guidellm's errored and incomplete requests) and by the
server (``/metrics``' requests finished at ``error``, tracebacks in its log), and
an answer off eager's is one too. The run fails on any. The JSON result has the
versions, lm-eval's scores and guidellm's figures per concurrency.

Usage (repository root; the venv once, torch's CPU wheel first so that pip keeps
it: ``python3 -m venv /tmp/clients-venv && /tmp/clients-venv/bin/pip install torch
'lm-eval[api]' guidellm``)::

    PYTHONPATH=. python benchmarks/clients.py --dir /tmp/clients-build \
        --out benchmarks/results/clients_2026-12-02_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness import REPO, child_env, write_result

TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)
TASKS = REPO / "benchmarks" / "clients"
_SERVER = """
import sys
sys.modules["transformers"] = None
from torch_precompile.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def build(root: Path, slots: int, max_length: int) -> None:
    """The trained Llama saved with ``save_pretrained``, loaded back, built to a file."""
    sys.path.insert(0, str(REPO))
    import transformers

    from tests.fixtures.trained_lm import train
    from torch_precompile import Precompile
    from torch_precompile.generation import compile_generator

    model, tok = train()
    tok.chat_template = TEMPLATE
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "model").eval()
    tok = transformers.AutoTokenizer.from_pretrained(root / "model")
    generator = compile_generator(model, max_batch=slots, max_length=max_length, tokenizer=tok)
    Precompile.save(root / "trained.pt", generator)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(path: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """The server in a fresh process, once its ``/health`` answers 200."""
    command = [sys.executable, "-c", _SERVER, "serve", str(path), "--port", str(port)]
    command += ["--model-name", "trained"]
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=child_env(), stdout=out, stderr=out)
    for _ in range(6000):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the server did not answer /health in 300 s")


def finished(port: int) -> dict[str, float]:
    """``/metrics``' ``requests_finished_total`` by ``finish_reason``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.findall(r'requests_finished_total\{finish_reason="(\w+)"\} (\S+)', text)
    return {reason: float(count) for reason, count in found}


def client(venv: Path, name: str, *args: str, log: Path) -> None:
    """``venv``'s ``name`` with ``args`` from the repository root, offline; fails loudly."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="0")
    env.pop("PYTHONPATH", None)
    with log.open("w") as out:
        rc = subprocess.run(
            [str(venv / "bin" / name), *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    if rc:
        raise RuntimeError(f"{name} exited {rc}:\n{log.read_text()[-4000:]}")


def version(venv: Path, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


# lm-eval's ways to send: (tokenized_requests, --batch_size, num_concurrent). Text one
# request at a time; token ids, 4 prompts a request (one list), 2 requests at once.
RUNS = {"text": (False, 1, 1), "ids_batch4_concurrent2": (True, 4, 2)}


def lm_eval(args: argparse.Namespace, port: int, work: Path, run: str) -> dict[str, Any]:
    """lm-eval's ``local-completions`` over both tasks, sending as ``RUNS[run]``: its
    scores and its samples."""
    tokenized, batch, concurrent = RUNS[run]
    out = work / run
    model_args = f"model=trained,base_url=http://127.0.0.1:{port}/v1/completions"
    model_args += f",tokenizer={args.dir / 'model'},tokenizer_backend=huggingface"
    model_args += f",tokenized_requests={tokenized},num_concurrent={concurrent},max_retries=1"
    command = ["--model", "local-completions", "--model_args", model_args]
    command += ["--batch_size", str(batch)]
    command += ["--tasks", "clients_mc,clients_gen", "--include_path", str(TASKS)]
    command += ["--limit", str(args.limit), "--output_path", str(out), "--log_samples"]
    client(args.venv, "lm_eval", *command, log=work / f"{run}.log")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {
        task: [
            json.loads(line)
            for line in next(out.rglob(f"samples_{task}_*")).read_text().splitlines()
        ]
        for task in ("clients_mc", "clients_gen")
    }
    scores = {
        task: {k: v for k, v in r.items() if k != "alias"} for task, r in results["results"].items()
    }
    return {"command": ["lm_eval", *command], "scores": scores, "samples": samples}


def eager_check(
    root: Path, samples: dict[str, list[dict[str, Any]]], tokenized: bool
) -> dict[str, Any]:
    """lm-eval's answers against the transformers model's own on the same tokens.

    ``loglikelihood``: lm-eval sends its context's and continuation's tokens (or,
    ``tokenized`` false, their decode, which the server tokenizes again) and sums the
    logprobs past the context's tokens; here the same sum from the eager logits.
    ``generate_until``: eager greedy ``generate`` of the context, cut at the first
    stop string, as lm-eval cuts.
    """
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(root / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "model").eval()
    worst = 0.0
    for sample in samples["clients_mc"]:
        for key, request in sample["arguments"].items():
            context = tok.encode(request["arg_0"], add_special_tokens=False)
            whole = context + tok.encode(request["arg_1"], add_special_tokens=False)
            ids = whole if tokenized else tok.encode(tok.decode(whole), add_special_tokens=False)
            with torch.no_grad():
                logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            mine = sum(float(logprobs[i - 1, ids[i]]) for i in range(len(context), len(ids)))
            theirs = float(sample["resps"][int(key.rsplit("_", 1)[1])][0][0])
            worst = max(worst, abs(mine - theirs))
    same = written = 0
    for sample in samples["clients_gen"]:
        request = sample["arguments"]["gen_args_0"]
        ids = tok(request["arg_0"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        kwargs = request["arg_1"]
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=kwargs["max_gen_toks"],
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        for stop in kwargs["until"]:
            text = text.split(stop)[0]
        same += text == sample["resps"][0][0]
        written += bool(text)
    return {
        "loglikelihood_max_abs_diff": worst,
        "generations_equal": same,
        "generations_not_empty": written,
        "generations": len(samples["clients_gen"]),
    }


def guidellm(args: argparse.Namespace, port: int, work: Path) -> dict[str, Any]:
    """guidellm's synthetic chat sweep: per concurrency, the request counts and figures."""
    out = work / "guidellm.json"
    backend = f"kind=openai_http,target=http://127.0.0.1:{port},model=trained"
    backend += ",request_format=/v1/chat/completions"
    first, *_ = args.concurrency.split(",")
    command = ["run", "--backend", backend, "--profile", f"kind=concurrent,streams={first}"]
    command += ["--override", "profile.streams", args.concurrency]
    command += ["--constraint", f"kind=max_requests,count={args.requests}"]
    command += ["--tokenizer", f"kind=huggingface_auto,model={args.dir / 'model'}"]
    data = (
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    )
    command += ["--data", data, "--output", f"kind=json,path={out}"]
    command += ["--disable-console-interactive"]
    client(args.venv, "guidellm", *command, log=work / "guidellm.log")

    def ok(m: dict[str, Any], name: str, stat: str = "median") -> float:
        return round(m[name]["successful"][stat], 3)

    figures = {}
    for bench in json.loads(out.read_text())["benchmarks"]:
        m = bench["metrics"]
        streams = bench["config"]["strategy"]["streams"]
        figures[f"concurrency_{streams}"] = {
            "requests": m["request_totals"],
            "duration_s": round(bench["duration"], 3),
            "requests_per_s": round(m["request_totals"]["successful"] / bench["duration"], 2),
            "output_tokens_per_s": round(
                m["output_token_count"]["successful"]["total_sum"] / bench["duration"], 1
            ),
            "ttft_ms_p50": ok(m, "time_to_first_token_ms"),
            "itl_ms_p50": ok(m, "inter_token_latency_ms"),
            "latency_s_p50": ok(m, "request_latency"),
            "prompt_tokens_p50": ok(m, "prompt_token_count"),
            "output_tokens_p50": ok(m, "output_token_count"),
        }
    return {"command": ["guidellm", *command], "figures": figures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/clients-build"))
    p.add_argument("--venv", type=Path, default=Path("/tmp/clients-venv"))
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.dir = args.dir.resolve()
    if not (args.dir / "trained.pt").is_file():
        build(args.dir, args.slots, args.max_length)
    with tempfile.TemporaryDirectory(prefix="clients-") as tmp:
        work = Path(tmp)
        port = free_port()
        server = start(args.dir / "trained.pt", port, work / "server.log")
        try:
            lm = {run: lm_eval(args, port, work, run) for run in RUNS}
            load = guidellm(args, port, work)
            ends = finished(port)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(60)
        log = (work / "server.log").read_text()
    check = {run: eager_check(args.dir, lm[run].pop("samples"), RUNS[run][0]) for run in RUNS}
    errors = {
        # lm_eval exits non-zero on a request that failed (max_retries=1): client() raises
        "guidellm_errored": sum(f["requests"]["errored"] for f in load["figures"].values()),
        "guidellm_incomplete": sum(f["requests"]["incomplete"] for f in load["figures"].values()),
        "server_finish_error": int(ends.get("error", 0)),
        "server_tracebacks": log.count("Traceback"),
        "loglikelihoods_off_eager": sum(
            c["loglikelihood_max_abs_diff"] > 1e-3 for c in check.values()
        ),
        "generations_off_eager": sum(
            c["generations"] - c["generations_equal"] for c in check.values()
        ),
    }
    result = {
        "file": str(args.dir / "trained.pt"),
        "versions": {name: version(args.venv, name) for name in ("lm_eval", "guidellm")},
        "lm_eval": lm,
        "eager_check": check,
        "guidellm": load,
        "server_finished": ends,
        "errors": errors,
    }
    write_result(args.out, result)
    scores = {run: lm[run]["scores"] for run in RUNS}
    print(json.dumps({"scores": scores, "eager_check": check, "errors": errors}, indent=1))
    if any(errors.values()):
        raise SystemExit(f"errors: {errors}")


if __name__ == "__main__":
    main()
