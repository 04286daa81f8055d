"""The scheduler: requests in the slots of one static cache, decoded together
(continuous batching).

One thread owns the cache (:class:`~.runner.SlotRunner`). A request takes the
lowest free slot, is prefilled there, then decodes with every other busy slot
at each step. A request of ``n`` choices waits for ``n`` free slots, is prefilled
once, and its cache entries are copied to the other slots; each choice then
draws its first token from the same logits with its own sampler. A run leaves at
an end token (or a stop token id), its stop string, its ``max_tokens``, its
constraint's end or its client's cancel, freeing its slot for the next in the
queue at once. Each run's tokens go through the output stage (:mod:`.output`)
and reach its sink as :class:`~.requests.Delta` events.

:meth:`Scheduler.cycle` is the package's one decode loop, a pass at a time: the
server's thread runs it (:meth:`Scheduler.run`) over the slot runner
(:class:`~.runner.SlotRunner`); ``Generator.generate`` drives it on its own thread
(:meth:`Scheduler.drive`) over the lockstep runner (:class:`~.batch.LockstepRunner`),
its call's rows one :class:`~.batch.Batch` that takes every slot.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from .batch import Batch
from .errors import EngineBusy, RequestError
from .output import Reading, Stream, request_chooser
from .requests import Event, Failed, Request, TokenLogprob
from .runner import Loaded, Runner, SlotRunner
from .text import pieces_of

log = logging.getLogger("torch_precompile")

Sink = Callable[[Event], None]


class Run:
    """A request in the scheduler: each choice's output stream, and where its events go."""

    def __init__(self, streams: list[Stream], sink: Sink) -> None:
        self.streams, self.sink = streams, sink
        self.cancelled = False

    @property
    def request(self) -> Request:
        return self.streams[0].request

    @property
    def width(self) -> int:
        """The slots the run takes: one a choice."""
        return len(self.streams)


class _Choice:
    """One choice of a run, in its slot."""

    def __init__(self, run: Run | Batch, stream: Stream | Batch) -> None:
        self.run, self.stream = run, stream


