"""The stand-in module tree: what a saved model's attributes become after load."""

from __future__ import annotations

import enum
import functools
import json
import threading

import pytest
import torch

from torch_precompile.lean.standin import module as _standin
from torch_precompile.lean.standin.config import ConfigStandIn


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Options:
    """Options kept in slots, not a ``__dict__`` (pickle can carry them)."""

    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __getstate__(self) -> tuple[None, dict[str, float]]:
        return None, {"scale": self.scale}


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.options = Options(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.options.scale


def _round_trip(module: torch.nn.Module) -> torch.nn.Module:
    skeleton = json.loads(json.dumps(_standin.describe_module(module)))  # as in the file
    tensors = _standin.unpack_tensors(_standin.pack_tensors(_standin.module_tensors(module)))
    return _standin.build_standin(skeleton, tensors)


def test_attributes_of_every_encodable_kind_come_back_equal() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    model.id2label = {0: "neg", 1: "pos"}  # int keys survive (JSON alone would make them str)
    model.shape = (2, (3, None), [1.5, True])
    model.tags = frozenset({"a", "b"})
    model.dtype_ = torch.bfloat16
    model.where = torch.device("cpu")
    model.norm_layer = functools.partial(torch.nn.LayerNorm, eps=1e-6)
    model.mode = Mode.SLOW
    model.act = torch.nn.functional.gelu
    rebuilt = _round_trip(model)
    for name in ("id2label", "shape", "tags", "dtype_", "where", "norm_layer", "mode", "act"):
        got, want = getattr(rebuilt, name), getattr(model, name)
        if isinstance(want, functools.partial):
            assert (got.func, got.args, got.keywords) == (want.func, want.args, want.keywords)
        else:
            assert got == want and type(got) is type(want), name
    torch.testing.assert_close(getattr(rebuilt, "0").weight, model[0].weight)


def test_shared_objects_stay_shared_and_tied_weights_stay_tied() -> None:
    config = {"hidden": 3, "layers": [1, 2]}
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[1].weight = model[0].weight
    model.config = config
    model[0].config = config
    model[1].config = config
    rebuilt = _round_trip(model)
    assert rebuilt.config == config
    assert rebuilt.config is getattr(rebuilt, "0").config is getattr(rebuilt, "1").config
    assert getattr(rebuilt, "0").weight is getattr(rebuilt, "1").weight


def test_library_config_is_a_stand_in_that_answers_as_the_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)
    model = torch.nn.Linear(2, 2)
    model.config = config
    rebuilt = _round_trip(model).config
    assert isinstance(rebuilt, ConfigStandIn) and not isinstance(rebuilt, type(config))
    assert vars(rebuilt) == vars(config)  # the instance state, value for value
    # Class attributes, properties and GPT-2's aliases answer as the config does.
    for name in ("return_dict", "num_hidden_layers", "hidden_size", "model_type", "attribute_map"):
        assert getattr(rebuilt, name) == getattr(config, name), name
    for name in ("is_causal", "vision_feature_layer", "n_embd", "no_such_name"):
        assert hasattr(rebuilt, name) == hasattr(config, name), name
    # A method needs the real class: reading one turns the stand-in into the config.
    assert rebuilt.to_dict() == config.to_dict()
    assert type(rebuilt) is type(config)
    # Also when the read skips __getattr__, as torch 2.11's guards do with
    # object.__getattribute__(config, "get_text_config"): the stand-in was refused.
    other = _round_trip(model).config
    assert isinstance(other, ConfigStandIn)
    method = object.__getattribute__(other, "get_text_config")
    assert method.__self__ is other and type(other) is type(config)
    assert method().to_dict() == config.get_text_config().to_dict()


def test_unencodable_attributes_are_left_out_without_breaking_the_rest() -> None:
    model = torch.nn.Linear(2, 2)
    model.lock = threading.Lock()  # no way to carry it
    model.closure = lambda x: x  # a local function: not importable by name
    model.kept = {"a": 1}
    model.also = {"lock": threading.Lock()}  # a container with one bad value
    rebuilt = _round_trip(model)
    assert rebuilt.kept == {"a": 1}
    for name in ("lock", "closure", "also"):
        assert not hasattr(rebuilt, name), name


def test_version_1_skeletons_still_load() -> None:
    skeleton = {
        "modules": {
            "": {
                "attrs": {"n": ["int", 4], "pair": ["tuple", [1, [2, 3]]], "names": ["list", [1]]},
                "params": {},
                "buffers": {},
                "children": [],
            }
        }
    }
    rebuilt = _standin.build_standin(skeleton, {})
    assert (rebuilt.n, rebuilt.pair, rebuilt.names) == (4, (1, (2, 3)), [1])


def test_save_says_when_the_stand_in_cannot_serve_and_load_with_model_does(
    tmp_path: object,
) -> None:
    """An attribute the compiled code read but the file cannot carry (an object that
    keeps its state in slots) is named at save; a standalone load
    refuses with a GuardError naming it; ``load(model=)`` serves eager's answer."""
    from conftest import package_warnings

    from torch_precompile import GuardError, Precompile

    model = Scaled().eval()
    x = torch.randn(2, 4)
    path = tmp_path / "scaled.pt2"  # type: ignore[operator]
    with torch.no_grad():
        artifact = Precompile.compile(model, (x,))
        with package_warnings() as warnings:
            Precompile.save(path, artifact)
        want = model(x)
    assert any("without model=" in w and "options.scale" in w for w in warnings), warnings
    with torch.no_grad(), pytest.raises(GuardError, match=r"options\.scale"):
        Precompile.load(path)(x)
    with torch.no_grad():
        torch.testing.assert_close(Precompile.load(path, model=model)(x), want)
