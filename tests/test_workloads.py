"""Workloads, not single calls: compile leaves the caller's objects alone,
a forward's first-call state is served, dynamic artifacts serve size 1, and
``model.generate`` runs on one artifact, in a fresh process, equal to eager."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.fixtures import generation_files
from tests.fixtures.hf_models import tiny_decoder
from tests.fixtures.store import Store
from torch_precompile import Precompile

T = pytest.importorskip("transformers")

VOCAB = 1000


class _State:
    pass


class _Writes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, state: _State) -> torch.Tensor:
        h = self.lin(x)
        state.h = h
        self.last = h
        return h * 2


class _Lazy(torch.nn.Module):
    """Builds a table on its first call (as rotary caches and lazy buffers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(8.0) * 2
        return self.lin(x) + self.table


def test_compile_leaves_attributes_and_inputs_alone() -> None:
    model, state, x = _Writes(), _State(), torch.randn(2, 8)
    state.h = None
    with torch.no_grad():
        artifact = Precompile.compile(model, (x, state))
    assert state.h is None
    assert "last" not in model.__dict__
    with torch.no_grad():
        out = artifact(x, state)
        torch.testing.assert_close(out, model.lin(x) * 2)
        # What the call wrote is what eager writes.
        torch.testing.assert_close(state.h, model.lin(x))
        assert model.last is state.h
        torch.testing.assert_close(artifact(x, state), out)


def test_compile_leaves_an_example_cache_alone() -> None:
    cfg = T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    model = T.GPT2LMHeadModel(cfg).eval()
    cache = T.DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 6)), past_key_values=cache, use_cache=True)
    keys = [layer.keys for layer in cache.layers]
    snapshot = [k.clone() for k in keys]
    with torch.no_grad():
        Precompile.compile(
            model, (torch.randint(0, VOCAB, (2, 1)),), {"past_key_values": cache, "use_cache": True}
        )
    assert cache.get_seq_length() == 6
    for layer, k, before in zip(cache.layers, keys, snapshot):
        assert layer.keys is k  # identity, not only values
        torch.testing.assert_close(layer.keys, before)


def test_first_call_state_is_served_in_process() -> None:
    model, x = _Lazy(), torch.randn(3, 8)
    with torch.no_grad():
        artifact = Precompile.compile(model, x)
        assert model.table is None
        for _ in range(3):  # the first call builds the table, the later ones read it
            torch.testing.assert_close(artifact(x), model.lin(x) + torch.arange(8.0) * 2)
    assert model.table is not None


def _bert_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = T.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return T.BertForSequenceClassification(cfg)


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bert_training_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    model = _bert_classifier()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2])
    artifact = Precompile.compile(model, (), {"input_ids": ids, "labels": labels})
    assert model.config.problem_type is None  # compile wrote nothing
    for _ in range(3):  # HF sets config.problem_type on the first call
        out = artifact(input_ids=ids, labels=labels)
        expected = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.loss, expected.loss)
    d = tmp_path_factory.mktemp("bert")
    path, weights = str(d / "bert_cls.pt"), str(d / "weights.pt")
    Precompile.save(path, artifact)
    torch.save(model.state_dict(), weights)
    return path, weights


def test_classifier_training_artifact_serves_every_call(
    bert_training_file: tuple[str, str],
) -> None:
    path, weights = bert_training_file
    result = _run(
        """
        import json, sys, torch
        from tests.test_workloads import _bert_classifier
        from torch_precompile import Precompile
        model = _bert_classifier()
        model.load_state_dict(torch.load(sys.argv[2]))
        ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(1))
        labels = torch.tensor([0, 2])
        diffs = []
        for loaded in (Precompile.load(sys.argv[1]), Precompile.load(sys.argv[1], model=model)):
            for _ in range(3):
                out = loaded(input_ids=ids, labels=labels)
                eager = model(input_ids=ids, labels=labels)
                out.loss.backward()
                diffs.append(float((out.loss - eager.loss).abs()))
        print(json.dumps({"diffs": diffs}))
        """,
        path,
        weights,
    )
    assert len(result["diffs"]) == 6
    assert max(result["diffs"]) < 1e-5


@pytest.fixture(scope="module")
def gpt2_dynamic_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    model = T.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        artifact = Precompile.compile(model, (torch.randint(0, VOCAB, (2, 7)),), dynamic=True)
    # Batch and sequence each leave out 1: the dynamic variant and three at size 1.
    assert len(artifact.variants) == 4
    path = str(tmp_path_factory.mktemp("gpt2") / "gpt2_dynamic.pt")
    Precompile.save(path, artifact)
    torch.save(model.state_dict(), path + ".weights")
    return path


