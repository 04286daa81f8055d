"""Deployment as users do it: models loaded from their saved directories, the
bindings of ``load(model=)`` checked at load, refusals that fit the case, and a
quiet save."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch

from tests.fixtures.library_models import SENTENCE_BATCHES, sentence_transformer
from torch_precompile import GuardError, Precompile
from torch_precompile.guards._source import MISSING, Source


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# ------------------------------------------------ SentenceTransformer from disk


@pytest.fixture(scope="module")
def st_saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A SentenceTransformer saved with ``.save(dir)``, read back with
    ``SentenceTransformer(dir)``, captured for ``encode`` and saved; the save's
    warnings and log records are kept."""
    import transformers
    from sentence_transformers import SentenceTransformer

    from torch_precompile.encoding import compile_for_encode

    root = tmp_path_factory.mktemp("st-disk")
    sentence_transformer(str(root / "base")).save(str(root / "saved"))
    model = SentenceTransformer(str(root / "saved"), device="cpu").eval()
    refs = [model.encode(batch, convert_to_tensor=True) for batch in SENTENCE_BATCHES]
    artifact = compile_for_encode(model, ["the cat sat", "a dog"])
    # The library's warnings are said once per process: make them sayable again.
    transformers.utils.logging.warning_once.cache_clear()
    records = _Records()
    loggers = [logging.getLogger(), logging.getLogger("transformers")]  # it does not propagate
    for logger in loggers:
        logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Precompile.save(root / "encoder.pt", artifact)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    return {
        "dir": str(root / "saved"),
        "path": str(root / "encoder.pt"),
        "refs": refs,
        "warnings": [str(w.message) for w in caught],
        "records": [(r.name, r.levelno, r.getMessage()) for r in records.records],
    }


@pytest.mark.parametrize("how", ["standalone", "model"])
def test_sentence_transformer_from_saved_directory(st_saved: dict[str, Any], how: str) -> None:
    """A model read from its saved directory (its ``module_kwargs`` an OrderedDict)
    encodes as eager does, from the file's weights and with ``model=``."""
    from sentence_transformers import SentenceTransformer

    from torch_precompile.encoding import encode_with

    model = SentenceTransformer(st_saved["dir"], device="cpu").eval()
    loaded = Precompile.load(st_saved["path"], model=model if how == "model" else None)
    with encode_with(model, loaded):
        for batch, want in zip(SENTENCE_BATCHES, st_saved["refs"]):
            got = model.encode(batch, convert_to_tensor=True)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_save_is_quiet(st_saved: dict[str, Any]) -> None:
    """Saving a transformers model raises no warning and logs nothing from the
    library (reading the config trips none of its deprecated properties)."""
    assert st_saved["warnings"] == []
    foreign = [r for r in st_saved["records"] if not r[0].startswith("torch_precompile")]
    assert foreign == [], foreign
    loud = [r for r in st_saved["records"] if r[1] >= logging.WARNING]
    assert loud == [], loud


class _Settings:
    """Holds a lambda: the file cannot carry it, so it leaves the object out."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.hook = lambda: scale


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Settings(2.0)
        self.second = _Settings(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.first.scale + self.second.scale


def test_save_names_each_attribute_left_out(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Save warns, naming each attribute a guard reads that the file cannot carry."""

    artifact = Precompile.compile(_Scaled(), (torch.randn(3),))
    with caplog.at_level(logging.WARNING, logger="torch_precompile"):
        Precompile.save(tmp_path_factory.mktemp("left-out") / "scaled.pt", artifact)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "first.scale" in text and "second.scale" in text, text


# ------------------------------------------------ load(model=) checked at load

_QWEN = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import transformers as T

    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(T.Qwen2Config(**_QWEN)).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        artifact = Precompile.compile(model, (ids,), {"use_cache": False})
    path = tmp_path_factory.mktemp("qwen") / "qwen.pt"
    Precompile.save(path, artifact)
    return {"path": str(path), "model": model, "ids": ids}


