"""Prefix reuse and chunked prefill (engine/prefix.py), on test_serve's file: a prompt
that begins with a free slot's kept entries prefills only the rest and answers as a
cold engine does; a long prompt joining running streams is prefilled a chunk a pass,
so their token gaps stay bounded; over HTTP, a second chat turn reports its cached
tokens and answers as a server without reuse.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from test_serve import Server, served_files  # noqa: E402

from torch_precompile import Precompile  # noqa: E402
from torch_precompile.engine import Delta, Request  # noqa: E402
from torch_precompile.engine.scheduler import Scheduler  # noqa: E402

PROMPT = (11, 42, 7, 300, 5, 9, 13, 77, 101, 3, 8, 8, 21)


@pytest.fixture(scope="module")
def built(store: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return served_files(store, tmp_path_factory)  # test_serve's, built once per run


class Stepping:
    """An engine stepping on its own thread; each run's events and their times."""

    def __init__(self, engine: Scheduler) -> None:
        self.engine = engine
        self.events: dict[str, list[tuple[float, Delta]]] = {}
        self.done: dict[str, threading.Event] = {}
        self.thread = threading.Thread(target=engine.run)
        self.thread.start()

    def submit(self, name: str, request: Request, then: Any = None) -> None:
        self.events[name], self.done[name] = [], threading.Event()

        def sink(event: Any) -> None:
            assert isinstance(event, Delta), event
            self.events[name].append((time.perf_counter(), event))
            if then is not None:
                then(event)
            if event.finish is not None:
                self.done[name].set()

        self.engine.submit(request, sink, with_ids=True)

    def wait(self) -> None:
        """Until every run ends (those submitted meanwhile too), then stop."""
        deadline = time.monotonic() + 120
        try:
            while not all(d.is_set() for d in list(self.done.values())):
                assert time.monotonic() < deadline, self.engine.load()
                time.sleep(0.01)
        finally:
            self.engine.stop()
            self.thread.join(60)

    def tokens(self, name: str) -> list[int]:
        return [t for _, e in self.events[name] for t in e.token_ids]

    def logprobs(self, name: str) -> list[float]:
        return [lp.logprob for _, e in self.events[name] for lp in e.logprobs]

    def finish(self, name: str) -> Any:
        return self.events[name][-1][1].finish


def _greedy(prompt: tuple[int, ...], new: int) -> Request:
    return Request(prompt=prompt, max_tokens=new, temperature=0, ignore_eos=True, logprobs=3)


def _engine(built: dict[str, Any], **options: Any) -> Scheduler:
    engine = Scheduler(Precompile.load(built["path"]), max_queue=8, **options)
    engine.warm()
    return engine


def test_a_second_turn_prefills_only_past_a_free_slots_entries(built: dict[str, Any]) -> None:
    """Turn 1 ends in slot 0 while a long run decodes in slot 1 (the free slot 0 steps
    beside it, 20-odd times, and must leave its entries alone); turn 2 (turn 1's
    prompt, answer and more) joins slot 0, prefills only its new tokens, reports the
    rest as cached, and its tokens and logprobs are a cold engine's."""
    engine = _engine(built)
    prefilled: list[tuple[int, int]] = []
    prefill = engine._prefill_logits

    def counted(slot: int, tokens: Any, start: int = 0) -> torch.Tensor:
        prefilled.append((slot, len(tokens)))
        return prefill(slot, tokens, start)

    engine._prefill_logits = counted  # type: ignore[method-assign]
    stepping = Stepping(engine)
    turn: list[tuple[int, ...]] = []

    def at_30(event: Delta) -> None:  # turn 1 ended some 24 steps ago
        if event.tokens == 30:
            turn.append(PROMPT + tuple(stepping.tokens("turn 1")) + (4, 5, 6))
            stepping.submit("turn 2", _greedy(turn[0], 8))

    stepping.submit("turn 1", _greedy(PROMPT, 6))
    stepping.submit("long", _greedy((1, 2, 3), 60), then=at_30)
    stepping.wait()
    cold = _engine(built, reuse=False)
    alone = Stepping(cold)
    alone.submit("turn 2", _greedy(turn[0], 8))
    alone.submit("long", _greedy((1, 2, 3), 60))
    alone.wait()
    cached = len(PROMPT) + 6 - 1  # the last token of turn 1 was never fed back
    assert stepping.finish("turn 2").usage.cached_tokens == cached
    assert alone.finish("turn 2").usage.cached_tokens == 0
    assert prefilled[-1] == (0, len(turn[0]) - cached)
    assert stepping.tokens("turn 2") == alone.tokens("turn 2")
    assert stepping.tokens("long") == alone.tokens("long")
    torch.testing.assert_close(
        stepping.logprobs("turn 2"), alone.logprobs("turn 2"), atol=1e-4, rtol=0
    )


