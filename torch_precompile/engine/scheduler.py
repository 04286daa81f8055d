"""The scheduler: requests in the slots of one static cache, decoded together
(continuous batching).

One thread owns the cache (:class:`~.runner.SlotRunner`). A request takes the
free slot whose kept entries its prompt begins with the most (else the lowest
free slot), is prefilled there past them, a chunk a pass between decode steps
(:mod:`.prefix`), then decodes with every other busy slot at each step. A
request of ``n`` choices waits for ``n`` free slots, is prefilled
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
from typing import Any

import torch

from .batch import Batch
from .errors import EngineBusy
from .output import Reading, Stream, request_chooser
from .prefix import Filling, SlotCaches
from .requests import Event, Failed, Request, TokenLogprob
from .runner import Loaded, Runner, SlotRunner
from .runs import Choice, Run, Sink, check
from .text import pieces_of

log = logging.getLogger("torch_precompile")

# Prompt tokens prefilled a pass between decode steps (llama.cpp's default n_ubatch).
PREFILL_CHUNK = 512


class Scheduler:
    """The loop over a generator file's runner (see the module docstring): the slot
    runner unless ``runner`` names another.

    ``prefill_chunk``: the prompt tokens prefilled a pass (0: a prompt at once);
    ``reuse``: whether a prompt reuses a free slot's kept entries.
    """

    def __init__(
        self,
        generator: Loaded,
        *,
        max_queue: int,
        tokenizer: Any = None,
        runner: Runner | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        reuse: bool = True,
    ) -> None:
        self.runner: Any = SlotRunner(generator) if runner is None else runner
        self.spec, self.tokenizer = generator.spec, tokenizer
        self.max_queue = max_queue
        self.device = self.runner.device
        self.batches = getattr(self.runner, "batches", [self.runner.slots])
        self.reading: collections.deque[Reading] = collections.deque()  # launched, unread
        self.active: list[Choice | None] = [None] * self.runner.slots
        self.pending: collections.deque[Run | Batch] = collections.deque()
        self.cv = threading.Condition()
        self.vocab = 0
        self.cancelled = 0  # runs whose client left before they ended
        self.eos = frozenset(self.spec.eos_token_id)
        self._stopped = False
        self._pieces = pieces_of(tokenizer)
        self.caches = SlotCaches(self.runner.slots, self.spec.max_length)
        self.chunk, self.reuse = prefill_chunk, reuse
        self.fills: list[tuple[list[int], Run]] = []  # prefills under way, in queue order

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
        CUDA graph): done before the first request, not during it. On a CPU, where a
        batch's first call adds only its loop's full guard check (3-4 ms of a 50 ms
        step for the SmolLM2-135M shape), the decode steps are warmed at their two
        smallest batches, one of each program (``step_batches``): the larger ones'
        compute was most of the warm-up (0.26 s of 0.30 on a 2-core EPYC)."""
        batches = self.batches if self.device.type != "cpu" else self.batches[:2]
        with torch.no_grad():
            for n in (1, 2):
                logits = self._prefill_logits(0, [0] * n)
            self.vocab = int(logits.shape[-1])
            for batch in batches:
                self._decode_logits(batch)
            try:  # a prefill at an offset: what reuse and chunks need of the file's step
                for n in (1, 2):
                    self._prefill_logits(0, [0] * n, 2)
            except Exception as exc:
                log.info("serve: no prefix reuse or chunked prefill with this file: %s", exc)
                self.reuse, self.chunk = False, 0

    def stop(self) -> None:
        with self.cv:
            self._stopped = True
            self.cv.notify()

    def submit(self, request: Request, sink: Sink, *, with_ids: bool = False) -> Run:
        """Queue a request (``with_ids``: its events carry the token ids); a
        :class:`RequestError` for ids past the vocabulary, :class:`EngineBusy` when
        ``max_queue`` runs already wait for a slot."""
        check(request, self.vocab, len(self.active))
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
        """One pass of the loop: the runs that join now admitted, up to a chunk of the
        prefills under way, one decode step of every slot past its prefill launched,
        then the launch before it read and delivered."""
        with self.cv:
            self._drop_cancelled()
            joining = self._admit()
        with torch.no_grad():
            for slots, run in joining:
                self._join(slots, run)
            self._fill()
            launched = any(c is not None and c.filling is None for c in self.active)
            if launched:
                self._decode()
            while len(self.reading) > launched:
                self._deliver(self.reading.popleft())

    def _fail(self, exc: Exception) -> None:
        """A step failed: every run in a slot ends with a :class:`Failed`."""
        self.reading.clear()
        self.fills.clear()
        failed = set()
        for slot, choice in enumerate(self.active):
            if choice is not None:
                first = id(choice.run) not in failed
                failed.add(id(choice.run))
                message = Failed(f"the model's step failed: {exc}")
                self._free(slot, message if first else None, keep=False)

    def _drop_cancelled(self) -> None:
        kept = collections.deque(r for r in self.pending if not r.cancelled)
        self.cancelled += len(self.pending) - len(kept)
        self.pending = kept
        left = {id(c.run) for c in self.active if c is not None and c.run.cancelled}
        self.cancelled += len(left)
        for slot, choice in enumerate(self.active):
            if choice is not None and choice.run.cancelled:
                self._free(slot, None)
        self.fills = [(slots, run) for slots, run in self.fills if not run.cancelled]

    def _admit(self) -> list[tuple[list[int], Run | Batch]]:
        """The runs that join now, in queue order, each with its free slots: first the
        one whose kept entries its prompt begins with the most, then the lowest (a
        generate call's batch: the lowest)."""
        joining = []
        free = [slot for slot, c in enumerate(self.active) if c is None]
        while self.pending and len(free) >= self.pending[0].width:
            run = self.pending.popleft()
            first = (
                free[0]
                if isinstance(run, Batch)
                else self.caches.choose(free, run.streams[0].prefilled)
            )
            free.remove(first)
            slots, free = [first, *free[: len(run.streams) - 1]], free[len(run.streams) - 1 :]
            for slot, stream in zip(slots, run.streams):
                self.active[slot] = Choice(run, stream)
            joining.append((slots, run))
        return joining

    def _free(self, slot: int, event: Event | None, *, keep: bool = True) -> None:
        """Empty the slot, sending its run ``event`` (if any); the slot keeps the
        entries its run wrote (``keep``) for a later prompt that begins with them."""
        choice = self.active[slot]
        self.active[slot] = None
        kept: tuple[int, ...] = ()
        if choice is not None and keep and isinstance(choice.run, Run):
            fill = choice.filling
            if fill is None:
                kept = choice.stream.fed()
            elif fill.slot == slot:  # the other choices' slots wait for its copy
                kept = fill.tokens[: fill.done]
        self.runner.free(slot, self.caches.keep(slot, kept))
        if choice is not None and event is not None:
            choice.run.sink(event)

    def _prefill_logits(
        self, slot: int, prompt: list[int] | tuple[int, ...], start: int = 0
    ) -> torch.Tensor:
        return self.runner.prefill(slot, prompt, start)

    def _decode_logits(self, batch: int) -> torch.Tensor:
        return self.runner.decode(batch)

    def _join(self, slots: list[int], run: Run | Batch) -> None:
        """The run's prefill, under way in its first slot past the entries it reuses (a
        generate call's batch: its rows prefilled together, at once)."""
        if run.cancelled:  # nothing written: what the slots kept is not known here
            self.cancelled += 1
            for slot in slots:
                self._free(slot, None, keep=False)
            return
        if isinstance(run, Batch):  # a generate call's rows, prefilled together
            self.runner.advance(run.width, self._take(run, slots, self.runner.prefill()))
            return
        prompt = run.streams[0].prefilled
        slot, reused = slots[0], 0
        if self.reuse:
            reused = self.caches.match(slot, prompt)
        self.caches.keep(slot, ())
        fill = Filling(slot, tuple(prompt), reused, reused)
        for s in slots:
            choice = self.active[s]
            if choice is not None:
                choice.filling = fill
        self.runner.filling(slot, reused)
        self.fills.append((slots, run))

    def _fill(self) -> None:
        """Prefill up to ``chunk`` prompt tokens (0: every prompt whole), in queue order."""
        budget = self.chunk
        while self.fills and (budget > 0 or self.chunk <= 0):
            slots, run = self.fills[0]
            fill = self.active[slots[0]].filling  # type: ignore[union-attr]
            assert fill is not None
            start, tokens = fill.next_chunk(budget)
            try:
                logits = self._prefill_logits(fill.slot, tokens, start)
            except Exception as exc:
                log.exception("serve: a prefill failed")
                self.fills.pop(0)
                for i, slot in enumerate(slots):
                    failed = None if i else Failed(f"the model's prefill failed: {exc}")
                    self._free(slot, failed, keep=False)
                continue
            fill.done += len(tokens)
            budget -= len(tokens)
            self.runner.filling(fill.slot, fill.done)
            if fill.finished:
                self.fills.pop(0)
                self._joined(slots, run, logits, fill)

    def _joined(self, slots: list[int], run: Run, logits: torch.Tensor, fill: Filling) -> None:
        """The prompt is in: its entries copied to the run's other slots, each choice
        drawing its first token from the same logits."""
        length = len(fill.tokens)
        for slot in slots[1:]:
            self.runner.copy(slots[0], slot, length)
        rows = [(i, slot, s) for i, (slot, s) in enumerate(zip(slots, run.streams))]
        for slot, stream in zip(slots, run.streams):
            stream.cached = fill.reused
            self.active[slot].filling = None  # type: ignore[union-attr]
        reading = Reading(logits.expand(len(slots), -1), rows, self._pieces)
        for i, slot in enumerate(slots):
            self.runner.joined(slot, reading.tokens[i], length)
        self.reading.append(reading)

    def _decode(self) -> None:
        busy = enumerate(self.active)
        rows = [(slot, slot, c.stream) for slot, c in busy if c is not None and c.filling is None]
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
        choice: Choice,
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
