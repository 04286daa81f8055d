"""Training artifacts: joint forward+backward compiled by Inductor, saved and trained from.

Each model is captured once (module-scoped fixtures) with grad enabled, which
makes a training artifact, and saved. The tests check that outputs carry
``grad_fn``, that the compiled backward gives eager's gradients (parameters
and inputs), that BatchNorm's running statistics update on the bound model,
that a fresh process follows eager's loss curve for 20 AdamW and SGD steps,
that a standalone load trains through ``artifact.parameters()``, that grad-mode
mismatches raise ``GuardError`` naming the artifact to build, and that dropout
trains while an eval-mode capture equals eager.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import no_compiler_env  # noqa: E402

from tests.fixtures.models import (  # noqa: E402
    build_convnet,
    build_dropout_mlp,
    build_dropout_mlp_train,
    build_transformer,
    image_inputs,
)
from torch_precompile import GuardError, Precompile  # noqa: E402
from torch_precompile import file as container  # noqa: E402

RTOL = 1e-4
STEPS = 20
CONV_BATCH = 8  # BatchNorm statistics of 2 images make AdamW's trajectory chaotic


@dataclasses.dataclass
class Case:
    """One training capture: its builder, example inputs, captured model, artifact and file."""

    name: str
    build: Callable[[], torch.nn.Module]
    args: tuple[Any, ...]
    model: torch.nn.Module
    aot: Any
    inductor: Any
    artifact: Any
    path: Path


def _transformer() -> torch.nn.Module:
    return build_transformer()[0].train()


def _convnet() -> torch.nn.Module:
    return build_convnet()[0].train()


def _capture(
    name: str, build: Callable[[], torch.nn.Module], args: tuple[Any, ...], tmp: Path
) -> Case:
    model = build()
    assert torch.is_grad_enabled()
    d = Precompile.dynamo(model, args)
    a = Precompile.aot_autograd(d)
    i = Precompile.inductor(a)
    art = Precompile.precompile(i)
    path = tmp / f"{name}.pt2"
    Precompile.save(path, art, d.bytecode, i.guards)
    return Case(name, build, args, model, a, i, art, path)


@pytest.fixture(scope="module")
def transformer(tmp_path_factory: pytest.TempPathFactory) -> Case:
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 32))
    return _capture("transformer", _transformer, (ids,), tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> Case:
    torch.manual_seed(1)
    # The input requires grad, so the joint graph also computes the input's gradient.
    x = image_inputs(batch=CONV_BATCH).requires_grad_(True)
    return _capture("convnet", _convnet, (x,), tmp_path_factory.mktemp("train"))


@pytest.fixture(params=["transformer", "convnet"])
def case(request: pytest.FixtureRequest) -> Case:
    return request.getfixturevalue(request.param)


def _loss(out: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """A loss computed outside the artifact, on its output (fixed random targets)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _fresh_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)


