"""Shared fixtures: each compiled artifact is built once per session."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fixtures.hf_models import assert_same_output  # noqa: E402, F401 (for the tests)
from tests.fixtures.models import build_transformer  # noqa: E402
from tests.fixtures.store import Store, store_root  # noqa: E402
from tests.fixtures.tiers import mark_tiers, order_by_weight  # noqa: E402
from torch_precompile import Precompile  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist hands whole files to its workers (--dist loadfile); by default it
    # orders them by their number of tests. The order of collection is used instead,
    # which pytest_collection_modifyitems makes the slowest files first.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_tiers(items, pytest.mark.quick, pytest.mark.families)
    order_by_weight(items)


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """Saved artifacts built once per run, shared by every module and worker."""
    return Store(store_root(tmp_path_factory.getbasetemp()))


@dataclasses.dataclass
class Staged:
    """Every stage's output for one inference capture of the reference transformer."""

    model: torch.nn.Module
    example: torch.Tensor
    expected: torch.Tensor
    dynamo: Any
    aot: Any
    inductor: Any
    artifact: Any
    path: Path


@pytest.fixture(scope="session")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Staged:
    model, (ids,), _ = build_transformer()
    with torch.no_grad():
        expected = model(ids)
        d = Precompile.dynamo(model, ids)
        a = Precompile.aot_autograd(d)
        i = Precompile.inductor(a)
        art = Precompile.precompile(i)
    path = tmp_path_factory.mktemp("staged") / "transformer.pt"
    Precompile.save(path, art, d.bytecode, i.guards)
    return Staged(model, ids, expected, d, a, i, art, path)


def run_script(
    source: str, *args: str, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``source`` in a fresh interpreter with the repo importable; fail loudly on error.

    ``env`` replaces the environment (it must make the repo importable itself,
    as :func:`no_compiler_env` does).
    """
    env = env if env is not None else dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"fresh process failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def script_json(source: str, *args: Any, **env: str) -> Any:
    """Run ``source`` in a fresh interpreter (``env`` added to this one's); the JSON
    its last line prints."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    proc = run_script(source, *map(str, args), env=full_env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torchrun(job: str, nproc: int, *args: str, env: dict[str, str] | None = None) -> None:
    """Run the module ``tests.fixtures.<job>`` as a real ``torchrun`` job of ``nproc`` ranks; fail
    loudly on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", f"tests.fixtures.{job}", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=400)
    tail = f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    # Which ranks wrote their result before the job failed (phase, DIR are the first args).
    written = sorted(p.name for p in Path(args[1]).glob(f"{args[0]}-*.json")) if args[1:] else []
    assert proc.returncode == 0, f"torchrun {job} {args} failed (results: {written}):\n{tail}"


def rank_results(out: Path, phase: str, world: int) -> list[dict[str, Any]]:
    """Each rank's result of a job's phase (``tests/fixtures/rank_job.py``), none an error."""
    ranks = [json.loads((out / f"{phase}-{world}-rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"{phase} job, world {world}, rank {r}:\n{res['error']}"
    return ranks


def no_compiler_env(root: Path) -> dict[str, str]:
    """An environment in which no C++ compiler can run.

    ``CC``/``CXX`` point at ``/bin/false``, ``PATH`` holds only ``python`` (so no
    ``gcc``/``g++``/``cc``/``c++`` can be found) and ``TORCHINDUCTOR_CACHE_DIR``
    is a fresh empty directory under ``root``.
    """
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    link = bin_dir / "python"
    if not link.exists():
        link.symlink_to(sys.executable)
    cache = root / "inductor-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.pop("TORCH_PRECOMPILE_SHIPPED_KERNELS", None)
    env.pop("TORCH_PRECOMPILE_LEAN", None)
    env.update(
        PATH=str(bin_dir),
        CC="/bin/false",
        CXX="/bin/false",
        TORCHINDUCTOR_CACHE_DIR=str(cache),
        TRITON_CACHE_DIR=str(root / "triton-cache"),
        PYTHONPATH=str(ROOT),
    )
    for tool in ("gcc", "g++", "cc", "c++", "clang", "clang++"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    return env


# Loads each artifact of ``cases`` (name -> {"path", "ref"}) in one fresh process in
# which no class of the model's library may be constructed, and compares every call
# recorded in "ref" (a torch.save'd list of (args, kwargs, eager output)) with eager.
_FRESH_LOAD = """
import json, sys
import torch
from tests.fixtures.hf_models import assert_same_output
from torch_precompile import Precompile

cases, library, tol = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
original_init = torch.nn.Module.__init__

def importing_library():
    # Module-level code of the library itself (transformers.activations builds a
    # few activation modules when imported): an import, not a model being built.
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get(
            "__name__", ""
        ).startswith(library):
            return True
        frame = frame.f_back
    return False

def guarded_init(self, *args, **kwargs):
    if type(self).__module__.startswith(library) and not importing_library():
        raise AssertionError(f"{type(self).__qualname__} was constructed at load")
    original_init(self, *args, **kwargs)

torch.nn.Module.__init__ = guarded_init
results = {}
for name, case in cases.items():
    try:
        art = Precompile.load(case["path"])
        diff = 0.0
        for args, kwargs, want in torch.load(case["ref"], weights_only=False):
            with torch.no_grad():
                got = art(*args, **kwargs)
            diff = max(diff, assert_same_output(got, want, **tol))
        results[name] = {"ok": True, "max_diff": diff, "output": type(got).__name__}
    except Exception as exc:
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
"""


def fresh_load_results(
    cases: dict[str, dict[str, str]],
    library: str,
    env: dict[str, str],
    after: str = "",
    **tol: float,
) -> dict[str, Any]:
    """Run the fresh-process load of ``cases`` (see ``_FRESH_LOAD``); ``after`` is more
    code for that process, which may add to ``results``; ``tol`` overrides
    :func:`assert_same_output`'s tolerances. Returns ``results``."""
    source = _FRESH_LOAD + after + "\nprint(json.dumps(results))\n"
    proc = run_script(source, json.dumps(cases), library, json.dumps(tol), env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def package_warnings() -> Iterator[list[str]]:
    """Collect the messages the ``torch_precompile`` logger emits at WARNING or above."""
    messages: list[str] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torch_precompile")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
