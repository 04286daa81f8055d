"""Precompile.load: standalone, bound to a live module, torch's own files."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import package_warnings

from tests.fixtures.models import build_transformer
from torch_precompile import ArtifactCorruptedError, GuardError, Precompile, PrecompiledArtifact
from torch_precompile import file as container
from torch_precompile.cli.main import header as inspect_header
from torch_precompile.runtime.signature import CallSignature


@pytest.fixture(scope="module")
def loaded(staged) -> PrecompiledArtifact:
    return Precompile.load(staged.path)


def test_loaded_artifact_matches_eager(staged, loaded) -> None:
    assert isinstance(loaded, PrecompiledArtifact)
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)


def test_loaded_artifact_keeps_guards_and_metadata(staged, loaded) -> None:
    assert str(loaded.guards) == str(staged.artifact.guards)
    assert loaded.signature == staged.artifact.signature
    assert loaded.sizes["weights"] > 0 and "load" in loaded.timings
    with (
        torch.no_grad(),
        pytest.raises(
            GuardError, match=r"input 'ids': expected shape \(2, 32\), got \(2, 31\); capture with"
        ),
    ):
        loaded(staged.example[:, :31])


def test_standalone_weights_are_the_saved_ones(staged, loaded) -> None:
    saved = dict(loaded.named_parameters())
    for name, p in staged.model.named_parameters():
        torch.testing.assert_close(saved[name], p, rtol=0, atol=0)
        assert saved[name].data_ptr() != p.data_ptr()


def test_standalone_weights_are_64_byte_aligned(loaded) -> None:
    """Each weight starts on a 64-byte boundary, as eager's (and the compiling
    process's) do."""
    tensors = [*loaded.parameters(), *loaded.buffers()]
    assert tensors
    assert [t.data_ptr() % 64 for t in tensors] == [0] * len(tensors)


def test_model_binding_uses_the_live_modules_current_weights(staged) -> None:
    model, (ids,), _ = build_transformer()
    with torch.no_grad():
        model.head.weight.mul_(0.5)
        bound = Precompile.load(staged.path, model=model)
        torch.testing.assert_close(bound(ids), model(ids))
        assert bound.module is model


def test_a_mesh_for_a_file_that_is_not_distributed_is_ignored_with_a_warning(staged) -> None:
    with package_warnings() as messages:
        loaded = Precompile.load(staged.path, mesh=object())
    assert any("not a distributed artifact; mesh= is ignored" in m for m in messages), messages
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)


def test_model_binding_with_an_incompatible_module_is_a_guard_error(staged) -> None:
    from tests.fixtures.models import TinyTransformer

    other = TinyTransformer(d_model=128).eval()
    with pytest.raises(  # refused at load: the first call would fail on it
        GuardError,
        match=r"model= is not the model this artifact was captured from: parameter "
        r"'tok_emb\.weight' has shape \(1000, 128\), the captured model's \(1000, 256\)",
    ):
        Precompile.load(staged.path, model=other)


