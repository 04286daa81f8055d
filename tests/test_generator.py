"""compile_generator: a decoder language model's generator that serves itself.

Tiny random models (2 layers, width 64, 1000 tokens). Greedy tokens are
compared with transformers' own ``generate`` on the same weights; serving runs
in fresh processes where transformers cannot be imported, and checks that
neither it nor the compiler (Dynamo, Inductor's compiler, sympy) was imported.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import run_script  # noqa: E402

from tests.fixtures.bpe import byte_level_bpe  # noqa: E402
from tests.fixtures.hf_models import (  # noqa: E402
    assert_same_logits,
    assert_step_close,
    generator_families,
)
from torch_precompile import Precompile  # noqa: E402
from torch_precompile._errors import (  # noqa: E402
    ArtifactCorruptedError,
    CaptureError,
    GenerationLimitError,
    GuardError,
)
from torch_precompile.generation import compile_generator  # noqa: E402
from torch_precompile.runtime.generator import Generator  # noqa: E402
from torch_precompile.runtime.generator_spec import GeneratorSpec  # noqa: E402

MAX_BATCH, MAX_LENGTH = 4, 40
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
SMALL |= dict(vocab_size=1000, max_position_embeddings=128, initializer_range=0.5)
SMALL |= dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **SMALL))


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, initializer_range=0.5
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    return transformers.GPT2LMHeadModel(config)


def _tokenizer() -> Any:
    """A byte-level BPE trained here (no download), as a transformers fast tokenizer."""
    corpus = ["the cat sat on the mat", "a generator serves itself", "héllo wörld"] * 20
    tok = byte_level_bpe(corpus, 320, ["<pad>", "<bos>", "<eos>"])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _build(model: Any, path: Path, **kwargs: Any) -> dict[str, Any]:
    model.eval()
    records = _Records()
    logging.getLogger("torch_precompile").addHandler(records)
    try:
        generator = compile_generator(model, max_batch=MAX_BATCH, max_length=MAX_LENGTH, **kwargs)
    finally:
        logging.getLogger("torch_precompile").removeHandler(records)
    Precompile.save(path, generator)
    loaded = Precompile.load(path)
    return {"model": model, "path": path, "loaded": loaded, "warnings": records.messages, **kwargs}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("generator")
    torch.manual_seed(0)
    return {
        "gpt2": _build(_gpt2(), root / "gpt2.pt", tokenizer=_tokenizer()),
        # fused projections (views.py): every Llama test below runs them
        "llama": _build(_llama(), root / "llama.pt", fuse_projections=True),
    }


def _prompts(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts, row i left-padded by i * length // (batch + 1) tokens (id 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 1000, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):
        pad = i * length // (batch + 1)
        ids[i, :pad], mask[i, :pad] = 0, 0
    return ids, mask


def _hf(model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int, **kw: Any) -> torch.Tensor:
    kw = {"do_sample": False, "pad_token_id": 0, **kw}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, **kw)


_LOGITS = dict(return_dict_in_generate=True, output_logits=True, output_scores=True)


def _same_as_transformers(case: dict[str, Any], ids: Any, mask: Any, new: int, **kw: Any) -> Any:
    """The generator's and transformers' results (tokens, each step's logits and
    scores) agree; transformers' is returned."""
    want = _hf(case["model"], ids, mask, new, **kw, **_LOGITS)
    got = case["loaded"].generate(ids, mask, max_new_tokens=new, **kw, **_LOGITS)
    assert_same_logits(want, got, str(kw))
    for step, (w, g) in enumerate(zip(want.scores, got.scores)):
        assert_step_close(w, g, f"{kw} step {step} scores")
    return want


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize(
    ("batch", "length", "new"),
    [(1, 1, 8), (MAX_BATCH, 9, 10), (2, MAX_LENGTH - 5, 5), (3, 2, MAX_LENGTH - 2)],
)
def test_greedy_equals_transformers_generate(
    built: dict[str, dict[str, Any]], name: str, batch: int, length: int, new: int
) -> None:
    case = built[name]
    ids, mask = _prompts(batch, length)
    want = _same_as_transformers(case, ids, mask, new, eos_token_id=None).sequences
    assert len(set(want[:, length:].flatten().tolist())) > 3  # not one repeated token


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_end_of_sequence_and_min_new_tokens_as_transformers(
    built: dict[str, dict[str, Any]], name: str
) -> None:
    case = built[name]
    ids, mask = _prompts(3, 6, seed=1)
    free = _hf(case["model"], ids, mask, 12, eos_token_id=None)
    # An end token that row 1 makes at its 4th new token: it stops there and is
    # padded while the others go on; with min_new_tokens the token is barred.
    eos = int(free[1, 6 + 3])
    for extra in ({}, {"min_new_tokens": 6}):  # scores: the barred token at -inf
        _same_as_transformers(case, ids, mask, 12, eos_token_id=eos, **extra)
    # Every row ends: the result ends where the last one did, as generate's.
    first = free[:, 6 + 2].tolist()
    want = _same_as_transformers(case, ids, mask, 12, eos_token_id=first)
    assert want.sequences.shape[1] < 6 + 12, want.sequences


