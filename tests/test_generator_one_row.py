"""A generator of one row (``max_batch=1``): the quick tier's generator.

The smallest build that goes the whole way (compile, save, the lean load,
``generate``, ``serve``): a 2-layer Llama of width 64 with the tests' 320-token
BPE. A file of one row holds two programs at batch 1: the prefill and the slot
step, which is ``generate``'s decode step too; its tokens and every step's logits
equal transformers' ``generate``, a second row is a typed error before any kernel,
and the server, in a process where transformers cannot be imported, answers as
``generate`` does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("openai")
pytest.importorskip("starlette")

from test_generator import SMALL, _hf, _tokenizer  # noqa: E402
from test_serve import Server  # noqa: E402

from tests.fixtures.hf_models import assert_same_logits  # noqa: E402
from tests.fixtures.store import Store  # noqa: E402
from torch_precompile import Precompile  # noqa: E402
from torch_precompile._errors import GenerationLimitError  # noqa: E402
from torch_precompile.generation import compile_generator  # noqa: E402

MAX_LENGTH, VOCAB = 48, 320
_LOGITS = dict(return_dict_in_generate=True, output_logits=True)


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_key_value_heads=2, **{**SMALL, "vocab_size": VOCAB})
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def one_row(store: Store) -> dict[str, Any]:
    def build(path: Path) -> None:
        generator = compile_generator(
            _model(), max_batch=1, max_length=MAX_LENGTH, tokenizer=_tokenizer()
        )
        Precompile.save(path, generator)

    key = {"model": "llama", "small": SMALL, "vocab": VOCAB, "max_length": MAX_LENGTH}
    path = store.saved("llama-one-row", key, build)
    return {"path": path, "model": _model(), "loaded": Precompile.load(path)}


def test_two_programs_and_a_second_row_refused(one_row: dict[str, Any]) -> None:
    loaded = one_row["loaded"]
    assert len(loaded.step.variants) == 2  # prefill and slot step, batch 1 only
    assert loaded.spec.max_batch == 1 and loaded.spec.slots and loaded.spec.decode_by_slots
    with pytest.raises(GenerationLimitError, match=r"max_batch=1.*split the batch"):
        loaded.generate(torch.ones((2, 3), dtype=torch.long), max_new_tokens=2)


def test_a_record_before_decode_by_slots_reads_as_a_decode_step_of_its_own(
    one_row: dict[str, Any],
) -> None:
    """A file's record without ``decode_by_slots`` (written before the slot step decoded
    ``generate``'s rows) gives every step the 0-d ``start`` its decode step takes; this
    file's record gives a one-token step one ``start`` a row, a prompt the 0-d one."""
    from torch_precompile.runtime.generator_spec import GeneratorSpec

    spec = one_row["loaded"].spec
    record = spec.to_json()
    del record["decode_by_slots"]
    old = GeneratorSpec.from_json(record, "old.pt")
    assert not old.decode_by_slots and old == dataclasses.replace(spec, decode_by_slots=False)
    start = torch.tensor(5)
    assert old.start_of(start, 3, 1) is start
    assert torch.equal(spec.start_of(start, 3, 1), torch.tensor([5, 5, 5]))
    assert spec.start_of(start, 3, 7) is start


@pytest.mark.parametrize(("length", "new"), [(1, 6), (7, 12), (MAX_LENGTH - 4, 4)])
def test_greedy_and_logits_equal_transformers(
    one_row: dict[str, Any], length: int, new: int
) -> None:
    ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    want = _hf(one_row["model"], ids, mask, new, eos_token_id=None, **_LOGITS)
    got = one_row["loaded"].generate(ids, mask, max_new_tokens=new, eos_token_id=None, **_LOGITS)
    assert_same_logits(want, got, f"length {length}")


def test_served_where_transformers_cannot_be_imported(one_row: dict[str, Any]) -> None:
    tokenizer = _tokenizer()
    prompt = "the cat sat on"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = one_row["loaded"].generate(ids, max_new_tokens=8, eos_token_id=None)
    want = tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    server = Server(one_row["path"])
    try:
        client = server.client()
        name = one_row["path"].stem
        got = client.completions.create(
            model=name, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == want
        assert got.usage.completion_tokens == 8
    finally:
        log = server.stop()
    assert "IMPORTED []" in log, log[-2000:]


def test_the_build_plan_decodes_by_the_slot_step_off_a_gpu_only() -> None:
    """The programs a build compiles (generation/rows.py), in order: on the CPU a prefill
    and a slot step of 1..N rows (a quantized or large float32 file's one-row slot step
    before it, which a call of one row takes first); on a GPU and for a model without
    the slot step, a decode step of its own."""
    from torch_precompile.generation.rows import plan

    def names(*args: Any, **kwargs: Any) -> list[str]:
        return [p.name for p, _ in plan(*args, **kwargs)]

    cpu = ["prefill, batch 1..4", "slot decode step, batch 1..4"]
    assert names(4, 5, 7, "cpu", 1, True) == cpu
    assert names(4, 5, 7, "cpu", 1, True, one_row=True) == [
        cpu[0], "slot decode step, batch 1", cpu[1]
    ]  # fmt: skip
    assert names(1, 5, 7, "cpu", 1, True) == ["prefill, batch 1", "slot decode step, batch 1"]
    assert names(4, 5, 7, "cpu", 1, False) == ["prefill, batch 1..4", "decode, batch 1..4"]
    gpu = names(4, 5, 7, "cuda", 1, True)
    assert "decode, batch 1" in gpu and "slot decode step, batch 2..4" in gpu
