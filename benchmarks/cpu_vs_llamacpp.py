"""Our fp32/int8/int4 generator files beside llama.cpp's f32/q8_0/q4_0 files of the same
weights, on this CPU, fresh processes, alternating.

The model is :mod:`benchmarks.quantized`'s (a Llama of the SmolLM2-135M shape, random
weights from seed 0, fp32). Our three files are built as that benchmark builds them;
the same model is saved with ``save_pretrained`` (with the tests' small byte-level
BPE as its tokenizer, the vocabulary padded to 49152 by the converter) and converted
with llama.cpp's ``convert_hf_to_gguf.py`` (the pre-tokenizer named "default": the
tokenizer is not what is measured), then quantized with ``llama-quantize``.

Each round runs every file once, each in a fresh process, in turn:

- ours (:mod:`benchmarks.quantized`'s child): ``first_token_s`` from the spawn to a
  one-token ``generate`` of a 16-token prompt; ``decode_tok_s`` at batch 1 and 8; at
  batch 1 also ``first_token_cli_s``, the wall time of ``torch-precompile generate``
  generating one token of a 16-token prompt (its import, load, prompt and exit);
- llama.cpp: ``first_token_s``, the wall time of ``llama-completion`` generating one
  token of a 16-token prompt (its load, prompt and exit); ``decode_tok_s``,
  ``llama-bench -p 0 -n N -t 2``'s text-generation figure.

The DRAM's read bandwidth is measured in the same run (a 1 GiB float32 sum, two
threads, best of 5), and the load average is printed before and after.

Our files are built at ``max_batch`` the largest of ``--batches`` (files of that
name already in ``--workdir`` are used as they are: ``benchmarks/quantized.py``
names its files the same). Usage (repository root; llama.cpp built in /tmp/llamacpp/build from the
llama-cpp-python sdist's vendor/llama.cpp, its sources at /tmp/llamacpp/src)::

    PYTHONPATH=. python benchmarks/cpu_vs_llamacpp.py --workdir /tmp/cpu-vs --rounds 3
    PYTHONPATH=. python benchmarks/cpu_vs_llamacpp.py --layers 4 --rounds 1  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # the machine's description
import quantized  # the same shape, build and run children

ROOT = quantized.ROOT
OURS = quantized.FORMATS  # fp32, int8, int4
THEIRS = ("f32", "q8_0", "q4_0")

_SAVE = """
import json, sys, torch, transformers
sys.path.insert(0, sys.argv[3])
from tests.fixtures.trained_lm import tokenizer, training_text
shape, out = json.loads(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)  # as benchmarks/quantized.py's build: the same weights
transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(out)
tokenizer(training_text()).save_pretrained(out)
"""

_CONVERT = """
import sys
src = sys.argv.pop(1)
sys.path.insert(0, src + "/gguf-py"); sys.path.insert(0, src)
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
def no_file(self):  # the save_pretrained directory holds a byte-level BPE only
    raise FileNotFoundError
base.TextModel._set_vocab_sentencepiece = base.TextModel._set_vocab_llama_hf = no_file
sys.argv[0] = src + "/convert_hf_to_gguf.py"
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_BANDWIDTH = """
import json, time, torch
torch.set_num_threads(2)
x = torch.ones(2**28)
best = min((lambda t: (x.sum(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
print(json.dumps({"dram_read_gb_s": x.nbytes / best / 1e9}))
"""


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode:
        raise RuntimeError(f"{cmd[:3]} failed:\n{proc.stderr[-3000:]}")
    return proc


def _prepare(args: argparse.Namespace, shape: dict, work: Path) -> dict[str, Path]:
    """Our three files and llama.cpp's three, built where missing."""
    files: dict[str, Path] = {}
    for name in OURS:
        path = files[name] = work / f"{name}-{args.layers}.pt"
        if not path.exists():
            spec = [shape, name, str(path), max(args.batch_sizes), args.max_length]
            built = quantized._child(quantized._BUILD, json.dumps(spec))
            print(f"{name}: built in {built['build_s']:.0f} s", file=sys.stderr)
    hf = work / f"hf-{args.layers}"
    if not (hf / "config.json").exists():
        _run([sys.executable, "-c", _SAVE, json.dumps(shape), str(hf), str(ROOT)])
    f32 = files["f32"] = work / f"f32-{args.layers}.gguf"
    if not f32.exists():
        convert = [sys.executable, "-c", _CONVERT, args.llama_src, str(hf)]
        _run([*convert, "--outtype", "f32", "--outfile", str(f32)])
    for kind in THEIRS[1:]:
        path = files[kind] = work / f"{kind}-{args.layers}.gguf"
        if not path.exists():
            _run([f"{args.llama_build}/bin/llama-quantize", str(f32), str(path), kind])
    return files