def test_dynamic_serves_size_one_to_max_in_a_fresh_process(gpt2_dynamic_file: str) -> None:
    result = _run(
        """
        import json, sys, torch
        from torch_precompile import Precompile
        loaded = Precompile.load(sys.argv[1])
        sizes = [(1, 1), (1, 7), (2, 1), (2, 7), (3, 64), (1, 64)]
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randint(0, 1000, s, generator=gen) for s in sizes]
        with torch.no_grad():
            ours = [loaded(x).logits for x in inputs]
            try:  # past n_positions (64): eager raises IndexError; Inductor's kernel would abort
                loaded(torch.randint(0, 1000, (2, 65), generator=gen))
                past_end = "served"
            except IndexError as exc:
                past_end = str(exc)
        # Before transformers is imported (it imports torch._dynamo itself).
        heavy = ("torch._dynamo", "torch._inductor.compile_fx", "sympy")
        heavy = [m for m in heavy if m in sys.modules]
        import transformers as T
        cfg = T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=64)
        model = T.GPT2LMHeadModel(cfg).eval()
        model.load_state_dict(torch.load(sys.argv[1] + ".weights"))
        with torch.no_grad():
            diffs = {
                f"{x.shape[0]}x{x.shape[1]}": float((o - model(x).logits).abs().max())
                for x, o in zip(inputs, ours)
            }
        print(json.dumps({"diffs": diffs, "heavy": heavy, "past_end": past_end}))
        """,
        gpt2_dynamic_file,
    )
    assert "at most 64 positions" in result["past_end"], result["past_end"]
    assert "input 'args[0]' = 65" in result["past_end"], result["past_end"]
    assert set(result["diffs"]) == {"1x1", "1x7", "2x1", "2x7", "3x64", "1x64"}
    assert max(result["diffs"].values()) < 1e-4
    # Lean on 2.14 too: its OBJECT_ALIASING guard (GPT-2's shared config) is translated.
    assert result["heavy"] == []


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def generation_file(
    request: pytest.FixtureRequest, store: Store, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str]:
    """The tiny decoder's generation file (built once per run, the build checking that
    compile left the model alone: tests/fixtures/generation_files.py), copied beside the
    model's weights."""
    path = tmp_path_factory.mktemp(request.param) / "gen.pt"
    shutil.copyfile(generation_files.generation_file(store, request.param), path)
    torch.save(tiny_decoder(request.param).state_dict(), f"{path}.weights")
    return request.param, str(path)


def test_generate_on_one_artifact_equals_eager(generation_file: tuple[str, str]) -> None:
    kind, path = generation_file
    result = _run(
        """
        import json, sys, torch
        from contextlib import nullcontext
        from tests.fixtures.hf_models import tiny_decoder
        from torch_precompile import Precompile
        from torch_precompile.generation import generate_with
        model = tiny_decoder(sys.argv[1])
        model.load_state_dict(torch.load(sys.argv[2] + ".weights"))
        out = {}
        with torch.device("meta"):  # a shell to drive generate: no weights allocated
            shell = tiny_decoder(sys.argv[1])
        for how in ("model", "standalone", "shell"):
            loaded = Precompile.load(sys.argv[2], **({"model": model} if how == "model" else {}))
            for b, p in [(1, 1), (1, 7), (3, 1), (3, 7)]:
                g = torch.Generator().manual_seed(10 * b + p)
                x = torch.randint(0, 1000, (b, p), generator=g)
                kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=20, min_new_tokens=20)
                kw.update(return_dict_in_generate=True, output_logits=True)
                driver = shell if how == "shell" else model
                with torch.no_grad():
                    eager = model.generate(x, do_sample=False, **kw)
                    with generate_with(driver, loaded):
                        ours = driver.generate(x, do_sample=False, **kw)
                    torch.manual_seed(5)
                    eager_s = model.generate(x, do_sample=True, top_k=50, **kw)
                    torch.manual_seed(5)
                    with generate_with(driver, loaded):
                        ours_s = driver.generate(x, do_sample=True, top_k=50, **kw)
                logits = [(e, o) for r, q in ((eager, ours), (eager_s, ours_s))
                          for e, o in zip(r.logits, q.logits)]
                out[f"{how} {b}x{p}"] = [
                    torch.equal(eager.sequences, ours.sequences),
                    list(ours.sequences.shape),
                    torch.equal(eager_s.sequences, ours_s.sequences),
                    [len(r.logits) for r in (eager, ours, eager_s, ours_s)],
                    max((e - o).abs().max().item() for e, o in logits),
                ]
            assert "forward" not in model.__dict__ and "forward" not in shell.__dict__
            # Every call was served by the plain-Python guards: no variant built
            # Dynamo's guard manager (a cache's class is checked by name).
            out[f"{how} light"] = [
                getattr(v.runtime.guard_manager, "_full", "full path") is None
                for v in loaded.variants
            ]
            if how == "shell":
                continue
            # Up to and past the largest position (64): GPT-2's table ends there (eager
            # raises IndexError, so must we, before any kernel); Llama's rotary has no end.
            x = torch.randint(0, 1000, (1, 58), generator=torch.Generator().manual_seed(3))
            kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)
            ends = []
            for use in (False, True):
                try:
                    with torch.no_grad(), (generate_with(model, loaded) if use else nullcontext()):
                        ends.append(model.generate(x, min_new_tokens=10, **kw).tolist())
                except IndexError as exc:
                    ends.append("IndexError: " + str(exc))
            out[f"{how} past"] = ends
        print(json.dumps(out))
        """,
        kind,
        path,
    )
    for how in ("model", "standalone", "shell"):
        light = result.pop(f"{how} light")
        assert len(light) == 8 and all(light), f"{kind} {how}: {light}"
    past = {k: result.pop(k) for k in ("model past", "standalone past")}
    for how, (eager, ours) in past.items():
        if kind == "gpt2":
            assert eager.startswith("IndexError"), eager
            # Positions now come from the mask (generate's position_ids): the check
            # names them and the table they index, before any kernel runs.
            assert ours.startswith("IndexError") and "position_ids" in ours, f"{how}: {ours}"
            assert "transformer.wpe.weight' (size 64)" in ours, f"{how}: {ours}"
        else:
            assert len(eager[0]) == 68 and ours == eager, how
    assert len(result) == 12
    for case, (greedy_equal, shape, sampled_equal, steps, diff) in result.items():
        batch, prompt = (int(v) for v in case.split()[1].split("x"))
        assert shape == [batch, prompt + 20], case
        assert greedy_equal, f"{kind} {case}: greedy tokens differ from eager's"
        assert sampled_equal, f"{kind} {case}: seeded sampling differs from eager's"
        assert steps == [20] * 4, f"{kind} {case}: logits of {steps} steps"
        assert diff <= 1e-4, f"{kind} {case}: logits differ from eager's by {diff}"


