"""What the benchmarks here share: fresh processes, empty compiler caches, timing
figures and a JSON result that names the machine.

- :func:`empty_caches`: an environment whose Inductor and Triton caches are a new
  empty directory (removed afterwards), the repository importable;
- :func:`run_child`: a fresh interpreter, failing loudly with its output's tail;
- :func:`last_json`: the JSON a child printed last (or after a tag);
- :func:`spread`: min, median and max of repeated runs;
- :func:`write_result`: the result as JSON, with the machine, torch and the command.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def child_env(cache: str | os.PathLike[str] | None = None, **extra: str) -> dict[str, str]:
    """This process's environment with the repository first on the path, and Python's
    bytecode caches allowed (``PYTHONDONTWRITEBYTECODE`` dropped), as a pip install
    leaves them: they are not compiler caches.

    With ``cache``: every compiler cache and temporary directory under it
    (``inductor/``, ``triton/``, ``tmp/``, ``xdg/``), and no inherited
    ``TORCHINDUCTOR_*`` or ``TRITON_*`` setting.
    """
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    # Set on this machine and the lent GPU ones: each child compiled this package's
    # source again (here 0.23 s of "import torch_precompile", against 0.06 s).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if cache is not None:
        env = {k: v for k, v in env.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
        root = Path(cache)
        for sub in ("inductor", "triton", "tmp", "xdg"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        env.update(
            TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
            TRITON_CACHE_DIR=str(root / "triton"),
            TMPDIR=str(root / "tmp"),
            XDG_CACHE_HOME=str(root / "xdg"),
        )
    env.update(extra)
    return env


@contextlib.contextmanager
def empty_caches(**extra: str) -> Iterator[dict[str, str]]:
    """An environment for one cold run: Inductor's and Triton's caches empty."""
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as cache:
        yield child_env(cache, **extra)


def run_child(
    command: str | Sequence[str],
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 1800,
    cwd: str | os.PathLike[str] = REPO,
) -> str:
    """Run ``command`` (Python source, or an argv) in a fresh process; its stdout.

    A failure raises ``RuntimeError`` with the tail of both streams."""
    argv = [sys.executable, "-c", command] if isinstance(command, str) else list(command)
    proc = subprocess.run(
        [*argv, *args],
        env=dict(env) if env is not None else child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:3])} ... failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc.stdout


def last_json(stdout: str, tag: str | None = None) -> Any:
    """The JSON on the last line of ``stdout`` (with ``tag``: after the last line that
    starts with it)."""
    lines = stdout.strip().splitlines()
    if tag is not None:
        lines = [ln[len(tag) :] for ln in lines if ln.startswith(tag)]
    if not lines:
        raise RuntimeError(f"the child printed no result line{f' ({tag!r})' if tag else ''}")
    return json.loads(lines[-1])


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"min", "median", "max", "runs"}`` of repeated measurements."""
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "runs": list(values),
    }


def machine() -> dict[str, Any]:
    """What ran the benchmark: platform, Python, torch, CPUs, and the GPU if any."""
    import torch

    out: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        **cpu_model(),
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def cpu_model() -> dict[str, Any]:
    """The CPU's model name and its vector extensions (Linux): figures of one 2-core
    machine kind differ 2x to 9x between an AVX-512 Xeon and an AVX2 EPYC."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line and "\t" in line)
    flags = set(fields.get("flags\t\t", "").split())
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    return {
        "cpu_model": fields.get("model name\t", "").strip(),
        "cpu_vector": [f for f in wanted if f in flags],
    }


def write_result(path: str | os.PathLike[str], result: Mapping[str, Any]) -> None:
    """``result`` as JSON at ``path``, with the machine, the date and the command."""
    report = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        **result,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
