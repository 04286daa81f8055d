"""Survey: which Hugging Face ``transformers`` architectures go through the staged flow.

Each model is built from a tiny random-init config (nothing is downloaded), in
eval mode, float32, under ``torch.no_grad()``, and goes through
``Precompile.compile``, an in-process comparison with eager, ``Precompile.save``
and ``Precompile.load`` in one fresh interpreter that imports ``transformers``
but constructs none of its modules (``nn.Module.__init__`` raises there for any
class whose module starts with ``transformers``, except in a library module's
top-level code run by an import) and, by default, has no C++
compiler. Every output tensor (a ``DynamicCache``'s included) is compared with
eager at ``rtol=atol=1e-4``.

Usage (repository root)::

    python benchmarks/survey_transformers.py [--models mistral,bart] [--extra] [--out DIR] [--json]

``--extra`` adds variants (sliding windows, ALiBi, left padding) and more
architectures (Mixtral, BLOOM, GPT-J, Mamba, DeBERTa-v2, ...).

Prints one line per model: capture / in-process / save / fresh-load status and
the largest difference, or the failing step's error type and first line. A
``CaptureError`` is a graph break in the library (the construct is named); a
failure after a successful capture is ours. Exits 1 if any model fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


from tests.fixtures.hf_models import (  # noqa: E402
    assert_same_output,
    extra_models,
    survey_models,
)


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# Runs in a fresh interpreter: argv = cases JSON (name -> {path, ref}), this file's path.
_FRESH = r"""
import importlib.util, json, sys, traceback
import torch
import transformers  # the saved code refers to it; no model of it is built here
from torch_precompile import Precompile

cases, survey = json.loads(sys.argv[1]), sys.argv[2]
spec = importlib.util.spec_from_file_location("survey", survey)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
original_init = torch.nn.Module.__init__

def importing_library():
    # A library module's top-level code (transformers.activations builds a few
    # activation modules at import) is importing, not building a model.
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and str(
            frame.f_globals.get("__name__", "")
        ).startswith("transformers"):
            return True
        frame = frame.f_back
    return False

def guarded_init(self, *args, **kwargs):
    if type(self).__module__.startswith("transformers") and not importing_library():
        raise AssertionError(f"{type(self).__qualname__} was constructed at load")
    original_init(self, *args, **kwargs)

torch.nn.Module.__init__ = guarded_init
results = {}
for name, case in cases.items():
    step = "load"
    try:
        art = Precompile.load(case["path"])
        step = "call"
        args, kwargs, want = torch.load(case["ref"], weights_only=False)
        with torch.no_grad():
            got = art(*args, **kwargs)
        step = "compare"
        results[name] = {"ok": True, "max_diff": mod.assert_same_output(got, want)}
    except Exception as exc:
        results[name] = {"ok": False, "step": step, "error": mod._error(exc),
                         "traceback": traceback.format_exc()[-4000:]}