def _ours(path: Path, batch: int, new: int) -> dict:
    ran = quantized._child(quantized._RUN, repr(time.time()), str(path), str(batch), str(new))
    assert ran["imported"] == [], ran["imported"]
    got = {"first_token_s": ran["first_token_s"], "decode_tok_s": ran["decode_tok_s"]}
    if batch == 1:  # as llama-completion's: the command's wall time for one token
        script = Path(sys.executable).with_name("torch-precompile")
        ids = ",".join(str(i) for i in range(3, 19))  # 16 tokens
        start = time.time()
        _run([str(script), "generate", str(path), "--ids", ids, "--max-new-tokens", "1",
              "--greedy"], stdin=subprocess.DEVNULL)  # fmt: skip
        got["first_token_cli_s"] = time.time() - start
    return got


def _theirs(path: Path, bin_dir: str, new: int) -> dict:
    prompt = " ".join(["the"] * 16)
    start = time.time()
    _run([f"{bin_dir}/llama-completion", "-m", str(path), "-p", prompt, "-n", "1", "-t", "2",
          "-no-cnv", "--no-warmup", "--temp", "0"], stdin=subprocess.DEVNULL)  # fmt: skip
    first = time.time() - start
    bench = _run([f"{bin_dir}/llama-bench", "-m", str(path), "-p", "0", "-n", str(new),
                  "-t", "2", "-r", "3", "-o", "json"])  # fmt: skip
    tg = json.loads(bench.stdout)[0]
    return {"first_token_s": first, "decode_tok_s": tg["avg_ts"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/cpu-vs-llamacpp")
    parser.add_argument("--layers", type=int, default=quantized.SHAPE["num_hidden_layers"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--llama-src", default="/tmp/llamacpp/src")
    parser.add_argument("--llama-build", default="/tmp/llamacpp/build")
    parser.add_argument("--batches", default="1,8", help="our files' batch sizes")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    shape = {**quantized.SHAPE, "num_hidden_layers": args.layers}
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    files = _prepare(args, shape, work)
    bin_dir = f"{args.llama_build}/bin"
    results: dict = {"machine": harness.machine(), "shape": shape, "runs": {}}
    results["load_avg_before"] = os.getloadavg()
    bw = _run([sys.executable, "-c", _BANDWIDTH])
    results |= json.loads(bw.stdout)
    cases = [(n, b) for n in OURS for b in args.batch_sizes] + [(n, 1) for n in THEIRS]
    for r in range(args.rounds):
        for name, batch in cases:
            if name in OURS:
                got = _ours(files[name], batch, args.new_tokens)
            else:
                got = _theirs(files[name], bin_dir, args.new_tokens)
            results["runs"].setdefault(f"{name} b{batch}", []).append(got)
            print(f"round {r}: {name} b{batch} {got}", file=sys.stderr)
    results["file_mb"] = {name: p.stat().st_size / 2**20 for name, p in files.items()}
    results["load_avg_after"] = os.getloadavg()
    print(_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


def _table(results: dict) -> str:
    """Medians over the rounds: MB, first token, decode tokens/s (share of the DRAM bound)."""
    bound = results["dram_read_gb_s"] * 1e9
    lines = [
        f"DRAM read {results['dram_read_gb_s']:.1f} GB/s; load average "
        f"{results['load_avg_before'][0]:.1f} before, {results['load_avg_after'][0]:.1f} after",
        "| file | MB | first token s (command's) | decode tok/s b1 (DRAM bound share) "
        "| decode tok/s b8 |",
        "|---|---|---|---|---|",
    ]
    for name in (*OURS, *THEIRS):
        mb = results["file_mb"][name]
        row = results["runs"][f"{name} b1"]
        first = statistics.median(r["first_token_s"] for r in row)
        cli = [r["first_token_cli_s"] for r in row if "first_token_cli_s" in r]
        firsts = f"{first:.2f} ({statistics.median(cli):.2f})" if cli else f"{first:.2f}"
        tps = statistics.median(r["decode_tok_s"] for r in row)
        b8 = results["runs"].get(f"{name} b8")
        b8s = f"{statistics.median(r['decode_tok_s'] for r in b8):.1f}" if b8 else "-"
        share = tps * mb * 2**20 / bound
        lines.append(f"| {name} | {mb:.0f} | {firsts} | {tps:.1f} ({share:.0%}) | {b8s} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
