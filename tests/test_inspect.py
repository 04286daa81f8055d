"""Views of each stage, stage logging/progress, and the command line (inspect, bench).

One ConvNet is compiled stage by stage (its stage outputs and logs are kept),
one small function with ``verbose=True``; the command line runs in fresh
processes on the saved files.
"""

from __future__ import annotations

import contextlib
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

from examples.models import build_convnet, build_nested_fn
from torch_precompile import Precompile, _format
from torch_precompile._cli import main as cli_main

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
def convnet(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ConvNet through the four stages one by one, with the logs they wrote; then saved."""
    model, args, kwargs = build_convnet()
    logger = logging.getLogger("torch_precompile")
    records = _Records()
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    try:
        with torch.no_grad():
            dyn = Precompile.dynamo(model, args, kwargs)
            aot = Precompile.aot_autograd(dyn)
            ind = Precompile.inductor(aot)
            artifact = Precompile.precompile(ind)
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)
    sizes_in_process = artifact.sizes  # before save: measured, not read from a file
    text_in_process = artifact.as_text()
    path = tmp_path_factory.mktemp("inspect") / "convnet.pt"
    Precompile.save(path, artifact)
    return {
        "model": model,
        "args": args,
        "dynamo": dyn,
        "aot": aot,
        "inductor": ind,
        "artifact": artifact,
        "path": str(path),
        "logs": records.messages,
        "sizes_in_process": sizes_in_process,
        "text_in_process": text_in_process,
    }


# ------------------------------------------------------------------ views


def test_dynamo_as_text_shows_graph_and_each_input_source(convnet: dict) -> None:
    text = convnet["dynamo"].as_text()
    assert "def forward" in text  # the FX graph's code
    assert "L['x']" in text and "input 'x'" in text
    assert "L['self']._modules['fc']._parameters['weight']" in text
    assert "parameter 'fc.weight'" in text
    assert "buffer 'bn1.running_mean'" in text
    # One line per graph input, in the graph's order.
    placeholders = [n for n in convnet["dynamo"].graph_module.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 14
    for node, source in zip(placeholders, convnet["dynamo"].input_sources):
        assert f"{node.name}" in text and source in text


def test_aot_and_inductor_as_text(convnet: dict) -> None:
    aot_text = convnet["aot"].as_text()
    assert aot_text.startswith("# AOTAutograd inference graph")
    assert "torch.ops.aten.convolution" in aot_text
    ind_text = convnet["inductor"].as_text()
    assert "# ===== Inductor forward =====" in ind_text
    assert "def call(" in ind_text  # Inductor's Python wrapper around the C++ kernels


def test_artifact_as_text_in_process(convnet: dict) -> None:
    art = convnet["artifact"]
    text = convnet["text_in_process"]
    assert "PrecompiledArtifact (inference, cpu)" in text
    assert "forward(self, x: 'Tensor')" in text
    assert "x: float32[2, 3, 32, 32]" in text
    assert "graph inputs: 14 (9 parameters, 1 input, 4 buffers)" in text
    assert "graph outputs: float32[2, 10]" in text
    assert f"torch={torch.__version__}" in text and "cpu_isa=" in text
    for stage in ("dynamo", "aot_autograd", "inductor", "precompile"):
        assert f"{stage} {art.timings[stage]:.2f}s" in text
    for phase in ("dynamo (", "aot_autograd (", "inductor ("):
        assert phase in text
    assert "input 'x': float32 (2, 3, 32, 32) on cpu" in text
    assert "sizes: compiled=" in text and "weights=" in text


def test_sizes_known_before_save_and_match_the_file(convnet: dict) -> None:
    sizes = convnet["sizes_in_process"]
    model = convnet["model"]
    n_weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert sizes["weights"] == n_weights
    saved = _format.read_meta(convnet["path"])["sizes"]
    # The same PyTorch serialization measured in process and written to the file.
    assert sizes["compiled"] == saved["compiled"]
    # The weights section adds its index to the raw bytes.
    assert n_weights < saved["weights"] < n_weights + 8192
    assert convnet["artifact"].sizes == saved  # after save: the file's sections


def test_each_stage_logs_start_and_duration(convnet: dict) -> None:
    logs = convnet["logs"]
    for stage in ("dynamo", "aot_autograd", "inductor", "precompile"):
        starts = [m for m in logs if m.startswith(f"{stage}: ") and " done in " not in m]
        ends = [m for m in logs if m.startswith(f"{stage}: done in ")]
        assert len(starts) == 1 and len(ends) == 1, (stage, logs)
        assert logs.index(starts[0]) < logs.index(ends[0])
    assert "dynamo: capturing ConvNet.forward" in logs
    assert logs.index("dynamo: capturing ConvNet.forward") < logs.index(
        next(m for m in logs if m.startswith("inductor: compiling"))
    )


def test_compile_verbose_prints_a_progress_line_per_stage() -> None:
    fn, args, kwargs = build_nested_fn()
    err = io.StringIO()
    logger = logging.getLogger("torch_precompile")
    level_before, handlers_before = logger.level, list(logger.handlers)
    with contextlib.redirect_stderr(err), torch.no_grad():
        artifact = Precompile.compile(fn, args, kwargs, verbose=True)
    lines = err.getvalue().splitlines()
    progress = [line for line in lines if line.startswith("torch_precompile: ")]
    for stage in ("dynamo", "aot_autograd", "inductor", "precompile"):
        assert any(line.startswith(f"torch_precompile: {stage}: done in ") for line in progress), (
            lines
        )
    assert "torch_precompile: dynamo: capturing nested_fn" in progress
    # The handler is gone afterwards, and the logger's level is as it was.
    assert logger.level == level_before and logger.handlers == handlers_before
    with torch.no_grad():
        torch.testing.assert_close(artifact(*args, **kwargs), fn(*args, **kwargs))


# ---------------------------------------------------------------- inspect


def test_inspect_prints_the_header(convnet: dict) -> None:
    proc = _cli("inspect", convnet["path"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    meta = _format.read_meta(convnet["path"])
    assert "torch_precompile artifact, format version 1" in out
    assert f"torch {torch.__version__}" in out
    assert f"Python {meta['system']['python']}" in out
    assert f"CPU instruction set {meta['system']['cpu_isa']}" in out
    assert f"created:   {meta['created']}" in out
    assert "inference, device cpu" in out
    assert "forward(self, x: 'Tensor')" in out and "x: float32[2, 3, 32, 32]" in out
    assert "sizes:     compiled " in out and "weights " in out
    assert "guards (" in out
    for phase in ("dynamo (", "aot_autograd (", "inductor ("):
        assert f"\n  {phase}" in out
    assert "CPU instruction set >= " in out  # an inductor guard


def test_inspect_json(convnet: dict) -> None:
    proc = _cli("inspect", convnet["path"], "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["format_version"] == _format.FORMAT_VERSION
    assert data["signed"] is False
    assert data["file_size"] == os.path.getsize(convnet["path"])
    assert [s["name"] for s in data["sections"]] == ["compiled", "skeleton", "weights"]
    meta = data["meta"]
    assert meta["system"]["torch"] == torch.__version__
    assert meta["signature"]["graph_inputs"] == convnet["dynamo"].input_sources
    assert meta["signature"]["parameters"]["x"]["tensor"]["shape"] == [2, 3, 32, 32]
    assert {g["phase"] for g in meta["guards"]} == {"dynamo", "aot_autograd", "inductor"}
    assert set(meta["timings"]) == {"dynamo", "aot_autograd", "inductor", "precompile"}


def test_inspect_does_not_import_the_compiler(convnet: dict) -> None:
    script = (
        "import sys\n"
        "from torch_precompile.__main__ import main\n"
        f"rc = main(['inspect', {convnet['path']!r}])\n"
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
    convnet: dict, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.pt"
    if kind == "text":
        path.write_text("hello, not an artifact\n")
    elif kind == "truncated":
        data = Path(convnet["path"]).read_bytes()
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


def test_inspect_never_unpickles_the_payload(convnet: dict, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    meta, sections = _format.read_artifact(convnet["path"])
    sections["compiled"] = pickle.dumps(_Payload(str(marker)))
    evil = tmp_path / "evil.pt"
    _format.write_artifact(evil, meta, sections)  # a valid container with a valid checksum
    outputs = []
    for args in (["inspect", str(evil)], ["inspect", str(evil), "--json"]):
        proc = _cli(*args, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr
        assert not marker.exists(), "inspect executed the artifact's payload"
        outputs.append(proc.stdout)
    assert "forward(self, x: 'Tensor')" in outputs[0]
    assert json.loads(outputs[1])["sections"][0]["name"] == "compiled"
    # The payload is live: unpickling the section does run it.
    _, sections_back = _format.read_artifact(evil)
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=sections_back["compiled"],
        env=_env(),
        check=True,
        timeout=120,
    )
    assert marker.exists()


def test_console_script_entry_point(convnet: dict, capsys: pytest.CaptureFixture[str]) -> None:
    scripts = tomllib.loads(Path(REPO, "pyproject.toml").read_text())["project"]["scripts"]
    module_name, _, attr = scripts["torch-precompile"].partition(":")
    module = __import__(module_name, fromlist=[attr])
    assert getattr(module, attr) is cli_main
    assert cli_main(["inspect", "--json", convnet["path"]]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["kind"] == "module"


# ------------------------------------------------------------------ bench


def test_bench_times_load_first_and_steady_calls(convnet: dict) -> None:
    proc = _cli("bench", convnet["path"], "--iters", "5", "--warmup", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["iters"] == 5
    assert data["load_s"] > 0 and data["first_call_s"] > 0
    assert 0 < data["steady_min_s"] <= data["steady_median_s"]
    human = _cli("bench", convnet["path"], "--iters", "3")
    assert human.returncode == 0, human.stderr
    assert (
        "load:" in human.stdout and "first call:" in human.stdout and "steady call:" in human.stdout
    )


def test_bench_non_artifact_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(b"\0" * 100)
    proc = _cli("bench", str(path))
    assert proc.returncode == 1
    assert len(proc.stderr.splitlines()) == 1 and "not a torch_precompile artifact" in proc.stderr