def _hf_warpers(mask: torch.Tensor, penalty: float, temperature: float, **kw: Any) -> Any:
    """transformers' own processors, in generate's order: the repetition penalty (left
    padding left out), then temperature, top-k, top-p and min-p."""
    g = transformers.generation.logits_process
    pad = (mask != 0).int().argmax(dim=1)
    return transformers.LogitsProcessorList(
        [
            g.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pad),
            g.TemperatureLogitsWarper(temperature),
            g.TopKLogitsWarper(kw["top_k"]),
            g.TopPLogitsWarper(kw["top_p"]),
            g.MinPLogitsWarper(kw["min_p"]),
        ]
    )


def test_sampled_scores_are_transformers_warped_logits(built: dict[str, dict[str, Any]]) -> None:
    """What a sampled generate draws from, at every step of a left-padded batch, is the
    model's logits through transformers' repetition penalty, temperature, top-k, top-p
    and min-p (its processors run on our sequences); the first step's equals
    transformers' generate's own; each drawn token is one the warpers kept. Greedy with
    the repetition penalty equals transformers' generate token for token."""
    case = built["llama"]
    ids, mask = _prompts(MAX_BATCH, 9, seed=4)
    warp = dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.03)
    got = case["loaded"].generate(
        ids,
        mask,
        max_new_tokens=8,
        do_sample=True,
        repetition_penalty=1.3,
        seed=3,
        eos_token_id=None,
        **warp,
        **_LOGITS,
    )
    reference = _hf_warpers(mask, 1.3, **warp)
    cuts = [0, 0, 0]  # steps where top-k, top-p, min-p each cut what the others kept
    for step, (logits, scores) in enumerate(zip(got.logits, got.scores)):
        sequences = got.sequences[:, : 9 + step]
        want = reference(sequences, logits.clone())
        assert torch.allclose(scores, want, atol=1e-5), (step, (scores - want).abs().max())
        drawn = got.sequences[:, 9 + step]
        assert torch.isfinite(scores.gather(1, drawn[:, None])).all(), step
        for i in range(3):
            rest = transformers.LogitsProcessorList(
                w for j, w in enumerate(reference) if j != 2 + i
            )
            cuts[i] += int(
                bool(
                    (torch.isfinite(rest(sequences, logits.clone())) != torch.isfinite(want)).any()
                )
            )
    assert all(cuts), cuts
    with torch.no_grad():
        hf = case["model"].generate(
            ids,
            attention_mask=mask,
            max_new_tokens=1,
            do_sample=True,
            pad_token_id=0,
            repetition_penalty=1.3,
            **warp,
            **_LOGITS,
        )
    assert_step_close(hf.scores[0], got.scores[0], "first step scores")
    _same_as_transformers(case, ids, mask, 10, eos_token_id=None, repetition_penalty=1.3)


def test_the_models_generation_config_is_the_default(
    built: dict[str, dict[str, Any]],
) -> None:
    """Settings a call leaves out are the model's generation_config's (recorded at build),
    else transformers' defaults (sampling: top_k 50), as transformers' generate."""
    from torch_precompile.generation.model_settings import sampling_fields as _sampling_fields

    case = built["llama"]
    model, loaded = case["model"], case["loaded"]
    ids, mask = _prompts(2, 6, seed=5)
    kept = model.generation_config
    try:
        model.generation_config = transformers.GenerationConfig(
            do_sample=True,
            temperature=0.6,
            top_k=10,
            top_p=0.9,
            repetition_penalty=1.2,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        own = _sampling_fields(model)
        assert dict(own) == dict(
            do_sample=True, temperature=0.6, top_k=10, top_p=0.9, repetition_penalty=1.2
        )
        spec = dataclasses.replace(loaded.spec, sampling=own)
        assert GeneratorSpec.from_json(json.loads(json.dumps(spec.to_json())), "x") == spec
        gen = Generator(loaded.step, spec)
        got = gen.generate(ids, mask, max_new_tokens=1, seed=1, **_LOGITS)
        with torch.no_grad():
            hf = model.generate(ids, attention_mask=mask, max_new_tokens=1, **_LOGITS)
        assert_step_close(hf.scores[0], got.scores[0], "first step scores")
        assert ((~torch.isinf(got.scores[0])).sum(-1) <= 10).all()
        # Asked for greedy: the model's repetition penalty stays, as transformers'.
        _same_as_transformers({**case, "loaded": gen}, ids, mask, 8, do_sample=False)
    finally:
        model.generation_config = kept
    # A model that sets nothing: sampling keeps transformers' top 50.
    got = loaded.generate(ids, mask, max_new_tokens=1, do_sample=True, seed=1, **_LOGITS)
    assert ((~torch.isinf(got.scores[0])).sum(-1) == 50).all()
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=True, **_LOGITS)
    assert_step_close(hf.scores[0], got.scores[0], "first step scores")
    # What the generator does not apply is named at build; what changes nothing is not.
    records = _Records()
    logging.getLogger("torch_precompile").addHandler(records)
    try:
        model.generation_config = transformers.GenerationConfig(
            no_repeat_ngram_size=3, num_beams=1, typical_p=1.0, top_p=0.9
        )
        assert _sampling_fields(model) == (("top_p", 0.9),)
    finally:
        logging.getLogger("torch_precompile").removeHandler(records)
        model.generation_config = kept
    assert len(records.messages) == 1 and "no_repeat_ngram_size=3" in records.messages[0]
    assert "num_beams" not in records.messages[0] and "typical_p" not in records.messages[0]
    # A record of a file from before: no settings of the model's.
    old = {k: v for k, v in loaded.spec.to_json().items() if k != "sampling"}
    assert GeneratorSpec.from_json(old, "x").sampling == ()
    with pytest.raises(ArtifactCorruptedError, match="not a generator record"):
        GeneratorSpec.from_json({**old, "sampling": {"beam": 4}}, "x")


