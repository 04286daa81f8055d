"""Views of each stage, stage logging/progress, and the command line (inspect, bench).

The session's staged transformer (conftest) gives the stage views and the
saved file; one small function is compiled with ``verbose=True`` for the
logging and progress lines. The command line runs in fresh processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from tests.fixtures.models import build_nested_fn
from torch_precompile import Precompile
from torch_precompile import file as container
from torch_precompile.cli.main import main as cli_main
from torch_precompile.runtime.artifact import human_size

REPO = str(Path(__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch_precompile", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=300,
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def art(staged) -> dict:  # type: ignore[no-untyped-def]
    """The session's staged transformer (conftest), saved; its views and file."""
    return {
        "model": staged.model,
        "dynamo": staged.dynamo,
        "aot": staged.aot,
        "inductor": staged.inductor,
        "artifact": staged.artifact,
        "path": str(staged.path),
    }


@pytest.fixture(scope="module")
def verbose_compile() -> dict:
    """A small function compiled with verbose=True; its stderr and log records kept."""
    fn, args, kwargs = build_nested_fn()
    err = io.StringIO()
    logger = logging.getLogger("torch_precompile")
    level_before, handlers_before = logger.level, list(logger.handlers)
    records = _Records()
    logger.addHandler(records)  # at NOTSET: sees what verbose lets through
    try:
        with contextlib.redirect_stderr(err), torch.no_grad():
            artifact = Precompile.compile(fn, args, kwargs, verbose=True)
    finally:
        logger.removeHandler(records)
    handlers_after = [h for h in logger.handlers if h is not records]
    return {
        "fn": fn,
        "args": args,
        "kwargs": kwargs,
        "artifact": artifact,
        "sizes_in_process": artifact.sizes,
        "stderr": err.getvalue(),
        "logs": records.messages,
        "restored": logger.level == level_before and handlers_after == handlers_before,
    }


# ------------------------------------------------------------------ views


def test_dynamo_as_text_shows_graph_and_each_input_source(art: dict) -> None:
    dyn = art["dynamo"]
    text = dyn.as_text()
    assert "def forward" in text  # the FX graph's code
    assert "L['ids']" in text and "input 'ids'" in text
    placeholders = [n for n in dyn.graph_module.graph.nodes if n.op == "placeholder"]
    lines = text.splitlines()
    # One line per graph input, in the graph's order: placeholder <- source (in words).
    for i, (node, source) in enumerate(zip(placeholders, dyn.input_sources, strict=True)):
        assert lines[1 + i].split()[1:4] == [node.name, "<-", source], lines[1 + i]
    assert any("(parameter 'blocks.0.ln1.weight')" in line for line in lines)


def test_aot_and_inductor_as_text(art: dict) -> None:
    aot_text = art["aot"].as_text()
    assert aot_text.startswith("# AOTAutograd inference graph")
    assert "torch.ops.aten." in aot_text
    ind_text = art["inductor"].as_text()
    assert "# ===== Inductor forward =====" in ind_text
    assert "def call(" in ind_text  # Inductor's Python wrapper around the C++ kernels


def test_artifact_as_text(art: dict) -> None:
    artifact = art["artifact"]
    text = artifact.as_text()
    assert "PrecompiledArtifact (inference, cpu)" in text
    saved_to = artifact.origin["path"]  # the last file it was saved to (tests save it again)
    assert f"\nfile: {saved_to}\n" in text and os.path.isfile(saved_to)
    assert "forward(self, ids" in text and "ids: int64[2, 32]" in text
    n_params = len(list(art["model"].parameters()))
    n_inputs = len(art["dynamo"].input_sources)
    assert f"graph inputs: {n_inputs} (" in text and f"{n_params} parameters" in text
    assert "graph outputs: float32[2, 32, " in text
    assert f"torch={torch.__version__}" in text and "cpu_isa=" in text
    for stage in ("dynamo", "aot_autograd", "inductor", "precompile"):
        assert f"{stage} {artifact.timings[stage]:.2f}s" in text
    for phase in ("dynamo (", "aot_autograd (", "inductor ("):
        assert phase in text
    assert "input 'ids': int64 (2, 32) on cpu" in text
    sizes = container.read_meta(saved_to)["sizes"]
    assert f"sizes: compiled={human_size(sizes['compiled'])}, " in text
    assert f"weights={human_size(sizes['weights'])}" in text