@pytest.fixture(scope="module")
def static_cache_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GPT-2 for ``generate(cache_implementation="static")``, batch-1 programs only."""
    from torch_precompile.generation import compile_for_generation

    model = tiny_decoder("gpt2")
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    artifact = compile_for_generation(
        model, prompt, single_batch=True, cache_implementation="static"
    )
    # prefill, decode and the prefill whose cache the prompt fills (one new token),
    # at a prompt of 1 and of 2 or more
    assert len(artifact.variants) == 6
    path = str(tmp_path_factory.mktemp("static") / "gen_static.pt")
    Precompile.save(path, artifact)
    return path


def test_generate_with_a_static_cache_equals_eager(static_cache_file: str) -> None:
    """transformers' ``StaticCache`` (updated in place by each step): prompts of 1, 7
    and 12 tokens, 1 and 20 new tokens, with ``model=`` and standalone."""
    result = _run(
        """
        import json, sys, torch
        from tests.fixtures.hf_models import tiny_decoder
        from torch_precompile import Precompile
        from torch_precompile.generation import generate_with
        model = tiny_decoder("gpt2")
        out = {}
        for how in ("model", "standalone"):
            loaded = Precompile.load(sys.argv[1], **({"model": model} if how == "model" else {}))
            for p in (1, 7, 12):
                for n in (1, 20):  # one new token: the cache holds the prompt exactly
                    x = torch.randint(0, 1000, (1, p), generator=torch.Generator().manual_seed(p))
                    kw = dict(
                        attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, cache_implementation="static",
                        return_dict_in_generate=True, output_logits=True,
                    )
                    # generate sizes a static cache for the longest call so far: not here
                    model.__dict__.pop("_previous_max_cache_length", None)
                    with torch.no_grad():
                        eager = model.generate(x, **kw)
                        model.__dict__.pop("_previous_max_cache_length", None)
                        with generate_with(model, loaded):
                            ours = model.generate(x, **kw)
                    out[f"{how} {p} {n}"] = [
                        torch.equal(eager.sequences, ours.sequences),
                        list(ours.sequences.shape),
                        [len(eager.logits), len(ours.logits)],
                        max((e - o).abs().max().item() for e, o in zip(eager.logits, ours.logits)),
                    ]
            out[f"{how} light"] = [  # no variant built Dynamo's guard manager
                getattr(v.runtime.guard_manager, "_full", "full path") is None
                for v in loaded.variants
            ]
        print(json.dumps(out))
        """,
        static_cache_file,
    )
    for how in ("model", "standalone"):
        light = result.pop(f"{how} light")
        assert len(light) == 6 and all(light), f"{how}: {light}"
    assert len(result) == 12
    for case, (equal, shape, steps, diff) in result.items():
        _, prompt, new = case.split()
        assert shape == [1, int(prompt) + int(new)], case
        assert equal, f"{case}: tokens differ from eager's"
        assert steps == [int(new)] * 2, f"{case}: logits of {steps} steps"
        assert diff <= 1e-4, f"{case}: logits differ from eager's by {diff}"


def test_a_static_cache_file_refuses_a_dynamic_cache_naming_both(static_cache_file: str) -> None:
    from torch_precompile._errors import GuardError
    from torch_precompile.generation import generate_with

    model = tiny_decoder("gpt2")
    loaded = Precompile.load(static_cache_file, model=model)
    x = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), generate_with(model, loaded), pytest.raises(GuardError) as info:
        model.generate(x, max_new_tokens=3, do_sample=False)
    text = str(info.value)
    assert "built for a StaticCache cache, generate gave a DynamicCache" in text, text
    assert 'cache_implementation="static"' in text, text
