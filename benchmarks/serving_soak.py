"""Serving soak: N threads x M calls of a loaded artifact, with bad requests mixed in.

The reference transformer (``tests.fixtures.models.build_transformer``: 2 blocks,
d=256, vocab 1000, ids of shape (2, 32)) is compiled and saved once (or
``--artifact`` names a saved one), then a *fresh process*, as a server would,
loads it with ``Precompile.load(path)`` (no model object) and runs ``--threads``
threads of ``--calls`` calls each. Each call draws one request from a fixed
pool (seeded):

- ``good``: ids of the compiled shape; the answer must equal eager's
  (``torch.testing.assert_close``, rtol=atol=1e-4);
- ``bad shape``: (2, 31), (3, 32), (32,), float ids, a transposed (strided)
  view; the artifact must raise (``GuardError``) or give eager's answer;
- ``bad ids``: a token id of 1000 (= vocab), -1 and 10**6; eager raises
  ``IndexError``, the artifact must raise too.

Out-of-range ids abort the process on some builds (``index out of bounds``,
SIGABRT) rather than raise. So that one such case reports instead of killing
the soak, ``--bad-ids probe`` (the default) first sends each bad-id request
to the artifact in its own fresh process: a case that kills it is counted as a
crash and left out of the soak, a case that raises is kept in. ``--bad-ids
include`` sends them all regardless (a crash then ends the soak, and is
reported as such); ``--bad-ids skip`` sends none.

Reported: calls served, errors by type and request kind, wrong answers (a
result that differs from eager's, or a result where eager raises: must be 0),
crashes (a process that died: must be 0), RSS after a warm-up, halfway and at
the end (the first half carries each thread's one-off costs; growth over the
second half, with the same threads, would be a leak), load time and throughput.
``--json`` writes the report.

Usage (from the repository root)::

    python benchmarks/serving_soak.py                          # 8 threads x 200 calls
    python benchmarks/serving_soak.py --threads 16 --calls 500 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from harness import REPO, child_env, write_result

BAD_IDS = {"id_eq_vocab": 1000, "id_negative": -1, "id_huge": 10**6}

# The server: a fresh process that loads the artifact and serves the requests.
SERVER = textwrap.dedent(
    """
    import collections, json, os, random, sys, threading, time
    import torch
    from torch_precompile import Precompile

    artifact, requests_path, threads, calls, seed, kinds = sys.argv[1:7]
    threads, calls, seed = int(threads), int(calls), int(seed)
    kinds = json.loads(kinds)  # the request names this run sends

    def rss_kib():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return -1

    requests = torch.load(requests_path)
    requests = {name: requests[name] for name in kinds}
    start = time.perf_counter()
    art = Precompile.load(artifact)
    load_s = time.perf_counter() - start
    fast = type(art.compiled_function).__name__ == "LeanCompiledFunction"

    def serve(req):
        # -> (outcome, detail): "ok", "wrong" or "error:<Type>"
        try:
            with torch.no_grad():
                out = art(req["input"])
        except Exception as exc:
            if req["eager_error"] is None and req["kind"] == "good":
                return "unexpected_error:" + type(exc).__name__, str(exc)[:300]
            return "error:" + type(exc).__name__, str(exc)[:300]
        if req["eager_error"] is not None:
            return "wrong", f"returned a result where eager raises {req['eager_error']}"
        try:
            torch.testing.assert_close(out, req["expected"], rtol=1e-4, atol=1e-4)
        except AssertionError as exc:
            return "wrong", str(exc)[:300]
        return "ok", ""

    names = sorted(requests)
    good = [n for n in names if requests[n]["kind"] == "good"]
    bad = [n for n in names if requests[n]["kind"] != "good"]
    for name in good * 3:  # warm-up, and the answers checked once before the clock
        serve(requests[name])
    rss_before = rss_kib()
    lock = threading.Lock()
    outcomes = collections.Counter()
    by_kind = collections.defaultdict(collections.Counter)
    examples = {}

    def worker(index, barrier):
        rng = random.Random(seed * 1000 + index)
        local = []
        barrier.wait()
        for i in range(calls):
            if i == calls // 2:  # halfway: the main thread reads RSS with every thread warm
                halfway.wait()
                halfway.wait()
            name = rng.choice(good) if not bad or rng.random() < 0.6 else rng.choice(bad)
            outcome, detail = serve(requests[name])
            local.append((name, outcome, detail))
        with lock:
            for name, outcome, detail in local:
                outcomes[outcome] += 1
                by_kind[requests[name]["kind"] + ":" + name][outcome] += 1
                if outcome != "ok":
                    examples.setdefault(outcome, f"{name}: {detail}")

    barrier = threading.Barrier(threads)
    halfway = threading.Barrier(threads + 1)
    pool = [threading.Thread(target=worker, args=(i, barrier)) for i in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    halfway.wait()
    rss_halfway = rss_kib()
    halfway.wait()
    for t in pool:
        t.join()
    wall = time.perf_counter() - start
    rss_after = rss_kib()
    print("REPORT " + json.dumps({
        "load_s": load_s,
        "fast_path": fast,
        "wall_s": wall,
        "outcomes": dict(outcomes),
        "by_request": {k: dict(v) for k, v in sorted(by_kind.items())},
        "examples": examples,
        "rss_before_kib": rss_before,
        "rss_halfway_kib": rss_halfway,
        "rss_after_kib": rss_after,
        "torch_threads": torch.get_num_threads(),
    }))
    """
)


def build_requests(model: Any, seed: int) -> dict[str, dict[str, Any]]:
    """The request pool, each with eager's answer or eager's exception type."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, tuple[str, Any]] = {}
    for i in range(8):
        inputs[f"good{i}"] = ("good", torch.randint(0, 1000, (2, 32), generator=gen))
    ids = torch.randint(0, 1000, (2, 32), generator=gen)
    inputs.update(
        {
            "seq31": ("bad_shape", ids[:, :31].contiguous()),
            "batch3": ("bad_shape", torch.randint(0, 1000, (3, 32), generator=gen)),
            "one_dim": ("bad_shape", ids[0].clone()),
            "float_ids": ("bad_shape", ids.float()),
            "strided": ("bad_shape", ids.t().contiguous().t()),
        }
    )
    for name, value in BAD_IDS.items():
        bad = ids.clone()
        bad[1, 7] = value
        inputs[name] = ("bad_ids", bad)
    requests = {}
    for name, (kind, x) in inputs.items():
        expected, error = None, None
        try:
            with torch.no_grad():
                expected = model(x)
        except Exception as exc:
            error = type(exc).__name__
        requests[name] = {"kind": kind, "input": x, "expected": expected, "eager_error": error}
    return requests


def build_artifact(path: Path) -> None:
    import torch

    from tests.fixtures.models import build_transformer
    from torch_precompile import Precompile

    model, (ids,), _ = build_transformer()
    with torch.no_grad():
        artifact = Precompile.compile(model, ids)
    Precompile.save(path, artifact)


def _run_server(
    script: Path, artifact: Path, requests: Path, threads: int, calls: int, seed: int, kinds: list
) -> tuple[int, dict[str, Any] | None, str]:
    argv = [str(artifact), str(requests), str(threads), str(calls), str(seed), json.dumps(kinds)]
    proc = subprocess.run(
        [sys.executable, str(script), *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    report = json.loads(lines[-1][len("REPORT ") :]) if lines else None
    return proc.returncode, report, proc.stderr[-2000:]


def _death(returncode: int) -> str:
    if returncode < 0:
        import signal

        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200, help="calls per thread")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bad-ids",
        choices=("probe", "include", "skip"),
        default="probe",
        help="out-of-range ids: probe each in its own process first and soak only those "
        "that do not kill it (default), send them all, or send none",
    )
    parser.add_argument("--artifact", type=Path, help="a saved transformer artifact to use")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO))
    import torch

    from tests.fixtures.models import build_transformer

    work = Path(tempfile.mkdtemp(prefix="serving_soak-"))
    artifact = args.artifact
    if artifact is None:
        artifact = work / "transformer.pt"
        print(f"compiling the transformer into {artifact} ...", flush=True)
        build_artifact(artifact)
    model, _, _ = build_transformer()
    requests = build_requests(model, args.seed)
    requests_path = work / "requests.pt"
    torch.save(requests, requests_path)
    script = work / "server.py"
    script.write_text(SERVER)

    kinds = [n for n, r in requests.items() if r["kind"] != "bad_ids"]
    probe: dict[str, str] = {}
    crashes: dict[str, str] = {}
    bad_id_names = [n for n, r in requests.items() if r["kind"] == "bad_ids"]
    if args.bad_ids == "include":
        kinds += bad_id_names
    elif args.bad_ids == "probe":
        for name in bad_id_names:
            rc, report, err = _run_server(script, artifact, requests_path, 1, 1, 0, [name])
            if rc == 0 and report is not None:
                outcome = next(iter(report["outcomes"]))
                probe[name] = outcome
                kinds.append(name)
            else:
                probe[name] = crashes[f"probe:{name}"] = _death(rc)
            print(f"probe {name}: {probe[name]}", flush=True)

    rc, report, err = _run_server(
        script, artifact, requests_path, args.threads, args.calls, args.seed, kinds
    )
    if rc != 0 or report is None:
        crashes["soak"] = f"{_death(rc)}: {err.strip().splitlines()[-1] if err.strip() else ''}"
        report = {}
    outcomes = report.get("outcomes", {})
    result = {
        "model": "tests.fixtures.models.build_transformer (2 blocks, d=256, ids (2, 32))",
        "threads": args.threads,
        "calls_per_thread": args.calls,
        "bad_ids_mode": args.bad_ids,
        "bad_id_probe": probe,
        "requests_sent": sorted(kinds),
        "calls": sum(outcomes.values()),
        "served": outcomes.get("ok", 0),
        "errors": {k[len("error:") :]: v for k, v in outcomes.items() if k.startswith("error:")},
        "unexpected_errors_on_good_inputs": {
            k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith("unexpected_error:")
        },
        "wrong_answers": outcomes.get("wrong", 0),
        "crashes": len(crashes),
        "crash_details": crashes,
        "by_request": report.get("by_request", {}),
        "examples": report.get("examples", {}),
        "load_s": report.get("load_s"),
        "fast_path": report.get("fast_path"),
        "wall_s": report.get("wall_s"),
        "calls_per_s": (sum(outcomes.values()) / report["wall_s"])
        if report.get("wall_s")
        else None,
        "rss_before_kib": report.get("rss_before_kib"),
        "rss_halfway_kib": report.get("rss_halfway_kib"),
        "rss_after_kib": report.get("rss_after_kib"),
        # The first half includes each thread's one-off costs (its malloc arena, its
        # OpenMP team); growth over the second half, with the same threads, is a leak.
        "rss_growth_first_half_kib": (report["rss_halfway_kib"] - report["rss_before_kib"])
        if report
        else None,
        "rss_growth_second_half_kib": (report["rss_after_kib"] - report["rss_halfway_kib"])
        if report
        else None,
    }
    if report:
        head = (
            f"{result['calls']} calls ({args.threads} threads x {args.calls}) in "
            f"{result['wall_s']:.1f} s, load {result['load_s']:.2f} s "
            f"({'fast' if result['fast_path'] else 'full'} path)"
        )
    else:
        head = "the server process died before it could report"
    print(
        f"{head}\n"
        f"served (eager's answer): {result['served']}\n"
        f"errors by type: {result['errors']}\n"
        f"unexpected errors on good inputs: {result['unexpected_errors_on_good_inputs']}\n"
        f"wrong answers: {result['wrong_answers']}\n"
        f"crashes: {result['crashes']} {crashes or ''}\n"
        f"bad-id probe ({args.bad_ids}): {probe or '-'}\n"
        f"RSS: {result['rss_before_kib']} KiB after warm-up, {result['rss_halfway_kib']} KiB "
        f"halfway, {result['rss_after_kib']} KiB at the end (growth over the second half: "
        f"{result['rss_growth_second_half_kib']} KiB)"
    )
    if args.json:
        write_result(args.json, result)
    shutil.rmtree(work, ignore_errors=True)
    ok = (
        not result["wrong_answers"]
        and not crashes
        and not result["unexpected_errors_on_good_inputs"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