def test_sizes_known_before_save_and_match_the_file(art: dict, tmp_path: Path) -> None:
    # A copy that was never saved: sizes are measured in process.
    fresh = dataclasses.replace(art["artifact"], _sizes={}, _origin={})
    sizes = fresh.sizes
    n_weights = sum(t.numel() * t.element_size() for t in art["model"].state_dict().values())
    assert sizes["weights"] == n_weights
    assert "sizes: compiled=" in fresh.as_text() and "file:" not in fresh.as_text()
    Precompile.save(tmp_path / "copy.pt", fresh)
    saved = container.read_meta(tmp_path / "copy.pt")["sizes"]
    # The same PyTorch serialization, measured in process and written to the file.
    assert sizes["compiled"] == saved["compiled"]
    assert n_weights < saved["weights"] < n_weights + 16384  # the section adds its index
    assert fresh.sizes == saved  # once saved: the file's sections


def test_each_stage_logs_start_and_duration(verbose_compile: dict) -> None:
    logs = verbose_compile["logs"]
    order = []
    for stage in ("dynamo", "aot_autograd", "inductor", "precompile"):
        starts = [
            i for i, m in enumerate(logs) if m.startswith(f"{stage}: ") and " done in " not in m
        ]
        ends = [i for i, m in enumerate(logs) if m.startswith(f"{stage}: done in ")]
        assert len(starts) == 1 and len(ends) == 1, (stage, logs)
        assert float(logs[ends[0]].split(" done in ")[1].split()[0]) >= 0
        order += [starts[0], ends[0]]
    assert order == sorted(order)  # each stage starts after the previous one ended
    assert logs[0] == "dynamo: capturing nested_fn"


def test_compile_verbose_prints_a_progress_line_per_stage(verbose_compile: dict) -> None:
    lines = verbose_compile["stderr"].splitlines()
    progress = [line for line in lines if line.startswith("torch_precompile: ")]
    assert progress == [f"torch_precompile: {m}" for m in verbose_compile["logs"]]
    for stage in ("dynamo", "aot_autograd", "inductor", "precompile"):
        assert any(line.startswith(f"torch_precompile: {stage}: done in ") for line in progress)
    assert verbose_compile["restored"]  # the handler is gone, the logger's level as it was
    fn, args, kwargs = verbose_compile["fn"], verbose_compile["args"], verbose_compile["kwargs"]
    with torch.no_grad():
        torch.testing.assert_close(
            verbose_compile["artifact"](*args, **kwargs), fn(*args, **kwargs)
        )


# ---------------------------------------------------------------- inspect