class Scheduler:
    """The loop over a generator file's runner (see the module docstring): the slot
    runner unless ``runner`` names another."""

    def __init__(
        self,
        generator: Loaded,
        *,
        max_queue: int,
        tokenizer: Any = None,
        runner: Runner | None = None,
    ) -> None:
        self.runner: Any = SlotRunner(generator) if runner is None else runner
        self.spec, self.tokenizer = generator.spec, tokenizer
        self.max_queue = max_queue
        self.device = self.runner.device
        self.batches = getattr(self.runner, "batches", [self.runner.slots])
        self.reading: collections.deque[Reading] = collections.deque()  # launched, unread
        self.active: list[_Choice | None] = [None] * self.runner.slots
        self.pending: collections.deque[Run | Batch] = collections.deque()
        self.cv = threading.Condition()
        self.vocab = 0
        self.cancelled = 0  # runs whose client left before they ended
        self.eos = frozenset(self.spec.eos_token_id)
        self._stopped = False
        self._pieces = pieces_of(tokenizer)

    @property
    def step(self) -> Any:
        """The step the runner calls (a test may wrap it)."""
        return self.runner.step

    @step.setter
    def step(self, step: Any) -> None:
        self.runner.step = step

    # -- the public side, called from other threads ---------------------------------

    def run(self) -> None:
        """Step on the calling thread until :meth:`stop` (after :meth:`warm`); a step
        that fails fails the runs in it, and the loop goes on.

        On a CPU, torch's OpenMP threads belong to the thread that first ran a
        parallel op, and a second thread stepping beside them pays for two sets on
        the same cores: the thread that loaded the file should step.
        """
        self._loop()

    def _loop(self) -> None:
        while self._wait():
            try:
                self.cycle()
            except Exception as exc:  # never leave the server stalled: fail who was running
                log.exception("serve: a step failed")
                self._fail(exc)

    def drive(self, batch: Batch) -> Batch:
        """A synchronous client's run: ``batch`` admitted and stepped on the calling
        thread until it is over (its errors raised here)."""
        self.pending.append(batch)
        while not batch.over:
            self.cycle()
        return batch

    def warm(self) -> None:
        """The first call of each variant and batch loads its kernels (and records its
        CUDA graph): done before the first request, not during it."""
        with torch.no_grad():
            for n in (1, 2):
                logits = self._prefill_logits(0, [0] * n)
            self.vocab = int(logits.shape[-1])
            for batch in self.batches:
                self._decode_logits(batch)

    def stop(self) -> None:
        with self.cv:
            self._stopped = True
            self.cv.notify()

    def submit(self, request: Request, sink: Sink, *, with_ids: bool = False) -> Run:
        """Queue a request (``with_ids``: its events carry the token ids); a
        :class:`RequestError` for ids past the vocabulary, :class:`EngineBusy` when
        ``max_queue`` runs already wait for a slot."""
        self._check(request)
        streams = [
            Stream(
                request,
                request_chooser(request, self.device, self.vocab, i),
                eos=self.eos,
                tokenizer=self.tokenizer,
                with_ids=with_ids,
                index=i,
                pieces=self._pieces,
            )
            for i in range(request.n)
        ]
        run = Run(streams, sink)
        with self.cv:
            free = sum(r is None for r in self.active)
            if len(self.pending) >= self.max_queue + free:
                raise EngineBusy(
                    f"the server is busy: {len(self.pending)} requests wait for a slot "
                    f"(--max-queue {self.max_queue}); retry later"
                )
            self.pending.append(run)
            self.cv.notify()
        return run

    def _check(self, request: Request) -> None:
        named = (request.prompt, [t for t, _ in request.logit_bias], request.stop_token_ids)
        for param, ids in zip(("prompt", "logit_bias", "stop_token_ids"), named):
            bad = [t for t in ids if t >= self.vocab]
            if bad:
                raise RequestError(
                    f"token id {bad[0]} is past the vocabulary of {self.vocab}", param=param
                )
        slots = len(self.active)
        if not 1 <= request.n <= slots:
            raise RequestError(
                f"'n' must be 1 to {slots}, got {request.n}: each choice takes a slot "
                f"(the file's max_batch={slots})",
                param="n",
            )
        if request.max_tokens < (request.prompt_logprobs is None):
            raise RequestError(
                f"'max_tokens' must be 1 or more (0 with prompt logprobs), got "
                f"{request.max_tokens}",
                param="max_tokens",
            )
        if request.constraint is not None and request.n > 1:
            raise RequestError("a constraint keeps one choice's state: n must be 1", param="n")

    def cancel(self, run: Run) -> None:
        """The client left: its slot (or queue place) is freed before the next step."""
        with self.cv:
            run.cancelled = True
            self.cv.notify()

    def load(self) -> dict[str, int]:
        with self.cv:
            busy = sum(r is not None for r in self.active)
            queued, left = len(self.pending), self.cancelled
            return {"slots": len(self.active), "busy": busy, "queued": queued, "cancelled": left}

    # -- the scheduler thread -------------------------------------------------------
    #
    # Each pass launches the next decode step before it reads the one before (as vLLM's
    # asynchronous scheduling): the tokens a step chooses stay on the device as the next
    # step's input, and reach the host through a non-blocking copy, so the host's work on
    # step N (text, events, admissions) overlaps the device's work on step N + 1. A run
    # that ends at step N has one more row computed at N + 1, which is dropped.

    def _wait(self) -> bool:
        """Wait for work; False once stopped."""
        with self.cv:
            while not (self._stopped or self.pending or any(self.active) or self.reading):
                self.cv.wait()
            return not self._stopped

    def cycle(self) -> None:
        """One pass of the loop: the runs that join now prefilled, one decode step of
        every busy slot launched, then the launch before it read and delivered."""
        with self.cv:
            self._drop_cancelled()
            joining = self._admit()
        with torch.no_grad():
            for slots, run in joining:
                self._join(slots, run)
            launched = any(self.active)
            if launched:
                self._decode()
            while len(self.reading) > launched:
                self._deliver(self.reading.popleft())

    def _fail(self, exc: Exception) -> None:
        """A step failed: every run in a slot ends with a :class:`Failed`."""
        self.reading.clear()
        failed = set()
        for slot, choice in enumerate(self.active):
            if choice is not None:
                first = id(choice.run) not in failed
                failed.add(id(choice.run))
                message = Failed(f"the model's step failed: {exc}")
                self._free(slot, message if first else None)

    def _drop_cancelled(self) -> None:
        kept = collections.deque(r for r in self.pending if not r.cancelled)
        self.cancelled += len(self.pending) - len(kept)
        self.pending = kept
        left = {id(c.run) for c in self.active if c is not None and c.run.cancelled}
        self.cancelled += len(left)
        for slot, choice in enumerate(self.active):
            if choice is not None and choice.run.cancelled:
                self._free(slot, None)

    def _admit(self) -> list[tuple[list[int], Run | Batch]]:
        """The runs that join now, in queue order, each with its free slots (the lowest)."""
        joining = []
        free = [slot for slot, c in enumerate(self.active) if c is None]
        while self.pending and len(free) >= self.pending[0].width:
            run = self.pending.popleft()
            slots, free = free[: len(run.streams)], free[len(run.streams) :]
            for slot, stream in zip(slots, run.streams):
                self.active[slot] = _Choice(run, stream)
            joining.append((slots, run))
        return joining

    def _free(self, slot: int, event: Event | None) -> None:
        """Empty the slot, sending its run ``event`` (if any)."""
        choice = self.active[slot]
        self.active[slot] = None
        self.runner.free(slot)
        if choice is not None and event is not None:
            choice.run.sink(event)

    def _prefill_logits(self, slot: int, prompt: list[int] | tuple[int, ...]) -> torch.Tensor:
        return self.runner.prefill(slot, prompt)

    def _decode_logits(self, batch: int) -> torch.Tensor:
        return self.runner.decode(batch)

    def _join(self, slots: list[int], run: Run | Batch) -> None:
        """Prefill the run's prompt once, into its first slot, then copy its entries to
        the others: each choice draws its first token from the same logits."""
        if run.cancelled:
            self.cancelled += 1
            for slot in slots:
                self._free(slot, None)
            return
        if isinstance(run, Batch):  # a generate call's rows, prefilled together
            self.runner.advance(run.width, self._take(run, slots, self.runner.prefill()))
            return
        prompt = run.streams[0].prefilled
        try:
            logits = self._prefill_logits(slots[0], prompt)
            for slot in slots[1:]:
                self.runner.copy(slots[0], slot, len(prompt))
            rows = [(i, slot, s) for i, (slot, s) in enumerate(zip(slots, run.streams))]
            reading = Reading(logits.expand(len(slots), -1), rows, self._pieces)
        except Exception as exc:
            log.exception("serve: a prefill failed")
            for i, slot in enumerate(slots):
                self._free(slot, None if i else Failed(f"the model's prefill failed: {exc}"))
            return
        for i, slot in enumerate(slots):
            self.runner.joined(slot, reading.tokens[i], len(prompt))
        self.reading.append(reading)

    def _decode(self) -> None:
        rows = [(slot, slot, c.stream) for slot, c in enumerate(self.active) if c is not None]
        batch = self.runner.batch_for(rows[-1][1])
        run = rows[0][2]
        if isinstance(run, Batch):
            self.runner.advance(
                batch, self._take(run, [r[1] for r in rows], self._decode_logits(batch))
            )
            return
        reading = Reading(self._decode_logits(batch), rows, self._pieces)
        self.runner.advance(batch, reading.tokens)
        self.reading.append(reading)

    def _take(self, batch: Batch, slots: list[int], logits: torch.Tensor) -> torch.Tensor:
        """A batch's tokens from one launch, chosen on the device; its slots freed once
        it is over."""
        tokens = batch.take(logits)
        if batch.over:
            for slot in slots:
                self._free(slot, None)
        return tokens

    def _deliver(self, reading: Reading) -> None:
        """Send each run of a launch its token; a run that ended since is skipped."""
        for (_, slot, stream), token, entries, forced in reading.results():
            choice = self.active[slot]
            if choice is not None and choice.stream is stream:
                self._next(slot, choice, token, entries, forced)

    def _next(
        self,
        slot: int,
        choice: _Choice,
        token: int,
        entries: tuple[TokenLogprob, ...],
        forced: bool,
    ) -> None:
        event = choice.stream.next(token, entries, forced)
        if event is None:
            return
        if event.finish is not None:
            self._free(slot, event)
        else:
            choice.run.sink(event)
