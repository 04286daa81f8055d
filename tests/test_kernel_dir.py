"""The kernel directory: shipped C++ kernels written and loaded safely, or a typed error.

The session's transformer artifact (``staged`` in conftest) is reused. Threads
and processes load it at once into an empty kernel directory and must all take
the lean path. Faults are real where the test can make them (a ``noexec``, a
tiny or a read-only tmpfs mounted here, skipped only when mounting is not
permitted; a directory owned by another uid; a path under a regular file), and
also injected with a fake raising the same ``OSError`` so that each behaviour
is tested everywhere. Each fault must raise :class:`KernelDirectoryError`
naming the directory, the cause and ``TORCH_PRECOMPILE_KERNEL_DIR``, and must
never start a compiler (the fresh processes have none).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import no_compiler_env

from torch_precompile import KernelDirectoryError, Precompile, PrecompileError
from torch_precompile.lean import kernels as shipped


@pytest.fixture(scope="module")
def saved(staged: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The session's transformer artifact, with its input and eager output on disk."""
    root = tmp_path_factory.mktemp("kernel_dir")
    torch.save({"ids": staged.example, "expected": staged.expected}, root / "io.pt")
    return {"root": root, "artifact": staged.path, "io": root / "io.pt"}


# A fresh process loads the artifact with THREADS threads per round, each round into
# a new empty kernel directory (or the one given), and reports what happened.
LOADER = """
    import json, logging, os, sys, threading
    import torch
    from torch_precompile import Precompile

    artifact, io_path = sys.argv[1], sys.argv[2]
    rounds, threads = int(sys.argv[3]), int(sys.argv[4])
    kernel_dirs = sys.argv[5:]
    io = torch.load(io_path)
    warnings = []

    class Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("torch_precompile").addHandler(Catch())
    report = {"loads": 0, "fast": 0, "max_diff": 0.0, "errors": [], "warnings": warnings}
    lock = threading.Lock()

    def worker(barrier):
        barrier.wait()
        try:
            art = Precompile.load(artifact)
            with torch.no_grad():
                out = art(io["ids"])
            diff = (out - io["expected"]).abs().max().item()
            with lock:
                report["loads"] += 1
                report["fast"] += type(art.compiled_function).__name__ == "LeanCompiledFunction"
                report["max_diff"] = max(report["max_diff"], diff)
        except BaseException as exc:
            with lock:
                report["errors"].append(f"{type(exc).__name__}: {exc}")

    for r in range(rounds):
        if kernel_dirs:
            os.environ["TORCH_PRECOMPILE_KERNEL_DIR"] = kernel_dirs[r % len(kernel_dirs)]
        barrier = threading.Barrier(threads)
        pool = [threading.Thread(target=worker, args=(barrier,)) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    print("REPORT " + json.dumps(report))
"""


def _loader(root: Path, saved: dict[str, Path], env: dict[str, str], *args: Any) -> list[str]:
    script = root / "loader.py"
    script.write_text(textwrap.dedent(LOADER))
    return [sys.executable, str(script), str(saved["artifact"]), str(saved["io"])] + [
        str(a) for a in args
    ]


def _report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT ") :])


def _leftovers(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs for p in d.rglob("*") if p.is_file() and p.suffix != ".so"]