def test_a_call_without_max_new_tokens_runs_as_long_as_transformers(
    built: dict[str, dict[str, Any]],
) -> None:
    """Left out, max_new_tokens is the model's generation_config's, else up to its
    max_length (the prompt included), else 20, as transformers' generate; a count the
    call did not ask for stops where the cache ends."""
    from torch_precompile.generation.model_settings import length_fields as _length_fields

    case = built["llama"]
    model, loaded = case["model"], case["loaded"]
    ids, mask = _prompts(2, 6, seed=6)
    kept = model.generation_config
    try:
        for config, new in (({"max_new_tokens": 5}, 5), ({"max_length": 13}, 7), ({}, 20)):
            model.generation_config = transformers.GenerationConfig(
                bos_token_id=1, eos_token_id=None, pad_token_id=0, **config
            )
            spec = dataclasses.replace(loaded.spec, lengths=_length_fields(model))
            assert dict(spec.lengths) == config
            assert GeneratorSpec.from_json(json.loads(json.dumps(spec.to_json())), "x") == spec
            gen = Generator(loaded.step, spec)
            got = gen.generate(ids, mask, do_sample=False, eos_token_id=None)
            with torch.no_grad():
                hf = model.generate(ids, attention_mask=mask, do_sample=False)
            assert got.shape == hf.shape == (2, 6 + new), (config, got.shape, hf.shape)
            assert torch.equal(got, hf), config
        # A prompt that reaches the model's max_length: refused, as transformers refuses it.
        model.generation_config = transformers.GenerationConfig(max_length=6, pad_token_id=0)
        spec = dataclasses.replace(loaded.spec, lengths=_length_fields(model))
        gen = Generator(loaded.step, spec)
        with pytest.raises(ValueError, match=r"max_length=6.*pass max_new_tokens"):
            gen.generate(ids, mask)
        with torch.no_grad(), pytest.raises(ValueError, match="max_length"):
            model.generate(ids, attention_mask=mask, do_sample=False)
        assert gen.generate(ids, mask, max_new_tokens=2, eos_token_id=None).shape == (2, 8)
    finally:
        model.generation_config = kept
    # More than the cache holds, not asked for: up to the cache's end; asked for: refused.
    spec = dataclasses.replace(loaded.spec, lengths=(("max_new_tokens", 99),))
    long = Generator(loaded.step, spec)
    assert long.generate(ids, mask, eos_token_id=None).shape == (2, MAX_LENGTH)
    with pytest.raises(GenerationLimitError, match="shorten"):
        long.generate(ids, mask, max_new_tokens=99)
    # A record of a file from before: no lengths of the model's; a bad one is refused.
    old = {k: v for k, v in loaded.spec.to_json().items() if k != "lengths"}
    assert GeneratorSpec.from_json(old, "x").lengths == ()
    with pytest.raises(ArtifactCorruptedError, match="not a generator record"):
        GeneratorSpec.from_json({**old, "lengths": {"max_length": -1}}, "x")