print("@@RESULTS@@" + json.dumps(results))
"""


def _no_compiler_env(root: str) -> dict[str, str]:
    from harness import child_env  # here: the fresh child imports this file without it

    bin_dir = os.path.join(root, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    os.symlink(sys.executable, os.path.join(bin_dir, "python"))
    return child_env(os.path.join(root, "caches"), PATH=bin_dir, CC="/bin/false", CXX="/bin/false")


def survey(
    names: list[str], out_dir: str, compiler: bool, fresh_only: bool = False
) -> dict[str, dict]:
    from torch_precompile import CaptureError, Precompile

    logging.getLogger("transformers").setLevel(logging.ERROR)
    models = {**survey_models(), **extra_models()}
    rows: dict[str, dict] = {}
    cases: dict[str, dict[str, str]] = {}
    for name in names:
        build, args, kwargs = models[name]
        row = rows[name] = {"capture": "-", "in_process": "-", "save": "-", "fresh": "-"}
        path, ref = os.path.join(out_dir, f"{name}.pt2"), os.path.join(out_dir, f"{name}.ref")
        if fresh_only:
            if os.path.exists(path) and os.path.exists(ref):
                cases[name] = {"path": path, "ref": ref}
            else:
                row["error"] = f"no saved artifact in {out_dir}"
            continue
        step = "build"
        try:
            torch.manual_seed(0)
            model = build().eval()
            with torch.no_grad():
                want = model(*args, **kwargs)
                step = "capture"
                t0 = time.perf_counter()
                try:
                    artifact = Precompile.compile(model, args, kwargs)
                except CaptureError:
                    row["capture"] = "graph break"
                    raise
                row["capture"] = f"ok {time.perf_counter() - t0:.0f}s"
                step = "in_process"
                row["in_process_diff"] = assert_same_output(artifact(*args, **kwargs), want)
                row["in_process"] = "ok"
            step = "save"
            Precompile.save(path, artifact)
            row["save"] = "ok"
            torch.save((args, kwargs, want), ref)
            cases[name] = {"path": path, "ref": ref}
        except Exception as exc:
            if row[step if step != "build" else "capture"] == "-":
                row[step if step != "build" else "capture"] = "FAIL"
            row["error"] = f"{step}: {_error(exc)}"
            row["traceback"] = traceback.format_exc()[-4000:]
        print(f"  {name}: {row.get('error', 'built')}", file=sys.stderr, flush=True)
    if cases:
        env = _no_compiler_env(tempfile.mkdtemp(dir=out_dir)) if not compiler else None
        if env is None:
            from harness import child_env

            env = child_env()
        proc = subprocess.run(
            [sys.executable, "-c", _FRESH, json.dumps(cases), os.path.abspath(__file__)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULTS@@")]
        if not marker:
            for name in cases:
                rows[name]["fresh"] = "FAIL"
                rows[name]["error"] = f"fresh process died ({proc.returncode})"
                rows[name]["traceback"] = proc.stderr[-4000:]
        else:
            for name, res in json.loads(marker[0][len("@@RESULTS@@") :]).items():
                row = rows[name]
                if res["ok"]:
                    row["fresh"] = "ok"
                    row["fresh_diff"] = res["max_diff"]
                else:
                    row["fresh"] = "FAIL"
                    row["error"] = f"fresh {res['step']}: {res['error']}"
                    row["traceback"] = res["traceback"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--out", default="", help="keep artifacts in DIR (default: temporary)")
    parser.add_argument("--with-compiler", action="store_true", help="leave CC/PATH as they are")
    parser.add_argument("--extra", action="store_true", help="add the variants and extra models")
    parser.add_argument(
        "--fresh-only", action="store_true", help="only load what --out DIR already holds"
    )
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print failing tracebacks")
    opts = parser.parse_args()
    known = list(survey_models()) + list(extra_models())
    names = [n for n in opts.models.split(",") if n] or list(survey_models())
    if opts.extra:
        names += [n for n in extra_models() if n not in names]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(known)}")
    if opts.fresh_only and not opts.out:
        parser.error("--fresh-only needs --out DIR")
    out_dir = opts.out or tempfile.mkdtemp(prefix="survey-")
    os.makedirs(out_dir, exist_ok=True)
    try:
        rows = survey(names, out_dir, opts.with_compiler, opts.fresh_only)
    finally:
        if not opts.out:
            shutil.rmtree(out_dir, ignore_errors=True)
    print(f"{'model':<18} {'capture':<12} {'in-proc':<8} {'save':<5} {'fresh':<6} max diff / error")
    failed = 0
    for name, row in rows.items():
        ok = "error" not in row
        failed += not ok
        tail = f"{row['fresh_diff']:.2e}" if ok else row["error"]
        print(
            f"{name:<18} {row['capture']:<12} {row['in_process']:<8} {row['save']:<5} "
            f"{row['fresh']:<6} {tail}"
        )
        if not ok and opts.verbose:
            print(row["traceback"])
    if opts.json:
        print(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
