"""The engine's output stage with a constraint (engine/constraint.py), for both of its
clients: ``Generator.generate`` and the server's scheduler, on a real generator file
from disk (test_serve's, built once per run), against transformers' own ``generate``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_serve import VOCAB, served_files  # noqa: E402

from torch_precompile import Precompile  # noqa: E402
from torch_precompile.engine import Constraint, Delta, Failed, Request  # noqa: E402
from torch_precompile.engine.scheduler import Scheduler  # noqa: E402


class Sequence_:
    """Allows exactly ``tokens``, one after another; done after the last."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.at = tokens, 0

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.tokens[self.at]] = True
        return mask

    def accept(self, token_id: int) -> None:
        assert token_id == self.tokens[self.at], (token_id, self.tokens, self.at)
        self.at += 1

    def done(self) -> bool:
        return self.at == len(self.tokens)


class AmongEven:
    """Allows only even token ids; done after ``count`` tokens."""

    def __init__(self, count: int) -> None:
        self.count, self.seen = count, []

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        return torch.arange(vocab_size) % 2 == 0

    def accept(self, token_id: int) -> None:
        self.seen.append(token_id)

    def done(self) -> bool:
        return len(self.seen) >= self.count


@pytest.fixture(scope="module")
def built(store: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return served_files(store, tmp_path_factory)  # test_serve's, built once per run


PROMPT = [11, 42, 7, 300, 5]


def test_the_protocol_is_typed() -> None:
    assert isinstance(Sequence_([1]), Constraint) and isinstance(AmongEven(1), Constraint)
    assert not isinstance(object(), Constraint)


def test_generate_follows_a_constraint_as_transformers_allowed_tokens(
    built: dict[str, Any],
) -> None:
    """A fixed sequence is what greedy decoding gives, and the row stops after it; a
    constraint allowing even ids gives transformers' greedy with the same allowed
    tokens (``prefix_allowed_tokens_fn``); a free row beside it is unchanged."""
    gen = Precompile.load(built["path"])
    ids = torch.tensor([PROMPT])
    free = gen.generate(ids, max_new_tokens=6, eos_token_id=None)[0, 5:].tolist()
    wanted = [(t + 1) % VOCAB for t in free]  # never the greedy choice
    out = gen.generate(ids, max_new_tokens=10, eos_token_id=None, constraint=Sequence_(wanted))
    assert out[0, 5:].tolist() == wanted

    model = built["model"]
    even = list(range(0, model.config.vocab_size, 2))
    eager = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        prefix_allowed_tokens_fn=lambda batch, sent: even,
    )[0, 5:].tolist()
    assert all(t % 2 == 0 for t in eager) and eager != free[:8]
    two = torch.tensor([PROMPT, PROMPT])
    both = gen.generate(two, max_new_tokens=8, eos_token_id=None, constraint=[AmongEven(8), None])
    assert both[0, 5:].tolist() == eager
    assert both[1, 5:11].tolist() == free
    with pytest.raises(ValueError, match="one per row"):
        gen.generate(two, max_new_tokens=2, constraint=AmongEven(2))