def test_top_k_1_is_greedy_and_a_streamer_sees_each_step(
    built: dict[str, dict[str, Any]],
) -> None:
    gen = built["llama"]["loaded"]
    ids, mask = _prompts(MAX_BATCH, 7, seed=2)
    greedy = gen.generate(ids, mask, max_new_tokens=9, eos_token_id=None)
    seen: list[torch.Tensor] = []
    sampled = gen.generate(
        ids,
        mask,
        max_new_tokens=9,
        do_sample=True,
        top_k=1,
        temperature=0.7,
        seed=5,
        eos_token_id=None,
        streamer=seen.append,
    )
    assert torch.equal(sampled, greedy)
    assert torch.equal(torch.stack(seen, 1), greedy[:, 7:])


def test_past_the_limits_a_typed_error_before_any_kernel(
    built: dict[str, dict[str, Any]],
) -> None:
    gen: Generator = built["gpt2"]["loaded"]
    calls: list[int] = []
    gen._loop = lambda *a, **k: calls.append(1)  # type: ignore[method-assign]  # the steps' entry
    try:
        with pytest.raises(GenerationLimitError, match=r"max_batch=4.*split the batch"):
            gen.generate(torch.ones((MAX_BATCH + 1, 3), dtype=torch.long), max_new_tokens=2)
        with pytest.raises(GenerationLimitError, match=r"max_length=40.*shorten"):
            gen.generate(torch.ones((1, MAX_LENGTH - 3), dtype=torch.long), max_new_tokens=4)
        with pytest.raises(ValueError, match="repetition_penalty must be above 0"):
            gen.generate(torch.ones((1, 3), dtype=torch.long), repetition_penalty=0.0)
        with pytest.raises(ValueError, match="min_p must be in"):
            gen.generate(torch.ones((1, 3), dtype=torch.long), do_sample=True, min_p=1.5)
        with pytest.raises(ValueError, match="pad on the left"):
            gen.generate(torch.ones((2, 3), dtype=torch.long), torch.tensor([[1, 1, 1], [1, 1, 0]]))
    finally:
        del gen._loop
    assert calls == []


_SERVE = """
import sys
sys.modules["transformers"] = None  # not importable here
import json
import torch
from torch_precompile import Precompile

cases = json.loads(sys.argv[1])
out = {}
for name, case in cases.items():
    gen = Precompile.load(case["path"])
    ids, mask = torch.tensor(case["ids"]), torch.tensor(case["mask"])
    greedy = gen.generate(ids, mask, max_new_tokens=case["new"], eos_token_id=None)
    sampled = gen.generate(
        ids, mask, max_new_tokens=case["new"], do_sample=True, temperature=0.9, top_k=50,
        top_p=0.9, seed=11, eos_token_id=None,
    )
    out[name] = {"type": type(gen).__name__, "greedy": greedy.tolist(), "sampled": sampled.tolist()}
out["imported"] = [
    m for m in ("transformers", "torch._dynamo", "torch._inductor.compile_fx", "sympy")
    if sys.modules.get(m) is not None
]
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_loaded_generator_saved_again_gives_the_same_logits(
    built: dict[str, dict[str, Any]], name: str, tmp_path: Path
) -> None:
    """Load, save, load: the model's config travels as the stand-in it was loaded as
    (before, the second file's guards missed the config's values and refused every
    call), and the second file generates the first's tokens and logits."""
    first = built[name]["loaded"]
    Precompile.save(tmp_path / "again.pt", first)
    again = Precompile.load(tmp_path / "again.pt")
    ids, mask = _prompts(MAX_BATCH, 7, seed=11)
    want = first.generate(ids, mask, max_new_tokens=6, eos_token_id=None, **_LOGITS)
    got = again.generate(ids, mask, max_new_tokens=6, eos_token_id=None, **_LOGITS)
    assert torch.equal(want.sequences, got.sequences)
    for step, (w, g) in enumerate(zip(want.logits, got.logits)):
        assert torch.equal(w, g), (step, (w - g).abs().max())


def test_a_prompt_sliced_from_a_wider_tensor_is_served_as_a_fresh_one(
    built: dict[str, dict[str, Any]],
) -> None:
    """``tokens[:, :n]`` has the wider tensor's strides, even for one row (whose
    ``is_contiguous()`` is then True); the steps' guards were captured on fresh
    tensors and refused it (GuardError on the first call). Now one row and several
    rows of such a slice give the fresh prompt's tokens and logits."""
    loaded = built["llama"]["loaded"]
    for batch in (1, MAX_BATCH):
        ids, mask = _prompts(batch, 7, seed=13)
        wide_ids = torch.zeros((batch, 19), dtype=ids.dtype)
        wide_mask = torch.zeros((batch, 19), dtype=mask.dtype)
        wide_ids[:, :7], wide_mask[:, :7] = ids, mask
        sliced, sliced_mask = wide_ids[:, :7], wide_mask[:, :7]
        assert sliced.stride() == (19, 1) and sliced.is_contiguous() == (batch == 1)
        want = loaded.generate(ids, mask, max_new_tokens=4, eos_token_id=None, **_LOGITS)
        got = loaded.generate(sliced, sliced_mask, max_new_tokens=4, eos_token_id=None, **_LOGITS)
        assert torch.equal(want.sequences, got.sequences), batch
        for step, (w, g) in enumerate(zip(want.logits, got.logits)):
            assert torch.equal(w, g), (batch, step, (w - g).abs().max())


