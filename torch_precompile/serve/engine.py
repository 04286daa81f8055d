"""The scheduler: requests in the slots of one static cache, decoded together (continuous batching).

One thread owns the cache. Each of its ``max_batch`` rows is a *slot*: a
request joining a free slot is prefilled alone (batch 1, the step's prefill
variant on views of that slot's rows) from cache index 0, so in a slot the
cache index is the position; then every step decodes all slots at once with
the slot step (``start`` a ``(batch,)`` tensor, each row its own offset).
A step runs on the first rows only: as many as the highest busy slot needs,
rounded up to a power of two (a request takes the lowest free slot, so one
client's step is two rows, not ``max_batch``). Free slots among them decode
too (token 0 at index 0, attending to that one entry, so no NaN): a few
shapes, each recorded once, and a row's result never depends on its
neighbours. A request leaves at its end token (or a stop token id), its stop string, its
``max_tokens`` or its client's disconnect, freeing its slot for the next in
the queue at once.

The engine's cache is its own, not the ``Generator``'s: ``Generator.generate``
in the same process touches other tensors.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..lean.cudagraphs import not_recorded
from ..runtime.generator import Generator
from ..runtime.sampling import Penalties, Sampler
from .detokenizer import IncrementalText, token_bytes
from .protocol import ApiError, Job

log = logging.getLogger("torch_precompile")

# A run's events go to its sink: {"text", "entries", "finish", "tokens"} or {"error"}.
Sink = Callable[[dict[str, Any]], None]


class NotServable(ValueError):
    """A generator file the server cannot batch (built without the slot step)."""


class _Run:
    """A request in the engine: its job, sampler, tokens so far and their text."""

    def __init__(
        self, job: Job, sink: Sink, device: torch.device, tokenizer: Any, vocab: int
    ) -> None:
        self.job, self.sink = job, sink
        sample = job.temperature > 0
        self.sampler = Sampler(
            sample, job.temperature or 1.0, job.top_k, job.top_p, job.seed, device, min_p=job.min_p
        )
        self.penalties = None
        if job.penalized:
            self.penalties = Penalties(
                torch.tensor([job.prompt], device=device),
                vocab,
                logit_bias=job.logit_bias,
                presence=job.presence_penalty,
                frequency=job.frequency_penalty,
                repetition=job.repetition_penalty,
            )
        self.tokens: list[int] = []
        self.text = IncrementalText(tokenizer, job.stop) if tokenizer is not None else None
        self.cancelled = False
        self.chosen: list[torch.Tensor] = []  # the constraint's tokens, on the device
        self.accepted = 0

    def guide(self, count: int) -> Any:
        """The job's constraint, told the run's first ``count`` tokens."""
        constraint = self.job.constraint
        for token in self.chosen[self.accepted : count]:
            constraint.accept(int(token))
        self.accepted = max(self.accepted, count)
        return constraint


class Engine:
    """Continuous batching over a generator file's slot step (see the module docstring)."""

    def __init__(self, generator: Generator, *, max_queue: int, tokenizer: Any = None) -> None:
        spec = generator.spec
        if not spec.slots:
            raise NotServable(
                "this generator file has no slot decode step (built before serve existed, or a "
                "model whose attention cannot take a per-row mask: ALiBi families such as Bloom "
                "and Falcon): build it again with compile_generator, or use Generator.generate"
            )
        self.step, self.spec, self.tokenizer = generator.run_step, spec, tokenizer
        self.max_queue = max_queue
        self.device = torch.device(spec.device)
        slots, length = spec.max_batch, spec.max_length
        dtype = getattr(torch, spec.dtype)
        self.cache = [
            torch.zeros((slots, h, length, d), dtype=dtype, device=self.device)
            for h, d in spec.kv_shapes
        ]
        self.full = torch.ones((slots, length), dtype=torch.long, device=self.device)
        # Per slot, on the device: its next input token, the cache index it goes to, and
        # 1 while a run holds the slot (a free slot decodes token 0 at index 0).
        self.ids = torch.zeros((slots, 1), dtype=torch.long, device=self.device)
        self.index = torch.zeros((slots,), dtype=torch.long, device=self.device)
        self.member = torch.zeros((slots,), dtype=torch.long, device=self.device)
        self.batches = step_batches(slots)
        # Per batch, the decode step as one loop over views of the first rows (the
        # guards are checked at its first call: the engine owns the model and cache).
        self._decode_steps = {
            batch: generator.loop([t[:batch] for t in self.cache]) for batch in self.batches
        }
        self.reading: collections.deque[_Reading] = collections.deque()  # launched, unread
        self.active: list[_Run | None] = [None] * slots
        self.pending: collections.deque[_Run] = collections.deque()
        self.cv = threading.Condition()
        self.vocab = 0
        self.cancelled = 0  # runs whose client left before they ended
        self.eos = set(spec.eos_token_id)
        self._stopped = False
        self._bytes = token_bytes(tokenizer) if tokenizer is not None else None
        # The model's own sampling settings and max_new_tokens, for a request that leaves
        # them out (as vLLM's, which reads the same generation_config).
        self.defaults = {k: v for k, v in spec.sampling if k != "do_sample"}
        own = dict(spec.lengths).get("max_new_tokens")
        if own is not None:
            self.defaults["max_tokens"] = own

    # -- the public side, called from the HTTP threads ------------------------------

    def run(self) -> None:
        """Serve on the calling thread until :meth:`stop` (after :meth:`warm`).

        The server steps on the thread that loaded the file: on a CPU, torch's OpenMP
        threads belong to the thread that first ran a parallel op, and a second thread
        stepping beside them pays for two sets on the same cores (a tiny model's step
        took 5.7 ms there against 0.9 ms here, 2 cores).
        """
        self._loop()

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

    def submit(self, job: Job, sink: Sink) -> _Run:
        """Queue a job; 503 when ``max_queue`` jobs already wait for a slot."""
        named = (job.prompt, job.logit_bias, job.stop_token_ids)
        for param, ids in zip(("prompt", "logit_bias", "stop_token_ids"), named):
            bad = [t for t in ids if t >= self.vocab]
            if bad:
                raise ApiError(
                    400, f"token id {bad[0]} is past the vocabulary of {self.vocab}", param=param
                )
        run = _Run(job, sink, self.device, self.tokenizer, self.vocab)
        with self.cv:
            free = sum(r is None for r in self.active)
            if len(self.pending) >= self.max_queue + free:
                raise ApiError(
                    503,
                    f"the server is busy: {len(self.pending)} requests wait for a slot "
                    f"(--max-queue {self.max_queue}); retry later",
                    kind="server_overloaded",
                )
            self.pending.append(run)
            self.cv.notify()
        return run

    def cancel(self, run: _Run) -> None:
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

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not (self._stopped or self.pending or any(self.active) or self.reading):
                    self.cv.wait()
                if self._stopped:
                    return
                self._drop_cancelled()
                joining = self._admit()
            try:
                with torch.no_grad():
                    for slot, run in joining:
                        self._join(slot, run)
                    launched = any(self.active)
                    if launched:
                        self._decode()
                    while len(self.reading) > launched:
                        self._deliver(self.reading.popleft())
            except Exception as exc:  # never leave the server stalled: fail who was running
                log.exception("serve: a step failed")
                self.reading.clear()
                for slot, run in enumerate(self.active):
                    if run is not None:
                        self._free(slot, {"error": f"the model's step failed: {exc}"})

    def _drop_cancelled(self) -> None:
        kept = collections.deque(r for r in self.pending if not r.cancelled)
        self.cancelled += len(self.pending) - len(kept)
        self.pending = kept
        for slot, run in enumerate(self.active):
            if run is not None and run.cancelled:
                self.cancelled += 1
                self._free(slot, None)

    def _admit(self) -> list[tuple[int, _Run]]:
        joining = []
        for slot, run in enumerate(self.active):
            if run is None and self.pending:
                self.active[slot] = self.pending.popleft()
                joining.append((slot, self.active[slot]))
        return joining

    def _free(self, slot: int, event: dict[str, Any] | None) -> None:
        """Empty the slot: the device rows go back to token 0 at index 0, queued after
        the steps already launched."""
        run = self.active[slot]
        self.active[slot] = None
        self.ids[slot], self.index[slot], self.member[slot] = 0, 0, 0
        if run is not None and event is not None:
            run.sink(event)

    def _prefill_logits(self, slot: int, prompt: list[int]) -> torch.Tensor:
        n, length = len(prompt), self.spec.max_length
        ids = torch.tensor([prompt], dtype=torch.long)
        if self.device.type == "cuda":  # pinned, so the copy does not wait for the device
            ids = ids.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        mask = torch.zeros((1, length), dtype=torch.long, device=self.device)
        mask[:, :n] = 1
        positions = torch.arange(n, device=self.device)[None]
        start = torch.zeros((), dtype=torch.long, device=self.device)
        rows = [t[slot : slot + 1] for t in self.cache]
        with not_recorded():  # no CUDA graph a prompt length (lean/cudagraphs.py)
            return self.step(ids, mask, positions, start, *rows)[:, -1, :].float()

    def _decode_logits(self, batch: int) -> torch.Tensor:
        """One decode step of the first ``batch`` slots (views of their rows)."""
        index = self.index[:batch]
        step = self._decode_steps[batch]
        out = step(self.ids[:batch], self.full[:batch], index[:, None].clone(), index)
        return out[:, -1, :].float()

    def _join(self, slot: int, run: _Run) -> None:
        if run.cancelled:
            self.cancelled += 1
            self._free(slot, None)
            return
        try:
            logits = self._prefill_logits(slot, run.job.prompt)
            reading = _Reading(logits, [(0, slot, run)], self._pieces)
        except Exception as exc:
            log.exception("serve: a prefill failed")
            self._free(slot, {"error": f"the model's prefill failed: {exc}"})
            return
        self.ids[slot, 0] = reading.tokens[0]
        self.index[slot], self.member[slot] = len(run.job.prompt), 1
        self.reading.append(reading)

    def _decode(self) -> None:
        rows = [(slot, slot, run) for slot, run in enumerate(self.active) if run is not None]
        batch = next(b for b in self.batches if b > rows[-1][1])
        reading = _Reading(self._decode_logits(batch), rows, self._pieces)
        member = self.member[:batch]
        self.ids[:batch].copy_((reading.tokens * member)[:, None])
        self.index[:batch].add_(member)
        self.reading.append(reading)

    def _deliver(self, reading: _Reading) -> None:
        """Send each run of a launch its token; a run that ended since is skipped."""
        for (_, slot, run), token, entries in reading.results():
            if self.active[slot] is run:
                self._next(slot, run, token, entries)

    def _next(self, slot: int, run: _Run, token: int, entries: list[dict[str, Any]]) -> None:
        """Send the slot's run its next token, and end the run if it is done."""
        job = run.job
        run.tokens.append(token)
        if run.text is not None and token not in self.eos:
            run.text.add(token)
        finish = None
        done = job.constraint is not None and run.guide(len(run.tokens)).done()
        if (token in self.eos and not job.ignore_eos) or token in job.stop_token_ids or done:
            finish = "stop"
        elif len(run.tokens) >= job.max_tokens:
            finish = "length"
        text, stopped = run.text.take(finish is not None) if run.text is not None else ("", False)
        event = {"text": text, "entries": entries, "finish": finish, "tokens": len(run.tokens)}
        if job.return_token_ids or self.tokenizer is None:
            event["ids"] = [token]
        if stopped:
            event["finish"] = "stop"
        if event["finish"] is not None:
            self._free(slot, event)
        else:
            run.sink(event)

    def _pieces(self, tokens: list[int]) -> list[tuple[str, bytes]]:
        """Each token's text, as logprobs show it, and its own bytes."""
        if self._bytes is None:  # no tokenizer
            return [(f"token_id:{t}", f"token_id:{t}".encode()) for t in tokens]
        decode = self.tokenizer.decode
        return [(decode([t], skip_special_tokens=False), self._bytes(t)) for t in tokens]