def test_torch_save_compiled_function_files_load_with_model(tmp_path) -> None:
    def scaled(x, y):
        return torch.nn.functional.gelu(x) @ y

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    torch._dynamo.config.enable_aot_compile = True
    fn = torch.compile(scaled, fullgraph=True).aot_compile(((x, y), {}))
    path = tmp_path / "torch_native.bin"
    fn.save_compiled_function(str(path))
    loaded = Precompile.load(path)
    torch.testing.assert_close(loaded(x, y), scaled(x, y))


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_torch_files_of_modules_need_model(tmp_path) -> None:
    model = _Tiny().eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        fn = torch.compile(model, fullgraph=True).forward.aot_compile(((x,), {}))
    path = tmp_path / "torch_module.bin"
    fn.save_compiled_function(str(path))
    with pytest.raises(TypeError, match="model=your_module"):
        Precompile.load(path)
    loaded = Precompile.load(path, model=model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_not_an_artifact_is_a_corrupted_error(tmp_path) -> None:
    path = tmp_path / "junk.pt"
    path.write_bytes(b"definitely not an artifact" * 10)
    with pytest.raises(ArtifactCorruptedError):
        Precompile.load(path)
    torch.save({"a": torch.randn(3)}, tmp_path / "weights.pt")
    with pytest.raises(ArtifactCorruptedError):
        Precompile.load(tmp_path / "weights.pt")


class _PytreeLeaf(torch.nn.Module):
    """Traced code that asks pytree whether its input is a leaf: Dynamo guards on
    ``torch.utils._pytree.SUPPORTED_NODES``, a registry it reaches by import."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        if torch.utils._pytree.tree_is_leaf(x):
            x = x + 1
        return self.fc(x)


class _WeightNormed(torch.nn.Module):
    """A weight_norm parametrization: its module's class refuses to be pickled."""

    def __init__(self) -> None:
        super().__init__()
        conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.conv = torch.nn.utils.parametrizations.weight_norm(conv, dim=2)

    def forward(self, x):
        return self.conv(x).relu()


@pytest.mark.parametrize(
    "model_cls, shape", [(_PytreeLeaf, (2, 4)), (_WeightNormed, (2, 4, 8))], ids=["pytree", "wn"]
)
def test_modules_dynamo_guards_specially_save_and_load(tmp_path, model_cls, shape) -> None:
    """Guards on an import-rooted registry are not saved (they would not even
    unpickle outside a trace); a parametrized module is saved as a plain one."""
    torch.manual_seed(0)
    model = model_cls().eval()
    x = torch.randn(*shape)
    with torch.no_grad():
        art = Precompile.compile(model, (x,))
    path = tmp_path / "model.pt2"
    Precompile.save(path, art)
    loaded = Precompile.load(path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    with torch.no_grad(), pytest.raises(GuardError):
        loaded(torch.randn(3, *shape[1:]))


def test_signature_record_is_the_header_signature(staged, loaded) -> None:
    """The typed record writes the header's ``signature`` object and reads it back."""
    meta, _ = container.read_artifact(staged.path)
    on_disk = meta["variants"][0]["signature"]
    assert on_disk == staged.artifact.signature.to_dict() == loaded.signature.to_dict()
    assert list(on_disk) == [
        "parameters",
        "signature",
        "outputs",
        "graph_inputs",
        "symbol_sources",
        "output_structure",
        "output_layouts",
    ]
    assert loaded.signature.graph_inputs == staged.dynamo.input_sources
    assert loaded.signature.text.startswith("(self, ids")
    # What torch's own files, an unbound example call or another version wrote, as it was.
    for old in ({"signature": "(x)"}, {"args": [], "kwargs": {}, "later": 1}):
        assert CallSignature.from_dict(old).to_dict() == old


def _as_version_1(src: Path, dst: Path) -> None:
    """Rewrite a current file as format version 1 wrote it: a flat header, one nested
    ``kernels`` section (``u64 L | JSON {key: [offset, length]} | bytes``), no header
    digest."""
    meta, sections = container.read_artifact(src)
    (variant,) = meta["variants"]
    old = {k: meta[k] for k in ("producer", "created", "kind", "device_type", "system")}
    old.update({k: variant[k] for k in ("training", "grad_enabled", "signature", "guards")})
    old.update({k: variant[k] for k in ("timings", "external_refs")})
    old.update(guards_text=meta["guards_text"], sizes=meta["sizes"], cudagraphs=False)
    old["globals"] = {"module": meta["globals_module"], "names": meta["global_names"]}
    old["fast_load_refusal"] = variant["lean_refusal"]  # version 1's names (also version 2's)
    for name in [n for n in sections if n.split(".")[0] == "lean"]:
        sections["fastload" + name[len("lean") :]] = sections.pop(name)
    kernels = {n[len("kernel/") :]: sections.pop(n) for n in list(sections) if "kernel/" in n}
    index, offset = {}, 0
    for key, data in kernels.items():
        index[key] = [offset, len(data)]
        offset += len(data)
    head = json.dumps(index).encode()
    sections["kernels"] = struct.pack("<Q", len(head)) + head + b"".join(kernels.values())
    table, offset = [], 0
    for name, data in sections.items():
        table.append(
            {
                "name": name,
                "offset": offset,
                "length": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
        offset += len(data)
    header = json.dumps({"meta": old, "sections": table}).encode()
    payload = b"".join(sections.values())
    total = 32 + len(header) + len(payload) + 32
    body = struct.pack("<8sIIQQ", b"TPCOMPL\0", 1, 0, len(header), total) + header + payload
    dst.write_bytes(body + hashlib.sha256(body).digest())


def test_a_version_1_file_still_loads(staged, tmp_path) -> None:
    """A file of the previous format version (flat header, nested kernels section) loads
    as it did, by the lean path, and saving it again writes the current version."""
    old = tmp_path / "v1.pt"
    _as_version_1(staged.path, old)
    assert inspect_header(str(old))["format_version"] == 1
    loaded = Precompile.load(old)
    assert type(loaded.compiled_function).__name__ == "LeanCompiledFunction"  # its kernels read
    assert str(loaded.guards) == str(staged.artifact.guards)
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)
    again = tmp_path / "again.pt"
    Precompile.save(again, loaded)
    assert container.read_info(again).format_version == container.FORMAT_VERSION
    written = container.read_artifact(again)[0]["variants"][0]["signature"]
    assert written == container.read_artifact(old)[0]["signature"]  # version 1: at the top
    with torch.no_grad():
        torch.testing.assert_close(Precompile.load(again)(staged.example), staged.expected)


def test_load_with_model_reads_no_weights(staged) -> None:
    """Decide from the header, read only what is needed: bound to a live model, the
    file's weights are never read (its module skeleton is, to check the model), nor is
    PyTorch's serialization (the lean path runs without it)."""
    from torch_precompile.file.trace import recording

    with recording() as trace:
        bound = Precompile.load(staged.path, model=staged.model)
    with torch.no_grad():
        torch.testing.assert_close(bound(staged.example), staged.expected)
    read = trace.names("read")
    assert {"skeleton", "lean"} <= read and not {"weights", "compiled"} & read


def test_no_cyclic_collection_runs_while_a_file_loads(staged) -> None:
    """The collector waits until the load's objects are built (each pass walked all of
    them), and is left as the caller had it: on, or off."""
    import gc
    import sys

    from torch_precompile.serialization import load as load_module

    collections: list[int] = []
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase != "start":
            return
        seen.append(info["generation"])
        frame = sys._getframe(1)
        while frame is not None:  # inside the load's reading and rebuilding?
            if frame.f_code is load_module._load.__code__:
                collections.append(info["generation"])
                return
            frame = frame.f_back

    gc.callbacks.append(record)
    try:
        loaded = Precompile.load(staged.path)
        assert collections == [] and gc.isenabled()
        gc.disable()
        try:
            Precompile.load(staged.path)
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(record)
    with torch.no_grad():
        torch.testing.assert_close(loaded(staged.example), staged.expected)
    gc.collect()
    assert seen  # the callback sees collections: the check above can fail


def test_loads_on_two_threads_keep_the_collector_off_until_both_end() -> None:
    """Loads that overlap (a server loading on two threads) share the pause: the first
    to end does not turn the collector back on under the other."""
    import gc
    import threading

    from torch_precompile.file.collector import no_cyclic_gc

    entered, release = threading.Barrier(2), threading.Event()
    states: list[bool] = []

    def second() -> None:
        with no_cyclic_gc():
            entered.wait()
            release.wait(timeout=60)

    assert gc.isenabled()
    thread = threading.Thread(target=second)
    with no_cyclic_gc():
        thread.start()
        entered.wait(timeout=60)
        states.append(gc.isenabled())  # both inside
    states.append(gc.isenabled())  # the first ended, the second still inside
    release.set()
    thread.join(timeout=60)
    states.append(gc.isenabled())  # both ended
    assert states == [False, False, True]