def test_the_prefill_alone_runs_outside_cuda_graphs(
    built: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``mode="reduce-overhead"`` each layout of a step is recorded into a CUDA
    graph with its own memory, and every prompt length is another layout of the
    prefill (lean/cudagraphs.py): the generator runs its prefill, and only it, in
    ``not_recorded``; each decode step is left to its recording."""
    from torch_precompile.lean import cudagraphs
    from torch_precompile.runtime.generator import Generator

    loaded = built["llama"]["loaded"]
    calls: list[tuple[bool, int]] = []
    loop = Generator._loop

    def spied(self: Any, fixed: Any) -> Any:
        run = loop(self, fixed)

        def call(*moving: Any) -> Any:
            calls.append((cudagraphs._NOT_RECORDED.get(), moving[0].shape[1]))
            return run(*moving)

        return call

    monkeypatch.setattr(Generator, "_loop", spied)
    ids, mask = _prompts(2, 9, seed=3)
    loaded.generate(ids, mask, max_new_tokens=4, eos_token_id=None)
    assert calls == [(True, 9), (False, 1), (False, 1), (False, 1)]


def test_serves_without_transformers_or_the_compiler_and_a_seed_reproduces(
    built: dict[str, dict[str, Any]],
) -> None:
    cases, want = {}, {}
    for i, name in enumerate(("gpt2", "llama")):
        ids, mask = _prompts(MAX_BATCH, 8, seed=3 + i)
        want[name] = _hf(built[name]["model"], ids, mask, 10, eos_token_id=None).tolist()
        cases[name] = {
            "path": str(built[name]["path"]),
            "ids": ids.tolist(),
            "mask": mask.tolist(),
            "new": 10,
        }
    runs = [json.loads(run_script(_SERVE, json.dumps(cases)).stdout.splitlines()[-1])]
    runs.append(json.loads(run_script(_SERVE, json.dumps(cases)).stdout.splitlines()[-1]))
    for out in runs:
        assert out["imported"] == [], out["imported"]
        for name in cases:
            assert out[name]["type"] == "Generator"
            assert out[name]["greedy"] == want[name], name
    for name in cases:  # the same seed, the same tokens, in another process
        assert runs[0][name]["sampled"] == runs[1][name]["sampled"], name
        assert runs[0][name]["sampled"] != want[name], name


_CLI = """
import sys
sys.modules["transformers"] = None
from torch_precompile.cli.main import main
code = main(sys.argv[1:])
imported = [
    m for m in ("transformers", "torch._dynamo", "torch._inductor.compile_fx", "sympy")
    if sys.modules.get(m) is not None
]
print("IMPORTED", imported, "tokenizers" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def test_cli_prints_text_with_only_tokenizers_beside_torch(
    built: dict[str, dict[str, Any]],
) -> None:
    case = built["gpt2"]
    tokenizer = case["tokenizer"]
    prompt = "the cat sat"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    want = _hf(case["model"], ids, torch.ones_like(ids), 7)
    text = tokenizer.backend_tokenizer.decode(want[0].tolist())
    path = str(case["path"])
    proc = run_script(_CLI, "generate", path, "--prompt", prompt, "--max-new-tokens", "7")
    assert proc.stdout == text + "\n", (proc.stdout, text)
    assert "IMPORTED [] True" in proc.stderr, proc.stderr
    proc = run_script(_CLI, "generate", path, "--ids", "5,6,7", "--max-new-tokens", "3")
    ids = torch.tensor([[5, 6, 7]])
    want = _hf(case["model"], ids, torch.ones_like(ids), 3)
    assert proc.stdout.strip() == ",".join(str(t) for t in want[0].tolist())
    # Past max_length: a one-line error and exit status 1, nothing printed before it.
    command = [sys.executable, "-m", "torch_precompile", "generate", path, "--ids", "5,6,7"]
    long = subprocess.run(
        [*command, "--max-new-tokens", str(MAX_LENGTH)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert long.returncode == 1 and long.stdout == "", (long.stdout, long.stderr)
    assert "max_length=40" in long.stderr and "shorten" in long.stderr, long.stderr
    # A token id past the vocabulary: one line, no traceback.
    bad = subprocess.run([*command, "--ids", "5,6000"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "6000" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    # inspect shows the generator's spec first, as text and as JSON.
    shown = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "inspect", path], capture_output=True, text=True
    )
    assert shown.stdout.splitlines()[0] == (
        f"generator: gpt2, max_batch {MAX_BATCH}, max_length {MAX_LENGTH}, float32 on cpu"
    ), shown.stdout[:300]
    assert "eos_token_id 2, pad_token_id 0, tokenizer inside" in shown.stdout.splitlines()[1]
    assert "sampling defaults (the model's generation_config): none" in shown.stdout, shown.stdout
    assert "new tokens when a call does not say: 20 (transformers')" in shown.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "torch_precompile", "inspect", "--json", path],
        capture_output=True,
        text=True,
    )
    data = json.loads(shown.stdout)
    assert next(iter(data)) == "generator", list(data)
    assert data["generator"] == {
        "max_batch": MAX_BATCH, "max_length": MAX_LENGTH, "eos_token_id": [2],
        "pad_token_id": 0, "dtype": "float32", "device": "cpu", "model_type": "gpt2",
        "tokenizer": True, "sampling": {}, "lengths": {}, "weights": {"format": "float32"},
    }  # fmt: skip


def test_cli_text_escapes_control_characters_and_keeps_lines() -> None:
    from torch_precompile.cli.text import terminal_text

    assert (
        terminal_text("red \x1b[31mtext\u202e\nnext\tline")
        == "red \\x1b[31mtext\\u202e\nnext\tline"
    )


def test_float_ids_and_an_empty_row_are_refused_before_any_kernel(
    built: dict[str, dict[str, Any]],
) -> None:
    gen: Generator = built["llama"]["loaded"]
    calls: list[int] = []
    gen._loop = lambda *a, **k: calls.append(1)  # type: ignore[method-assign]  # the steps' entry
    try:
        with pytest.raises(TypeError, match=r"dtype torch.float32.*integers"):
            gen.generate(torch.tensor([[157.7, 3.0]]), max_new_tokens=2)
        ids = torch.ones((2, 3), dtype=torch.long)
        with pytest.raises(ValueError, match=r"all zeros in row\(s\) \[1\]"):
            gen.generate(ids, torch.tensor([[1, 1, 1], [0, 0, 0]]), max_new_tokens=2)
    finally:
        del gen._loop
    assert calls == []


def test_threads_sharing_a_generator_each_get_their_own_result(
    built: dict[str, dict[str, Any]],
) -> None:
    gen: Generator = built["llama"]["loaded"]
    calls = [
        (_prompts(1 + (t + c) % MAX_BATCH, 3 + (5 * t + c) % 9, seed=100 + 5 * t + c), 4 + c)
        for t in range(8)
        for c in range(5)
    ]
    alone = [
        gen.generate(ids, mask, max_new_tokens=n, eos_token_id=None) for (ids, mask), n in calls
    ]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for c in range(5):
                (ids, mask), n = calls[5 * t + c]
                results[5 * t + c] = gen.generate(ids, mask, max_new_tokens=n, eos_token_id=None)
        except BaseException as exc:  # reported below, with the thread's result
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert errors == [] and len(results) == len(calls), errors
    for i, want in enumerate(alone):
        assert torch.equal(results[i], want), (i, results[i], want)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_decode_loop_checks_the_guards_once_a_layout_and_still_sees_torchs_state(
    built: dict[str, dict[str, Any]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's guard checks do not grow with its steps (runtime/loop.py); its logits
    are those of a loop that checks every step; a change of torch's state between two
    steps (a streamer setting the default dtype) is refused as at any call."""
    from torch_precompile.lean.guards import LeanGuards

    gen: Generator = built[name]["loaded"]
    checks: list[int] = []
    check = LeanGuards.check

    def counted(self: LeanGuards, f_locals: dict[str, Any]) -> bool:
        checks.append(1)
        return check(self, f_locals)

    monkeypatch.setattr(LeanGuards, "check", counted)
    ids, mask = _prompts(2, 5, seed=21)
    counts = []
    for new in (3, 3, 20):  # the first call after another caller's may try more variants
        checks.clear()
        once = gen.generate(ids, mask, max_new_tokens=new, eos_token_id=None, **_LOGITS)
        counts.append(len(checks))
    assert 0 < counts[1] == counts[2], counts  # a check a step: 17 more

    def every_step(fixed: Any) -> Any:
        return lambda *moving: gen.run_step(*moving, *fixed)

    monkeypatch.setattr(gen, "_loop", every_step)
    checks.clear()
    every = gen.generate(ids, mask, max_new_tokens=20, eos_token_id=None, **_LOGITS)
    assert len(checks) >= 20
    assert torch.equal(once.sequences, every.sequences)
    for step, (a, b) in enumerate(zip(once.logits, every.logits)):
        assert torch.equal(a, b), step
    monkeypatch.undo()

    steps: list[int] = []

    def streamer(token: torch.Tensor) -> None:
        steps.append(1)
        if len(steps) == 3:
            torch.set_default_dtype(torch.float64)

    dtype = torch.get_default_dtype()
    try:
        with pytest.raises(GuardError, match="default dtype"):
            gen.generate(ids, mask, max_new_tokens=8, streamer=streamer)
    finally:
        torch.set_default_dtype(dtype)
    assert len(steps) == 3
    again = gen.generate(ids, mask, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(again, once.sequences)


_MOE = """
import sys
sys.modules["transformers"] = None  # not importable here: nor its registered operators
import torch
from torch_precompile import Precompile

case = torch.load(sys.argv[2])
out = Precompile.load(sys.argv[1]).generate(
    case["ids"], case["mask"], max_new_tokens=case["new"], eos_token_id=None,
    return_dict_in_generate=True, output_logits=True,
)
torch.save({"sequences": out.sequences, "logits": out.logits}, sys.argv[3])
"""


def test_a_mixture_of_experts_serves_without_transformers(tmp_path: Path) -> None:
    from types import SimpleNamespace

    torch.manual_seed(0)
    case = _build(generator_families()["mixtral"](), tmp_path / "mixtral.pt")
    ids, mask = _prompts(3, 7, seed=9)
    want = _hf(case["model"], ids, mask, 6, eos_token_id=None, **_LOGITS)
    torch.save({"ids": ids, "mask": mask, "new": 6}, tmp_path / "case.pt")
    run_script(_MOE, str(case["path"]), str(tmp_path / "case.pt"), str(tmp_path / "out.pt"))
    got = SimpleNamespace(**torch.load(tmp_path / "out.pt"))
    assert_same_logits(want, got, "mixtral served without transformers")


def test_an_operator_torch_does_not_provide_is_refused_at_build() -> None:
    @torch.library.custom_op("gen43test::silu", mutates_args=())
    def silu(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x)

    silu.register_fake(lambda x: torch.empty_like(x))

    class LibrarySiLU(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.gen43test.silu(x)

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": 1, "num_key_value_heads": 2})
    ).eval()
    model.model.layers[0].mlp.act_fn = LibrarySiLU()
    with pytest.raises(CaptureError, match=r"gen43test::silu.*torch does not provide"):
        compile_generator(model, max_batch=2, max_length=16)


def _matmuls(model: Any, ids: torch.Tensor) -> int:
    """The matmuls of ``model``'s inference graph as the generator hands it to Inductor."""
    from torch_precompile import _compat

    with torch.no_grad():
        joint = Precompile.aot_autograd(Precompile.dynamo(model, (ids,)))
    graph = _compat.without_duplicates(joint.joint_graph).graph
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return sum(node.target in matmuls for node in graph.nodes)


def test_fused_projections_are_one_matmul_a_group_and_the_same_function() -> None:
    from torch_precompile.generation.views import FusedPart, fused_projections

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(  # q/k/v with a bias; gate/up without
        transformers.Qwen2Config(num_key_value_heads=2, **SMALL)
    ).eval()
    view, groups = fused_projections(model)
    layers = SMALL["num_hidden_layers"]
    assert groups == 2 * layers
    attention, mlp = view.model.layers[0].self_attn, view.model.layers[0].mlp
    assert isinstance(attention.q_proj, FusedPart) and isinstance(mlp.up_proj, FusedPart)
    assert attention.q_proj.weight is attention.v_proj.weight  # tied: a file holds it once
    assert attention.k_proj.out_features == model.model.layers[0].self_attn.k_proj.out_features
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # model unchanged
    assert view.lm_head is model.lm_head  # what is not fused is shared
    ids = torch.randint(3, 1000, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(view(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    # q/k/v, o, gate/up, down a layer and the head: 4 * layers + 1 matmuls, from 7 * layers + 1
    assert (_matmuls(view, ids), _matmuls(model, ids)) == (4 * layers + 1, 7 * layers + 1)


def _warm_up_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("torch_precompile-warm-up")]


def _set_after(event: threading.Event, seconds: float) -> None:
    time.sleep(seconds)
    event.set()


def test_the_prefill_runs_beside_the_warm_up_and_every_other_step_after_it(
    built: dict[str, dict[str, Any]],
) -> None:
    """A loaded generator's warm-up threads (``beside``) may still run when load
    returns: ``generate``'s prefill, which records no CUDA graph, goes on beside them;
    its first decode step, ``run_step``, ``loop``, the raw step and ``step`` wait for them."""
    loaded = built["llama"]["loaded"]
    ids, mask = _prompts(1, 5, seed=9)
    want = loaded.generate(ids, mask, max_new_tokens=3, eos_token_id=None)
    prefill_done, warm_done = threading.Event(), threading.Event()

    def warm_up_until_the_prefill_ends() -> None:
        prefill_done.wait(timeout=20)  # were the prefill to wait for this thread: 20 s
        time.sleep(0.2)
        warm_done.set()

    beside = threading.Thread(target=warm_up_until_the_prefill_ends)
    beside.start()
    generator = Generator(loaded.step, loaded.spec, beside=[beside])
    seen: list[bool] = []

    def put(token: torch.Tensor) -> None:
        seen.append(warm_done.is_set())
        prefill_done.set()

    got = generator.generate(ids, mask, max_new_tokens=3, eos_token_id=None, streamer=put)
    assert seen == [False, True, True]  # the prefill beside it, each decode step after
    assert torch.equal(got, want)

    for call in ("run_step", "loop", "__call__", "step"):
        done = threading.Event()
        beside = threading.Thread(target=_set_after, args=(done, 0.2))
        beside.start()
        generator = Generator(loaded.step, loaded.spec, beside=[beside])
        cache = [t[:1] for t in generator.cache()]
        if call == "loop":
            generator.loop(cache)
        elif call == "step":
            assert generator.step is loaded.step
        else:
            full = torch.zeros((1, loaded.spec.max_length), dtype=torch.long)
            full[:, :5] = 1
            start = torch.zeros((), dtype=torch.long)
            with torch.no_grad():
                getattr(generator, call)(ids, full, torch.arange(5)[None], start, *cache)
        assert done.is_set(), call


def test_the_warm_up_beside_a_load_changes_no_result_and_a_failure_only_logs(
    built: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The device's lazy set-up (runtime/warm.py) runs by default on CUDA only (not
    on the CPU); here it is allowed on the CPU: it runs the libraries and the decode
    loop, greedy and sampled, on its stand-in (two threads), the loaded generator
    waits for them, and its logits are the first load's. A warm-up that fails
    logs why and the load goes on; a failed load waits for it too;
    TORCH_PRECOMPILE_WARM_UP=0 turns it off."""
    from torch_precompile import file as container
    from torch_precompile.file.sections import WEIGHTS
    from torch_precompile.runtime import warm

    case = built["llama"]
    ids, mask = _prompts(MAX_BATCH, 7, seed=5)
    want = case["loaded"].generate(ids, mask, max_new_tokens=5, eos_token_id=None, **_LOGITS)
    records = logging.getLogger("torch_precompile")
    seen: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    records.addHandler(handler)
    level = records.level
    records.setLevel(logging.DEBUG)
    monkeypatch.delenv("TORCH_PRECOMPILE_WARM_UP", raising=False)
    try:
        Precompile.load(case["path"])
        assert seen == []  # a CPU generator is not warmed
        monkeypatch.setattr(warm, "WARMED", ("cpu",))
        loaded = Precompile.load(case["path"])  # on by default where warmed
        loaded.settle()
        assert _warm_up_threads() == []
        assert sorted(m.split(": ")[0] for m in seen) == [
            "generator warm-up (libraries) on cpu",
            "generator warm-up (loop) on cpu",
        ]
        assert all(k in " ".join(seen) for k in ("'libraries'", "'greedy'", "'sampled'"))
        got = loaded.generate(ids, mask, max_new_tokens=5, eos_token_id=None, **_LOGITS)
        assert torch.equal(want.sequences, got.sequences)
        for step, (w, g) in enumerate(zip(want.logits, got.logits)):
            assert torch.equal(w, g), (step, (w - g).abs().max())

        def fails(*args: Any) -> None:
            raise RuntimeError("CUDA error: out of memory")

        warm_libraries = warm._libraries
        monkeypatch.setattr(warm, "_libraries", fails)
        seen.clear()
        again = Precompile.load(case["path"])
        again.settle()
        stopped = "generator warm-up (libraries) on cpu stopped: RuntimeError: CUDA error: out"
        assert len(seen) == 2 and f"{stopped} of memory" in seen, seen
        assert torch.equal(
            again.generate(ids, mask, max_new_tokens=5, eos_token_id=None), got.sequences
        )

        monkeypatch.setattr(warm, "_libraries", warm_libraries)
        data = bytearray(Path(case["path"]).read_bytes())
        with container.open_artifact(case["path"]) as reader:
            entry = next(s for s in reader.info.sections if s["name"] == WEIGHTS)
            data[reader.info.data_start + entry["offset"] + entry["length"] // 2] ^= 0x40
        (tmp_path / "flipped.pt").write_bytes(bytes(data))
        seen.clear()
        with pytest.raises(ArtifactCorruptedError):
            Precompile.load(tmp_path / "flipped.pt")
        assert _warm_up_threads() == [] and len(seen) == 2, seen

        monkeypatch.setenv("TORCH_PRECOMPILE_WARM_UP", "0")
        seen.clear()
        Precompile.load(case["path"])
        assert not [m for m in seen if "warm-up" in m]
    finally:
        records.removeHandler(handler)
        records.setLevel(level)