def test_same_architecture_is_bound(qwen_file: dict[str, Any]) -> None:
    model, ids = qwen_file["model"], qwen_file["ids"]
    loaded = Precompile.load(qwen_file["path"], model=model)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits
        )


def test_parameter_set_to_none_refused_at_load(qwen_file: dict[str, Any]) -> None:
    model = copy.deepcopy(qwen_file["model"])
    model.model.layers[0].self_attn.q_proj.bias = None
    with pytest.raises(GuardError, match=r"layers\.0\.self_attn\.q_proj\.bias"):
        Precompile.load(qwen_file["path"], model=model)


def test_parameter_of_other_dtype_refused_at_load(qwen_file: dict[str, Any]) -> None:
    model = copy.deepcopy(qwen_file["model"]).to(torch.float64)
    with pytest.raises(GuardError, match="dtype float64"):
        Precompile.load(qwen_file["path"], model=model)


def test_other_architecture_refused_at_load(qwen_file: dict[str, Any]) -> None:
    import transformers as T

    mistral = T.MistralForCausalLM(T.MistralConfig(**_QWEN)).eval()
    with pytest.raises(GuardError, match="not the model this artifact was captured from"):
        Precompile.load(qwen_file["path"], model=mistral)


# ------------------------------------------------ a bundle's refusal


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).relu()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A dynamic capture and its size-1 variant, bundled, saved and loaded."""
    with torch.no_grad():
        artifact = Precompile.compile(_Linear().eval(), (torch.randn(3, 4),), dynamic=True)
    assert len(artifact.variants) == 2
    path = tmp_path_factory.mktemp("bundle") / "bundle.pt"
    Precompile.save(path, artifact)
    return Precompile.load(path)


def _refusal(loaded: Any, x: Any) -> str:
    """The refusal's text; building it warns nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), pytest.raises(GuardError) as info:
            loaded(x)
    assert [str(w.message) for w in caught] == []
    return str(info.value)


def test_bundle_refusal_says_a_shared_failure_once(bundle: Any) -> None:
    text = _refusal(bundle, torch.randn(5, 4, dtype=torch.float64))
    assert text.count("expected dtype float32, got float64") == 1, text


def test_bundle_refusal_names_the_closest_variant(bundle: Any) -> None:
    """Batch 1 with 3 features: the size-1 variant differs in one dimension only."""
    text = _refusal(bundle, torch.randn(1, 3))
    assert "the closest, variant 1 " in text, text
    assert text.count("0/1 are specialised") <= 1, text


def test_bundle_refusal_gives_size_one_advice_only_for_sizes_0_1(bundle: Any) -> None:
    text = _refusal(bundle, torch.randn(5, 3))
    assert "dimension 1 must be in [4, 4]" in text, text
    assert "0/1 are specialised" not in text, text


def test_bundle_refusal_of_a_dict_is_quiet(bundle: Any) -> None:
    text = _refusal(bundle, {"x": torch.randn(5, 4)})
    assert "expected a tensor, got dict" in text, text


def test_reading_a_key_of_a_tensor_is_quiet() -> None:
    """A tensor where the capture saw a dict: the guard's read misses, silently."""
    source = Source.parse("L['batch']['input_ids']")
    assert source is not None
    with warnings.catch_warnings(record=True) as caught:  # an error would be swallowed
        warnings.simplefilter("always")
        assert source.resolve({"batch": torch.zeros(2, 3)}) is MISSING
    assert [str(w.message) for w in caught] == []