def step_batches(slots: int) -> list[int]:
    """The batches a decode step runs at: powers of two from 2, then ``slots``. The slot
    step is compiled for 2 rows or more (one row is the prefill's shape), unless the
    file has one slot."""
    if slots == 1:
        return [1]
    return [b for b in (2**i for i in range(1, slots.bit_length())) if b < slots] + [slots]


class _Reading:
    """The tokens one launch chose, on the device, and on their way to the host.

    Everything is derived from the step's logits before the next step is launched (a
    CUDA-graph step's logits are overwritten by the next replay); the host copies are
    non-blocking and one event marks their end, so :meth:`results` waits for this launch
    only, not for the steps queued behind it.
    """

    def __init__(
        self,
        logits: torch.Tensor,
        rows: list[tuple[int, int, _Run]],
        pieces: Callable[[list[int]], list[tuple[str, bytes]]],
    ) -> None:
        self.rows, self.pieces = rows, pieces
        self.tokens = logits.argmax(-1)
        extra: list[torch.Tensor] = []
        for row, _, run in rows:
            job, penalties = run.job, run.penalties
            constrained = job.constraint is not None
            if penalties is not None or job.temperature > 0 or constrained:
                scores = logits[row : row + 1]
                scores = scores if penalties is None else penalties.apply(scores)
                if constrained:
                    allowed = run.guide(len(run.chosen)).allowed_mask(scores.shape[-1])
                    if allowed is not None:
                        allowed = allowed.to(scores.device, non_blocking=True)
                        scores = scores.masked_fill(~allowed[None], -float("inf"))
                self.tokens[row] = run.sampler.pick(run.sampler.process(scores))[0]
                if constrained:
                    run.chosen.append(self.tokens[row].clone())
            if penalties is not None:
                penalties.count(self.tokens[row : row + 1])
            if job.logprobs is not None:
                logprobs = logits[row].log_softmax(-1)
                top = logprobs.topk(job.logprobs)
                extra += [logprobs[self.tokens[row]], top.values, top.indices]
        self.host = [t.to("cpu", non_blocking=True) for t in (self.tokens, *extra)]
        self.done = None
        if logits.device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()

    def results(self) -> list[tuple[tuple[int, int, _Run], int, list[dict[str, Any]]]]:
        """Per row: the row, its token, and its log-probability entries (if asked)."""
        if self.done is not None:
            self.done.synchronize()
        tokens, extra = self.host[0].tolist(), iter(self.host[1:])
        out = []
        for row in self.rows:
            token, job = tokens[row[0]], row[2].job
            entries = []
            if job.logprobs is not None:
                chosen, values, ids = next(extra), next(extra), next(extra)
                pieces = self.pieces(ids.tolist())
                top = [(t, lp, b) for (t, b), lp in zip(pieces, values.tolist())]
                ((piece, raw),) = self.pieces([token])
                entries = [{"token": piece, "bytes": raw, "logprob": float(chosen), "top": top}]
            out.append((row, token, entries))
        return out