def _run(engine: Scheduler, requests: list[Request]) -> list[list[Any]]:
    events: list[list[Any]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def sink(i: int) -> Any:
        def put(event: Any) -> None:
            events[i].append(event)
            if isinstance(event, Failed) or event.finish is not None:
                done[i].set()

        return put

    stepping = threading.Thread(target=engine.run)
    stepping.start()
    try:
        for i, request in enumerate(requests):
            engine.submit(request, sink(i), with_ids=True)
        assert all(d.wait(120) for d in done), engine.load()
    finally:
        engine.stop()
        stepping.join(60)
    return events


def test_the_server_engine_follows_a_constraint_beside_free_runs(built: dict[str, Any]) -> None:
    """The scheduler's runs, each in its slot, stepping together: a constrained run
    gives its sequence and finishes ``stop`` after it; an even-id run gives
    transformers' allowed-token greedy; a free run is ``generate``'s."""
    gen = Precompile.load(built["path"])
    ids = torch.tensor([PROMPT])
    free = gen.generate(ids, max_new_tokens=8, eos_token_id=None)[0, 5:].tolist()
    even = gen.generate(ids, max_new_tokens=8, eos_token_id=None, constraint=AmongEven(8))
    wanted = [(t + 1) % VOCAB for t in free[:5]]
    engine = Scheduler(gen, max_queue=4)
    engine.warm()
    base = Request(prompt=tuple(PROMPT), max_tokens=8, temperature=0, ignore_eos=True)
    events = _run(
        engine,
        [
            Request(**{**base.__dict__, "constraint": Sequence_(wanted)}),
            base,
            Request(**{**base.__dict__, "constraint": AmongEven(8)}),
        ],
    )
    tokens = [[t for e in run for t in e.token_ids] for run in events]
    assert all(isinstance(e, Delta) for run in events for e in run)
    assert tokens == [wanted, free, even[0, 5:].tolist()]
    finishes = [run[-1].finish for run in events]
    assert [f.reason for f in finishes] == ["stop", "length", "stop"]
    assert [f.usage.completion_tokens for f in finishes] == [5, 8, 8]


def test_n_choices_prefill_once_and_each_continue_as_generate(built: dict[str, Any]) -> None:
    """A request of three greedy choices: one prefill (its cache entries copied to the
    other slots), and every choice's tokens are ``generate``'s for the prompt alone."""
    gen = Precompile.load(built["path"])
    free = gen.generate(torch.tensor([PROMPT]), max_new_tokens=7, eos_token_id=None)
    engine = Scheduler(gen, max_queue=4)
    engine.warm()
    prefills = []
    prefill = engine._prefill_logits
    engine._prefill_logits = lambda slot, *a: prefills.append(slot) or prefill(slot, *a)  # type: ignore[method-assign]
    request = Request(prompt=tuple(PROMPT), max_tokens=7, temperature=0, ignore_eos=True, n=3)
    (events,) = _run(engine, [request])
    tokens: list[list[int]] = [[], [], []]
    for event in events:
        tokens[event.index] += event.token_ids
    assert prefills == [0]
    assert tokens == [free[0, 5:].tolist()] * 3


def test_one_run_alone_steps_one_row_as_generate_does(built: dict[str, Any]) -> None:
    """A CPU file decodes ``generate``'s tokens by its slot step of one row: a run alone
    in the server's engine steps that one row (not two), and its tokens and logprobs
    are ``generate``'s to the bit; two runs at once step two rows, their logprobs close."""
    gen = Precompile.load(built["path"])
    assert gen.spec.decode_by_slots and gen.spec.max_batch > 1
    ids = torch.tensor([PROMPT])
    out = gen.generate(
        ids, max_new_tokens=8, eos_token_id=None, return_dict_in_generate=True, output_logits=True
    )
    free = out.sequences[0, 5:].tolist()
    want = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, free)]
    request = Request(
        prompt=tuple(PROMPT), max_tokens=8, temperature=0, ignore_eos=True, logprobs=0
    )
    for runs, rows in (([request], {1}), ([request, request], {2})):
        engine = Scheduler(gen, max_queue=4)
        engine.warm()
        batches: list[int] = []

        def spy(batch: int, decode: Any = engine.runner.decode, seen: Any = batches) -> Any:
            seen.append(batch)
            return decode(batch)

        engine.runner.decode = spy  # type: ignore[method-assign]
        events = _run(engine, runs)
        assert [[t for e in run for t in e.token_ids] for run in events] == [free] * len(runs)
        got = [lp.logprob for e in events[0] for lp in e.logprobs]
        # One row is generate's program itself: the same logprobs to the bit; two rows
        # are another matmul shape.
        tol = 0.0 if rows == {1} else 1e-4
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=tol)
        assert set(batches) == rows, batches