def test_threads_load_one_file_into_an_empty_kernel_dir(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """8 threads load one file at once, 4 rounds, each into a new empty kernel directory:
    every load takes the lean path (no fallback warning), gives eager's answer, and no
    temporary file is left behind."""
    dirs = [tmp_path / f"kernels{r}" for r in range(4)]
    env = no_compiler_env(tmp_path)
    proc = subprocess.run(
        _loader(tmp_path, saved, env, 4, 8, *dirs),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = _report(proc)
    assert report["errors"] == [] and report["warnings"] == [], report
    assert report["loads"] == report["fast"] == 32, report
    assert report["max_diff"] < 1e-4, report
    assert all(len(list(d.rglob("*.so"))) == 6 for d in dirs)
    assert _leftovers(*dirs) == []


def test_processes_and_threads_load_into_one_empty_kernel_dir(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """Three processes of four threads each load one file at once into one empty kernel
    directory: all take the lean path with eager's answers, no temporary file remains."""
    kernels = tmp_path / "kernels"
    env = no_compiler_env(tmp_path)
    env["TORCH_PRECOMPILE_KERNEL_DIR"] = str(kernels)
    cmd = _loader(tmp_path, saved, env, 1, 4)
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        reports.append(_report(subprocess.CompletedProcess(cmd, p.returncode, out, err)))
    for report in reports:
        assert report["errors"] == [] and report["warnings"] == [], report
        assert report["loads"] == report["fast"] == 4, report
        assert report["max_diff"] < 1e-4, report
    assert len(list(kernels.rglob("*.so"))) == 6
    assert _leftovers(kernels) == []


# ------------------------------------------------------------------ real faults


@contextlib.contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path``; the test is skipped only when mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _load_in_fresh_process(
    saved: dict[str, Path], root: Path, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    env = no_compiler_env(root)
    env.update(env_vars)
    return subprocess.run(
        _loader(root, saved, env, 1, 1), env=env, capture_output=True, text=True, timeout=300
    )


def _typed_failure(proc: subprocess.CompletedProcess[str], directory: Path, cause: str) -> None:
    report = _report(proc)
    assert report["loads"] == 0 and len(report["errors"]) == 1, report
    error = report["errors"][0]
    assert error.startswith("KernelDirectoryError: "), error
    assert str(directory) in error and cause in error, error
    assert "TORCH_PRECOMPILE_KERNEL_DIR" in error, error
    # No compiler exists in this process: a fallback would have failed differently.
    assert report["warnings"] == [], report


@pytest.mark.parametrize("path", ["fast", "full"])
def test_noexec_tmpdir_is_a_typed_error_and_the_env_var_fixes_it(
    saved: dict[str, Path], tmp_path: Path, path: str
) -> None:
    """A TMPDIR on a ``noexec`` mount: a typed error naming the directory, quickly and with
    no compile, on the fast and the full path; TORCH_PRECOMPILE_KERNEL_DIR then fixes it."""
    fast_load = {"fast": "1", "full": "0"}[path]
    with _tmpfs(tmp_path / "noexec", "noexec,size=16m,mode=1777") as mnt:
        start = time.perf_counter()
        proc = _load_in_fresh_process(
            saved, tmp_path, TMPDIR=str(mnt), TORCH_PRECOMPILE_LEAN=fast_load
        )
        _typed_failure(proc, mnt, "noexec")
        assert time.perf_counter() - start < 60
        proc = _load_in_fresh_process(
            saved,
            tmp_path,
            TMPDIR=str(mnt),
            TORCH_PRECOMPILE_LEAN=fast_load,
            TORCH_PRECOMPILE_KERNEL_DIR=str(tmp_path / "kernels"),
        )
        report = _report(proc)
        assert report["loads"] == 1 and report["max_diff"] < 1e-4, report
        assert report["fast"] == (path == "fast"), report


def test_full_kernel_dir_is_a_typed_error_without_partial_files(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    """A kernel directory on a full filesystem (a 16 KiB tmpfs): a typed error saying it is
    full, and no partial file left in it."""
    with _tmpfs(tmp_path / "tiny", "size=16k,mode=700") as mnt:
        proc = _load_in_fresh_process(saved, tmp_path, TORCH_PRECOMPILE_KERNEL_DIR=str(mnt))
        _typed_failure(proc, mnt, "full")
        assert _leftovers(mnt) == []
        assert not list(mnt.rglob("*.tmp"))


def test_read_only_kernel_dir_is_a_typed_error(saved: dict[str, Path], tmp_path: Path) -> None:
    """A kernel directory on a read-only mount: a typed error saying it is not writable."""
    with _tmpfs(tmp_path / "ro", "ro,mode=700") as mnt:
        proc = _load_in_fresh_process(saved, tmp_path, TORCH_PRECOMPILE_KERNEL_DIR=str(mnt))
        _typed_failure(proc, mnt, "not writable")


# ------------------------------------------------- faults made in this process


SECTION = {"0" * 64: b"not really a shared object"}  # the kernels of an artifact, by key


@pytest.fixture
def tmpdir_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system temp directory is ``tmp_path``; TORCH_PRECOMPILE_KERNEL_DIR is unset."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TORCH_PRECOMPILE_KERNEL_DIR", raising=False)
    return tmp_path


def test_kernel_dir_env_var_is_used(
    saved: dict[str, Path], tmpdir_here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCH_PRECOMPILE_KERNEL_DIR holds the kernels (made 0700 if missing); the default
    per-uid directory in the temp directory is not made; answers are eager's."""
    kernels = tmpdir_here / "mine" / "kernels"
    monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(kernels))
    io = torch.load(saved["io"])
    art = Precompile.load(saved["artifact"])
    with torch.no_grad():
        torch.testing.assert_close(art(io["ids"]), io["expected"], rtol=1e-4, atol=1e-4)
    assert len(list(kernels.rglob("*.so"))) == 6
    assert kernels.stat().st_mode & 0o777 == 0o700
    assert not list(tmpdir_here.glob("torch_precompile-*"))


def test_missing_kernel_dir_that_cannot_be_made(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCH_PRECOMPILE_KERNEL_DIR under a regular file: a typed error saying it is missing."""
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "kernels"
    monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(target))
    with pytest.raises(KernelDirectoryError, match="missing and cannot be made") as info:
        Precompile.load(saved["artifact"])
    assert str(tmp_path / "file") in str(info.value)


def test_per_uid_dir_writable_by_others_is_refused_without_a_new_dir(
    saved: dict[str, Path], tmpdir_here: Path
) -> None:
    """``$TMPDIR/torch_precompile-<uid>`` with mode 0777: a typed error naming it and its
    mode; no other directory is made in its place, however many loads try."""
    root = tmpdir_here / f"torch_precompile-{os.getuid()}"
    root.mkdir()
    root.chmod(0o777)
    before = sorted(os.listdir(tmpdir_here))
    for _ in range(3):
        with pytest.raises(KernelDirectoryError, match="0777 lets group or others write"):
            Precompile.load(saved["artifact"])
    assert sorted(os.listdir(tmpdir_here)) == before
    assert os.listdir(root) == []


def test_per_uid_dir_owned_by_another_user_is_refused_without_a_new_dir(
    saved: dict[str, Path], tmpdir_here: Path
) -> None:
    """``$TMPDIR/torch_precompile-<uid>`` owned by someone else (chown, as root): a typed
    error naming its owner; no directory is made per load."""
    if os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    root = tmpdir_here / f"torch_precompile-{os.getuid()}"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    before = sorted(os.listdir(tmpdir_here))
    for _ in range(3):
        with pytest.raises(KernelDirectoryError, match="belongs to uid 12345") as info:
            Precompile.load(saved["artifact"])
        assert str(root) in str(info.value)
    assert sorted(os.listdir(tmpdir_here)) == before


def test_per_uid_dir_that_is_a_symlink_is_refused(tmpdir_here: Path) -> None:
    """A symbolic link in place of the per-uid directory (even to a private directory)."""
    target = tmpdir_here / "elsewhere"
    target.mkdir(mode=0o700)
    (tmpdir_here / f"torch_precompile-{os.getuid()}").symlink_to(target)
    with pytest.raises(KernelDirectoryError, match="not a directory"):
        shipped.kernel_dir(SECTION)
    assert os.listdir(target) == []


def test_noexec_filesystem_fake(tmpdir_here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The noexec check reads the mount flags: a statvfs that reports ST_NOEXEC is refused
    (the same check as on a real mount, made where mounting is not permitted)."""
    real = os.statvfs

    class NoExec:
        def __init__(self, result: os.statvfs_result) -> None:
            self.f_flag = result.f_flag | os.ST_NOEXEC

    monkeypatch.setattr(os, "statvfs", lambda p: NoExec(real(p)))
    with pytest.raises(KernelDirectoryError, match="mounted noexec") as info:
        shipped.kernel_dir(SECTION)
    assert str(tmpdir_here) in info.value.directory


def test_shared_object_that_cannot_be_mapped_is_a_typed_error(tmp_path: Path) -> None:
    """dlopen refusing a shipped kernel (here: not an ELF file) is a typed error naming
    the file, not a fallback to compiling."""
    argtypes, source = ["float*"], 'extern "C" void kernel(float* x) {}'
    kernels = {shipped.kernel_key(argtypes, source): b"\x7fELF truncated"}
    loader = shipped.KernelLoader(kernels, str(tmp_path), "0")
    with pytest.raises(KernelDirectoryError, match="cannot be loaded") as info:
        loader.cpp_pybinding(argtypes, source)
    assert info.value.directory == str(tmp_path)


@pytest.mark.parametrize(
    ("err", "cause"),
    [(errno.ENOSPC, "full"), (errno.EDQUOT, "full"), (errno.EIO, "OSError")],
)
def test_write_failure_fake_removes_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, cause: str
) -> None:
    """A write that fails half way (ENOSPC as on a full disk, a quota, an I/O error): a
    typed error naming the directory and the cause; the partial file is removed and no
    kernel file appears."""
    real_fdopen = os.fdopen

    class Failing:
        def __init__(self, fd: int, mode: str) -> None:
            self.f = real_fdopen(fd, mode)

        def __enter__(self) -> Failing:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: Any) -> int:
            self.f.write(bytes(data[: len(data) // 2]))
            self.f.flush()
            raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "fdopen", Failing)
    with pytest.raises(KernelDirectoryError, match=cause) as info:
        shipped._materialize(str(tmp_path), "ab" * 32, memoryview(b"x" * 4096))
    assert info.value.directory == str(tmp_path)
    assert os.listdir(tmp_path) == []
    assert isinstance(info.value, PrecompileError)


def test_permission_denied_fake(tmpdir_here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory that cannot be made for lack of permission (as for a non-root user in
    a root-owned directory): a typed error saying it is not writable."""

    def refuse(path: Any, mode: int = 0o777, *a: Any, **k: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(KernelDirectoryError, match="not writable"):
        shipped.kernel_dir(SECTION)


def test_error_survives_pickling() -> None:
    """A KernelDirectoryError crosses process boundaries (multiprocessing) intact."""
    import pickle

    err = pickle.loads(pickle.dumps(KernelDirectoryError("/d", "it is full")))
    assert (err.directory, err.cause) == ("/d", "it is full") and "/d" in str(err)


def test_shipped_kernels_off_skips_the_fast_path(
    saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCH_PRECOMPILE_SHIPPED_KERNELS=0 (the way to ask for compiling) skips the fast
    path, which could only use the shipped kernels."""
    from torch_precompile.file.layout import open_regular
    from torch_precompile.file.opened import OpenedFile
    from torch_precompile.serialization import load as file_load

    path = str(saved["artifact"])
    with OpenedFile.open(path, open_regular(path), None) as file:
        assert file_load._load_lean(file, None, 0) is not None
        monkeypatch.setenv("TORCH_PRECOMPILE_SHIPPED_KERNELS", "0")
        assert file_load._load_lean(file, None, 0) is None


def test_prune_touches_only_kernel_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCH_PRECOMPILE_KERNEL_DIR may hold other things: pruning removes only stale
    directories named like ours (24 hex digits)."""
    monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    old = time.time() - shipped.KERNEL_DIR_MAX_AGE_S - 60
    stale, other = tmp_path / ("a" * 24), tmp_path / "projects"
    for d in (stale, other):
        d.mkdir()
        os.utime(d, (old, old))
    shipped.kernel_dir(SECTION)
    assert not stale.exists() and other.is_dir()


# ------------------------------------------------------ kernel files written ahead


def _elf(machine: int) -> bytes:
    """The first bytes of an ELF file for ``machine`` (64-bit, little-endian)."""
    head = bytearray(b"\x7fELF\x02\x01\x01" + bytes(9))
    head += (3).to_bytes(2, "little") + machine.to_bytes(2, "little")
    return bytes(head) + bytes(44)


def test_kernel_suffix_reads_the_elf_machine(saved: dict[str, Path]) -> None:
    """A CUDA ELF binary is a ``.cubin``; the artifact's real shared objects, and anything
    not ELF, are ``.so`` (as the loaders name them)."""
    from torch_precompile.file.layout import open_regular
    from torch_precompile.file.opened import OpenedFile

    path = str(saved["artifact"])
    with OpenedFile.open(path, open_regular(path), None) as file:
        suffixes = {shipped.kernel_suffix(file.kernels[key]) for key in file.kernels}
    assert suffixes == {".so"}
    assert shipped.kernel_suffix(_elf(shipped.EM_CUDA)) == ".cubin"
    assert shipped.kernel_suffix(_elf(62)) == ".so"  # x86-64
    assert shipped.kernel_suffix(b"\xcf\xfa\xed\xfe" + bytes(40)) == ".so"  # Mach-O


class _Counted(dict):
    """Kernels by key that count reads of their bytes, per thread; their digests and
    lengths known without a read, as a file's kernels are (``ShippedKernels``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reads: list[tuple[str, bool]] = []

    def __getitem__(self, key: str) -> Any:
        self.reads.append((key, threading.current_thread() is threading.main_thread()))
        return super().__getitem__(key)

    def sha256(self, key: str) -> str:
        return hashlib.sha256(dict.__getitem__(self, key)).hexdigest()

    def length(self, key: str) -> int:
        return len(dict.__getitem__(self, key))


def test_files_ahead_writes_every_kernel_once_and_the_loader_reads_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``files_ahead`` writes each kernel on its thread, with the suffix its loader uses
    and its exact bytes; ``kernel_file`` then reads no kernel. A second load into the same
    directory reads none either."""
    monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(tmp_path / "root"))
    cubin, so = _elf(shipped.EM_CUDA) + b"cubin", _elf(62) + b"shared object"
    kernels = _Counted({"a" * 64: cubin, "b" * 64: so})
    with shipped.files_ahead(kernels):
        pass
    assert sorted(kernels.reads) == [("a" * 64, False), ("b" * 64, False)]
    directory = shipped.kernel_dir(kernels)
    kernels.reads.clear()
    for key, suffix, data in (("a" * 64, ".cubin", cubin), ("b" * 64, ".so", so)):
        assert Path(shipped.kernel_file(directory, key, kernels, suffix)).read_bytes() == data
    assert sorted(os.listdir(directory)) == ["k" + "a" * 40 + ".cubin", "k" + "b" * 40 + ".so"]
    with shipped.files_ahead(kernels):
        pass
    assert kernels.reads == []


def test_files_ahead_fails_quietly_and_the_loader_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel directory that cannot be made: ``files_ahead`` raises nothing (the load
    goes on), and the loader's own call raises the typed error as before."""
    monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(tmp_path / "root"))

    def refuse(path: Any, mode: int = 0o777, *a: Any, **k: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(os, "mkdir", refuse)
    monkeypatch.setattr(os, "makedirs", refuse)
    kernels = {"a" * 64: _elf(62)}
    with shipped.files_ahead(kernels):
        pass
    with pytest.raises(KernelDirectoryError, match="not writable"):
        shipped.kernel_dir(kernels)


def test_a_load_writes_the_kernel_files_ahead(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lean load into an empty kernel directory: every shipped kernel's file is written
    by the load's writer thread (none by the graph's loader on the main thread, which
    waits here until the writer is done), and the answer is eager's."""
    monkeypatch.setenv("TORCH_PRECOMPILE_KERNEL_DIR", str(tmp_path / "root"))
    writers: list[str] = []
    real = shipped._materialize
    done = threading.Event()

    def materialize(*args: Any, **kwargs: Any) -> str:
        writers.append(threading.current_thread().name)
        return real(*args, **kwargs)

    real_files_ahead = shipped.files_ahead

    @contextlib.contextmanager
    def waited(kernels: Any) -> Iterator[None]:
        with real_files_ahead(kernels):
            deadline = time.monotonic() + 60
            while len(writers) < len(kernels) and time.monotonic() < deadline:
                time.sleep(0.01)
            done.set()
            yield

    monkeypatch.setattr(shipped, "_materialize", materialize)
    monkeypatch.setattr("torch_precompile.lean.files_ahead", waited)
    art = Precompile.load(saved["artifact"])
    io = torch.load(saved["io"])
    with torch.no_grad():
        assert torch.allclose(art(io["ids"]), io["expected"], atol=1e-4)
    assert done.is_set() and type(art.compiled_function).__name__ == "LeanCompiledFunction"
    assert len(writers) == 6 and set(writers) == {"torch_precompile-kernel-files"}, writers