def test_hooks_left_by_transformers_are_explained(qwen_file: dict[str, Any]) -> None:
    """Eager ``generate(output_attentions=True)`` leaves transformers' output-capturing
    hooks on the layers; the refusal says where they come from and what to do."""
    model, ids = copy.deepcopy(qwen_file["model"]), qwen_file["ids"]
    model.config._attn_implementation = "eager"  # attentions need the eager kernel
    model.generate(
        ids[:1], max_new_tokens=1, do_sample=False, output_attentions=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    model.config._attn_implementation = "sdpa"  # as captured: only the hooks differ
    loaded = Precompile.load(qwen_file["path"], model=model)
    with torch.no_grad(), pytest.raises(GuardError, match="transformers installs") as info:
        loaded(ids, use_cache=False)
    assert "load with model= another instance" in str(info.value)


# ------------------------------------------------ diffusers parts from disk


@pytest.fixture(scope="module")
def unet_saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A UNet2DConditionModel written with ``save_pretrained`` and read back with
    ``from_pretrained`` given a ``pathlib.Path`` (its config keeps the path), captured and
    saved."""
    import diffusers

    from tests.fixtures.library_models import diffusers_model

    root = tmp_path_factory.mktemp("unet-disk")
    built, args = diffusers_model("unet_cond")
    built.save_pretrained(root / "unet")
    model = diffusers.UNet2DConditionModel.from_pretrained(root / "unet").eval()
    with torch.no_grad():
        artifact = Precompile.compile(model, args)
        want = model(*args).sample
    Precompile.save(root / "unet.pt", artifact)
    return {"dir": str(root / "unet"), "path": str(root / "unet.pt"), "args": args, "want": want}


@pytest.mark.parametrize("how", ["standalone", "model"])
def test_unet_from_saved_directory(unet_saved: dict[str, Any], how: str) -> None:
    import diffusers

    model = diffusers.UNet2DConditionModel.from_pretrained(unet_saved["dir"]).eval()
    loaded = Precompile.load(unet_saved["path"], model=model if how == "model" else None)
    with torch.no_grad():
        got = loaded(*unet_saved["args"]).sample
    torch.testing.assert_close(got, unet_saved["want"], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def pipeline_parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A pipeline's other parts as a deployment reads them: the VAE (its decoder
    serves) and a CLIP text encoder, each written with ``save_pretrained`` and read back
    with ``from_pretrained``, captured and saved."""
    import diffusers
    import transformers

    from tests.fixtures.library_models import diffusers_model

    root = tmp_path_factory.mktemp("parts-disk")
    _, vae_args = diffusers_model("vae_decoder")  # its latents; the VAE is built below
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
        latent_channels=4, norm_num_groups=4, sample_size=16,
    )  # fmt: skip
    vae.save_pretrained(root / "vae")
    torch.manual_seed(0)
    text = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
        )
    )
    text.save_pretrained(root / "text_encoder")
    ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    parts = {
        "vae_decoder": (
            lambda: diffusers.AutoencoderKL.from_pretrained(root / "vae").decoder.eval(),
            vae_args,
            lambda out: out,
        ),
        "text_encoder": (
            lambda: transformers.CLIPTextModel.from_pretrained(root / "text_encoder").eval(),
            (ids,),
            lambda out: out.last_hidden_state,
        ),
    }
    out = {}
    for name, (read, args, result) in parts.items():
        model = read()
        with torch.no_grad():
            artifact = Precompile.compile(model, args)
            want = result(model(*args))
        Precompile.save(root / f"{name}.pt", artifact)
        out[name] = {"read": read, "args": args, "result": result, "want": want,
                     "path": str(root / f"{name}.pt")}  # fmt: skip
    return out


@pytest.mark.parametrize("how", ["standalone", "model"])
@pytest.mark.parametrize("part", ["vae_decoder", "text_encoder"])
def test_pipeline_part_from_saved_directory(
    pipeline_parts: dict[str, Any], part: str, how: str
) -> None:
    case = pipeline_parts[part]
    model = case["read"]()  # a fresh read of the directory, as a serving process does
    loaded = Precompile.load(case["path"], model=model if how == "model" else None)
    with torch.no_grad():
        got = case["result"](loaded(*case["args"]))
    torch.testing.assert_close(got, case["want"], atol=1e-5, rtol=1e-5)