def test_inspect_prints_the_header(art: dict) -> None:
    proc = _cli("inspect", art["path"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    meta = container.read_meta(art["path"])
    assert f"torch_precompile artifact, format version {container.FORMAT_VERSION}" in out
    assert f"torch {torch.__version__}" in out
    assert f"Python {meta['system']['python']}" in out
    assert f"CPU instruction set {meta['system']['cpu_isa']}" in out
    assert f"created:   {meta['created']}" in out
    assert "inference, device cpu" in out
    assert "forward(self, ids" in out and "ids: int64[2, 32]" in out
    assert "sizes:     compiled " in out and "weights " in out
    assert "guards (" in out
    for phase in ("dynamo (", "aot_autograd (", "inductor ("):
        assert f"\n  {phase}" in out
    assert "CPU instruction set >= " in out  # an inductor guard


def test_inspect_json(art: dict) -> None:
    proc = _cli("inspect", art["path"], "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["format_version"] == container.FORMAT_VERSION
    assert data["signed"] is False
    assert data["file_size"] == os.path.getsize(art["path"])
    names = [s["name"] for s in data["sections"]]
    kernels = [n for n in names if n.startswith("kernel/")]
    assert kernels and names == [
        "compiled",
        "skeleton",
        "weights",
        "lean",  # CPU inference: what loads without a compiler (test_coldstart.py)
        *sorted(kernels),  # one section per shipped kernel
    ]
    meta = data["meta"]
    assert meta["system"]["torch"] == torch.__version__
    assert meta["bundle"] is False and len(meta["variants"]) == 1
    variant = meta["variants"][0]
    assert variant["signature"]["graph_inputs"] == art["dynamo"].input_sources
    assert variant["signature"]["parameters"]["ids"]["tensor"]["shape"] == [2, 32]
    assert {g["phase"] for g in variant["guards"]} == {"dynamo", "aot_autograd", "inductor"}
    assert set(variant["timings"]) == {"dynamo", "aot_autograd", "inductor", "precompile"}


def test_inspect_signed_file(art: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta, sections = container.read_artifact(art["path"])
    signed = tmp_path / "signed.pt"
    container.write_artifact(signed, meta, sections, sign_key="secret")
    assert cli_main(["inspect", str(signed)]) == 0  # no key needed to read the header
    assert ", signed (HMAC-SHA256)" in capsys.readouterr().out.splitlines()[0]
    assert cli_main(["inspect", "--json", str(signed)]) == 0
    assert json.loads(capsys.readouterr().out)["signed"] is True


def test_inspect_does_not_import_the_compiler(art: dict) -> None:
    script = (
        "import sys\n"
        "from torch_precompile.__main__ import main\n"
        f"rc = main(['inspect', {art['path']!r}])\n"
        "loaded = [m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))]\n"
        "print('COMPILER', loaded)\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "COMPILER []" in proc.stdout


@pytest.mark.parametrize("kind", ["text", "truncated", "missing", "pickle"])
def test_inspect_non_artifact_exits_1_with_one_line(
    art: dict, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.pt"
    if kind == "text":
        path.write_text("hello, not an artifact\n")
    elif kind == "truncated":
        data = Path(art["path"]).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"a": 1}))
    if kind == "text":  # the real command once; the other cases run the same main() in process
        proc = _cli("inspect", str(path))
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        rc = cli_main(["inspect", str(path)])
        out, err = capsys.readouterr()
    assert rc == 1
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("torch-precompile: error: ")
    expected = {
        "text": "not a torch_precompile artifact",
        "truncated": "truncated",
        "missing": "No such file",
        "pickle": "looks like a pickle",
    }[kind]
    assert expected in lines[0]


class _Payload:
    """Unpickling this creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path(self.marker).touch, ())


def test_inspect_never_unpickles_the_payload(art: dict, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    meta, sections = container.read_artifact(art["path"])
    sections["compiled"] = pickle.dumps(_Payload(str(marker)))
    evil = tmp_path / "evil.pt"
    container.write_artifact(evil, meta, sections)  # a valid container with a valid checksum
    outputs = []
    for args in (["inspect", str(evil)], ["inspect", str(evil), "--json"]):
        proc = _cli(*args, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert not marker.exists(), "inspect executed the artifact's payload"
        outputs.append(proc.stdout)
    assert "forward(self, ids" in outputs[0]
    assert json.loads(outputs[1])["sections"][0]["name"] == "compiled"
    # The payload is live: unpickling the section does run it.
    _, sections_back = container.read_artifact(evil)
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=sections_back["compiled"],
        env=_env(),
        check=True,
        timeout=120,
    )
    assert marker.exists()


def test_console_script_entry_point(art: dict, capsys: pytest.CaptureFixture[str]) -> None:
    scripts = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]["scripts"]
    module_name, _, attr = scripts["torch-precompile"].partition(":")
    module = __import__(module_name, fromlist=[attr])
    # The script's entry (torch_precompile_cli: help without torch) runs cli_main for
    # every call that is not a call for help.
    assert getattr(module, attr)(["inspect", "--json", art["path"]]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["kind"] == "module"
    assert cli_main(["inspect", "--json", art["path"]]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["kind"] == "module"


# ------------------------------------------------------------------ bench


def test_bench_times_load_first_and_steady_calls(
    art: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = _cli("bench", art["path"], "--iters", "5", "--warmup", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["iters"] == 5
    assert data["load_s"] > 0 and data["first_call_s"] > 0
    assert 0 < data["steady_min_s"] <= data["steady_median_s"]
    # The human form, through the same main() in process.
    assert cli_main(["bench", art["path"], "--iters", "3", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "load:" in out and "first call:" in out and "steady call:" in out
    assert "over 3 calls" in out


def test_bench_non_artifact_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(b"\0" * 100)
    proc = _cli("bench", str(path))
    assert proc.returncode == 1
    assert len(proc.stderr.splitlines()) == 1 and "not a torch_precompile artifact" in proc.stderr