def test_the_longest_match_is_chosen_and_a_short_one_is_left(built: dict[str, Any]) -> None:
    """Two free slots keep different prompts: a third request takes the slot whose
    entries it begins with the most, and a prompt matching none takes the lowest."""
    engine = _engine(built)
    stepping = Stepping(engine)
    other = (200, 201, 202, 203, 204, 205)
    chosen: list[int] = []
    prefill = engine._prefill_logits

    def watched(slot: int, tokens: Any, start: int = 0) -> torch.Tensor:
        chosen.append(slot)
        return prefill(slot, tokens, start)

    ended: list[Delta] = []

    def after_both(event: Delta) -> None:
        ended.extend([event] if event.finish is not None else [])
        if len(ended) == 2:
            engine._prefill_logits = watched  # type: ignore[method-assign]
            stepping.submit("longer", _greedy((*other[:5], 9, 9), 2))

    stepping.submit("a", _greedy(PROMPT, 2), then=after_both)
    stepping.submit("b", _greedy(other, 2), then=after_both)
    stepping.wait()
    assert chosen == [1]
    assert stepping.finish("longer").usage.cached_tokens == 5


def test_a_long_prompt_joins_a_chunk_a_pass_and_the_streams_keep_their_pace(
    built: dict[str, Any],
) -> None:
    """The prefill is slowed to 10 ms a token (a model whose prompt costs more than
    its decode step, as every real one's): four streams decode, then an 80-token
    prompt joins. Prefilled whole, it stops them for its 0.8 s; in chunks of 4
    tokens, their longest gap while it joins stays under half of that. Its answer is
    the same either way, and the same as ``generate``'s."""

    def gaps(chunk: int) -> tuple[float, list[int]]:
        engine = _engine(built, prefill_chunk=chunk)
        step = engine.step

        def slow(ids: torch.Tensor, *args: Any) -> Any:
            time.sleep(0.01 * ids.shape[1])
            return step(ids, *args)

        engine.step = slow
        stepping = Stepping(engine)
        joined: list[float] = []
        prompt = tuple(range(20, 100))

        def at_10(event: Delta) -> None:
            if event.tokens == 10 and not joined:
                joined.append(time.perf_counter())
                stepping.submit("prompt", _greedy(prompt, 8))

        for i in range(4):
            stepping.submit(f"stream {i}", _greedy((1 + i, 2, 3), 70), then=at_10)
        stepping.wait()
        end = stepping.events["prompt"][0][0]  # its first token: the prefill is done
        longest = 0.0
        for i in range(4):
            times = [t for t, _ in stepping.events[f"stream {i}"]]
            during = [b - a for a, b in itertools.pairwise(times) if b > joined[0] and a < end]
            longest = max([longest, *during])
        return longest, stepping.tokens("prompt")

    whole, answer = gaps(0)
    chunked, chunked_answer = gaps(4)
    gen = Precompile.load(built["path"])
    alone = gen.generate(torch.tensor([list(range(20, 100))]), max_new_tokens=8, eos_token_id=None)
    assert whole > 0.75, whole
    assert chunked < whole / 2, (chunked, whole)
    assert answer == chunked_answer == alone[0, 80:].tolist()


def test_a_second_chat_turn_reports_cached_tokens_as_a_cold_server_answers(
    built: dict[str, Any],
) -> None:
    """Over HTTP with the official client: turn 2 (turn 1's messages, its answer and a
    new question) reports ``prompt_tokens_details.cached_tokens`` and gives the answer
    and logprobs of a server started with ``--no-prefix-reuse``, which reports none."""
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    answers = []
    for flags in ((), ("--no-prefix-reuse",)):
        server = Server(built["path"], *flags)
        try:
            client = server.client()
            first = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, temperature=0
            )
            history = [
                *messages,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "and the dog"},
            ]
            second = client.chat.completions.create(
                model="tiny", messages=history, max_tokens=8, temperature=0, logprobs=True
            )
            answers.append(second)
        finally:
            server.stop()
    reused, cold = answers
    assert reused.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert reused.usage.prompt_tokens == cold.usage.prompt_tokens
    assert reused.choices[0].message.content == cold.choices[0].message.content
    got = [t.logprob for t in reused.choices[0].logprobs.content]
    want = [t.logprob for t in cold.choices[0].logprobs.content]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_file_whose_prefill_refuses_an_offset_serves_without_reuse(
    built: dict[str, Any],
) -> None:
    """Where the file's prefill refuses a ``start`` past 0 (stood in for by a step that
    raises there), warm-up says so, and the engine serves with neither reuse nor
    chunks: a second turn prefills whole, reports no cached tokens, and answers as
    ``generate``."""
    engine = Scheduler(Precompile.load(built["path"]), max_queue=8, prefill_chunk=4)
    step = engine.step

    def no_offset(ids: torch.Tensor, mask: Any, positions: Any, start: Any, *cache: Any) -> Any:
        if start.dim() == 0 and int(start) > 0:
            raise RuntimeError("this file's prefill starts at 0")
        return step(ids, mask, positions, start, *cache)

    engine.step = no_offset
    engine.warm()
    assert (engine.reuse, engine.chunk) == (False, 0)
    stepping = Stepping(engine)
    turn: list[tuple[int, ...]] = []

    def then(event: Delta) -> None:  # turn 1 ends: turn 2 begins with all of it
        if event.finish is not None:
            turn.append(PROMPT + tuple(stepping.tokens("turn 1")) + (4, 5))
            stepping.submit("turn 2", _greedy(turn[0], 6))

    stepping.submit("turn 1", _greedy(PROMPT, 4), then=then)
    stepping.wait()
    second = turn[0]
    alone = Precompile.load(built["path"]).generate(
        torch.tensor([second]), max_new_tokens=6, eos_token_id=None
    )
    assert stepping.finish("turn 2").usage.cached_tokens == 0
    assert stepping.tokens("turn 2") == alone[0, len(second) :].tolist()