def _grads(model: torch.nn.Module, args: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    out = {name: p.grad for name, p in model.named_parameters()}
    out.update({f"input{i}": a.grad for i, a in enumerate(args) if a.requires_grad})
    return out


def _assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert g is not None, name
        assert got[name] is not None, f"no gradient reached {name}"
        torch.testing.assert_close(
            got[name], g, rtol=RTOL, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def _eager_step(
    build: Callable[[], torch.nn.Module], args: tuple[Any, ...]
) -> tuple[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    model = build()
    args = _fresh_inputs(args)
    out = model(*args)
    _loss(out).backward()
    return model, out.detach(), _grads(model, args)


# ------------------------------------------------------------------ in process


def test_stages_build_a_training_artifact(case: Case) -> None:
    assert case.artifact.training
    assert case.aot.training and "tangents" in case.aot.joint_graph.code  # the joint graph
    assert set(case.inductor.source_code) == {"forward", "backward"}
    assert case.inductor.source_code["backward"].strip()
    assert "training" in repr(case.artifact)
    autograd = [g for g in case.artifact.guards.by_phase("aot_autograd") if g.kind == "autograd"]
    assert autograd and autograd[0].training is True


@pytest.mark.parametrize("source", ["built", "loaded"])
def test_in_process_gradients_equal_eager(case: Case, source: str) -> None:
    if source == "built":  # the artifact precompile() returned, bound to the captured model
        model, art = case.model, case.artifact
        model.load_state_dict(case.build().state_dict())
        model.zero_grad(set_to_none=True)
    else:  # the saved file, loaded in this process
        model = case.build()
        art = Precompile.load(case.path, model=model)
    args = _fresh_inputs(case.args)
    out = art(*args)
    # The compiled backward (AOTAutograd's CompiledFunction), not eager autograd.
    assert out.grad_fn is not None and "CompiledFunction" in type(out.grad_fn).__name__
    _loss(out).backward()
    eager_model, eager_out, eager_grads = _eager_step(case.build, case.args)
    torch.testing.assert_close(out.detach(), eager_out, rtol=RTOL, atol=1e-5)
    _assert_grads_equal(_grads(model, args), eager_grads)
    # Buffers the forward mutates (BatchNorm in train mode) update on the bound model as in eager.
    for (name, b), (_, e) in zip(model.named_buffers(), eager_model.named_buffers()):
        torch.testing.assert_close(b, e, rtol=RTOL, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_convnet_batchnorm_statistics_update_on_bound_model(convnet: Case) -> None:
    model = convnet.build()
    eager = copy.deepcopy(model)
    before = {n: b.clone() for n, b in model.named_buffers()}
    art = Precompile.load(convnet.path, model=model)
    for _ in range(3):
        args = _fresh_inputs(convnet.args)
        art(*args)
        eager(*_fresh_inputs(convnet.args))
    assert int(model.bn1.num_batches_tracked) == 3
    for (name, b), (_, e) in zip(model.named_buffers(), eager.named_buffers()):
        assert not torch.equal(b, before[name]), f"{name} was not updated"
        torch.testing.assert_close(b, e, rtol=RTOL, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # The kernels were built for train-mode BatchNorm: eval() on the bound model is refused.
    model.eval()
    with pytest.raises(GuardError, match=r"bn1\.training.*capture again"):
        art(*_fresh_inputs(convnet.args))
    assert int(model.bn1.num_batches_tracked) == 3


def test_gradients_accumulate_like_eager(transformer: Case) -> None:
    model = transformer.build()
    art = Precompile.load(transformer.path, model=model)
    eager = transformer.build()
    for _ in range(2):
        _loss(art(*transformer.args)).backward()
        _loss(eager(*transformer.args)).backward()
    _assert_grads_equal(_grads(model, ()), _grads(eager, ()))


def test_standalone_load_trains_through_parameters(transformer: Case) -> None:
    art = Precompile.load(transformer.path)
    eager = transformer.build()
    names = [n for n, _ in art.named_parameters()]
    assert names == [n for n, _ in eager.named_parameters()]
    params = list(art.parameters())
    assert params and all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in params)
    opt = torch.optim.SGD(art.parameters(), lr=0.05, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    losses, eager_losses = [], []
    for step in range(5):
        for fn, o, out_losses in ((art, opt, losses), (eager, eager_opt, eager_losses)):
            o.zero_grad()
            loss = _loss(fn(*transformer.args), seed=step % 2)
            loss.backward()
            o.step()
            out_losses.append(loss.item())
    _assert_grads_equal({n: p.grad for n, p in art.named_parameters()}, _grads(eager, ()))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=RTOL, atol=0)
    assert losses[-1] < losses[0] * 0.9


def test_training_artifact_under_no_grad_raises(transformer: Case) -> None:
    with torch.no_grad(), pytest.raises(GuardError, match="training artifact") as info:
        transformer.artifact(*transformer.args)
    assert "torch.no_grad()" in str(info.value) and "inference artifact" in str(info.value)


def test_input_requires_grad_mismatch_raises(convnet: Case) -> None:
    x = convnet.args[0].detach()
    with pytest.raises(GuardError, match="requires_grad"):
        convnet.artifact(x)


# ----------------------------------------------------------- fresh process

_CURVES = r"""
import json, sys
import torch
import torch.nn.functional as F
from tests.fixtures.models import build_convnet, build_transformer, image_inputs
import torch._inductor.compile_fx as compile_fx
from torch._inductor.graph import GraphLowering
from torch_precompile import Precompile


def _no_compile(*args, **kwargs):
    raise SystemExit("Inductor compiled after load; both graphs must come from the file")


# Both graphs were compiled ahead of time: a lazily compiled backward would land here.
for _name in ("compile_fx_inner", "_compile_fx_inner", "compile_fx_forward", "compile_fx_backward"):
    setattr(compile_fx, _name, _no_compile)
GraphLowering.codegen = _no_compile

STEPS, CONV_BATCH = int(sys.argv[3]), int(sys.argv[4])
paths = {"transformer": sys.argv[1], "convnet": sys.argv[2]}
builders = {"transformer": build_transformer, "convnet": build_convnet}

def batches(name):
    g = torch.Generator().manual_seed(3)
    if name == "transformer":
        ids = [torch.randint(0, 1000, (2, 32), generator=g) for _ in range(8)]
        return list(zip(ids[::2], ids[1::2]))
    labels = [torch.randint(0, 10, (CONV_BATCH,), generator=g) for _ in range(4)]
    return [(image_inputs(batch=CONV_BATCH).requires_grad_(True), y) for y in labels]

def optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)

def train(name, kind, who, steps=STEPS):
    model = builders[name]()[0].train()
    if who == "standalone":  # no model: the artifact's own weights, through parameters()
        fn = Precompile.load(paths[name])
        model = fn.module
    else:
        fn = Precompile.load(paths[name], model=model) if who == "artifact" else model
    opt = optimizer(kind, fn.parameters())
    use_artifact = who != "eager"
    torch.manual_seed(4)
    data = batches(name)
    losses, first_grads, first_state = [], None, None
    for step in range(steps):
        x, y = data[step % len(data)]
        x = x.detach().requires_grad_(x.requires_grad)
        out = fn(x)
        if use_artifact and out.grad_fn is None:
            sys.exit("the loaded artifact returned an output without grad_fn")
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if x.requires_grad:
                first_grads["input"] = x.grad.clone()
        opt.step()
        if first_state is None:
            first_state = {n: t.detach().clone() for n, t in model.state_dict().items()}
        losses.append(loss.item())
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return losses, first_grads, first_state, state

result, tensors = {}, {}
for name in ("transformer", "convnet"):
    for kind in ("adamw", "sgd"):
        for who in ("artifact", "eager"):
            losses, grads, first_state, state = train(name, kind, who)
            result[f"{name}/{kind}/{who}"] = losses
            tensors[f"{name}/{kind}/{who}"] = {"grads": grads, "first": first_state, "last": state}
result["transformer/sgd/standalone"] = train("transformer", "sgd", "standalone", steps=5)[0]
torch.save(tensors, sys.argv[5])
print(json.dumps(result))
"""


def _run(source: str, *argv: str, timeout: int = 600, env: dict[str, str] | None = None) -> str:
    script = Path(argv[-1]).with_suffix(".py")
    script.write_text(textwrap.dedent(source))
    if env is None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(script), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


def test_fresh_process_training_follows_eager(
    transformer: Case, convnet: Case, tmp_path: Path
) -> None:
    """20 AdamW and SGD steps on artifacts loaded with model= in a new interpreter.

    The interpreter has no C++ compiler and an empty Inductor cache: the
    forward and backward kernels come from the files.
    """
    tensors_path = tmp_path / "curves.pt"
    out = _run(
        _CURVES,
        str(transformer.path),
        str(convnet.path),
        str(STEPS),
        str(CONV_BATCH),
        str(tensors_path),
        env=no_compiler_env(tmp_path),
    )
    curves = json.loads(out.strip().splitlines()[-1])
    tensors = torch.load(tensors_path)
    for name in ("transformer", "convnet"):
        for kind in ("adamw", "sgd"):
            got, want = curves[f"{name}/{kind}/artifact"], curves[f"{name}/{kind}/eager"]
            assert len(got) == STEPS
            for step, (a, e) in enumerate(zip(got, want)):
                assert abs(a - e) <= RTOL * abs(e), (
                    f"{name} {kind} step {step}: loss {a} vs eager {e}"
                )
            assert min(got) < got[0], f"{name} {kind}: the loss never fell ({got})"
            art_t, eager_t = tensors[f"{name}/{kind}/artifact"], tensors[f"{name}/{kind}/eager"]
            _assert_grads_equal(art_t["grads"], eager_t["grads"])
            if name == "convnet":
                assert "input" in art_t["grads"]
                _assert_batchnorm_tracks_eager(art_t, eager_t)
    # Loaded without model=: an optimizer on artifact.parameters() follows eager too.
    standalone = curves["transformer/sgd/standalone"]
    torch.testing.assert_close(
        torch.tensor(standalone),
        torch.tensor(curves["transformer/sgd/eager"][:5]),
        rtol=RTOL,
        atol=0,
    )


def test_without_shipped_kernels_training_load_needs_a_compiler(
    transformer: Case, tmp_path: Path
) -> None:
    """The control: the same file and environment with the shipped kernels turned off."""
    _, sections = container.read_artifact(transformer.path)
    # Shipped kernels (and "lean", since lean training); the env var turns both off.
    assert any(name.startswith("kernel/") for name in sections)
    env = no_compiler_env(tmp_path)
    env["TORCH_PRECOMPILE_SHIPPED_KERNELS"] = "0"
    script = tmp_path / "control.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            from torch_precompile import Precompile
            art = Precompile.load({str(transformer.path)!r})
            art(torch.randint(0, 1000, (2, 32))).sum().backward()
            print("RAN")
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode != 0 and "RAN" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "InvalidCxxCompiler" in proc.stderr, proc.stderr[-2000:]


def _assert_batchnorm_tracks_eager(art: dict[str, Any], eager: dict[str, Any]) -> None:
    """BatchNorm's running statistics, updated on the bound model by the compiled forward."""
    keys = [k for k in eager["first"] if "running" in k or "num_batches" in k]
    assert len(keys) == 6
    for key in keys:
        # After one step both runs computed with identical weights: the update matches eager's.
        torch.testing.assert_close(art["first"][key], eager["first"][key], rtol=RTOL, atol=1e-6)
    for key in keys:
        if "num_batches" in key:
            assert int(art["last"][key]) == int(eager["last"][key]) == STEPS
        else:
            # After 20 steps the weights themselves differ by float rounding that AdamW
            # amplifies (a near-zero gradient's sign flips an lr-sized update), so the
            # statistics computed from them agree only loosely.
            assert not torch.equal(art["last"][key], art["first"][key])
            torch.testing.assert_close(art["last"][key], eager["last"][key], rtol=0.05, atol=5e-3)


# ------------------------------------------------------------------- dropout


@dataclasses.dataclass
class DropoutCase:
    train_artifact: Any
    eval_artifact: Any
    eval_model: torch.nn.Module
    x: torch.Tensor
    train_source: str
    eval_source: str


@pytest.fixture(scope="module")
def dropout() -> DropoutCase:
    train_model, (x,), _ = build_dropout_mlp_train()
    train_compiled = Precompile.inductor(Precompile.aot_autograd(Precompile.dynamo(train_model, x)))
    eval_model, _, _ = build_dropout_mlp()
    with torch.no_grad():
        eval_compiled = Precompile.inductor(
            Precompile.aot_autograd(Precompile.dynamo(eval_model, x))
        )
    return DropoutCase(
        Precompile.precompile(train_compiled),
        Precompile.precompile(eval_compiled),
        eval_model,
        x,
        "\n".join(train_compiled.source_code.values()),
        "\n".join(eval_compiled.source_code.values()),
    )


def test_dropout_training_artifact_trains(dropout: DropoutCase) -> None:
    art = dropout.train_artifact
    assert art.training
    a, b = art(dropout.x), art(dropout.x)
    assert not torch.equal(a, b), "dropout masks must differ between calls"
    torch.manual_seed(5)
    c = art(dropout.x)
    torch.manual_seed(5)
    torch.testing.assert_close(art(dropout.x), c, rtol=0, atol=0)  # masks follow torch's seed
    target = torch.randint(0, 10, (dropout.x.shape[0],), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(art.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(art(dropout.x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_dropout_eval_capture_equals_eager(dropout: DropoutCase) -> None:
    assert not dropout.eval_artifact.training
    # In eval mode dropout is the identity: the compiled code draws no random numbers.
    assert "normalized_rand_cpu" in dropout.train_source
    assert "normalized_rand_cpu" not in dropout.eval_source
    x = torch.randn_like(dropout.x)
    with torch.no_grad():
        want = dropout.eval_model(x)
        got = dropout.eval_artifact(x)
        again = dropout.eval_artifact(x)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    # Not bitwise: Inductor's fused GELU kernel rounds differently from eager's (about
    # one float32 ulp); dropout itself adds no difference.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_inference_artifact_with_grad_raises(dropout: DropoutCase) -> None:
    with pytest.raises(GuardError, match="inference artifact") as info:
        dropout.eval_artifact(dropout.x)
    message = str(info.value)
    assert "requires grad" in message and "training artifact" in message
