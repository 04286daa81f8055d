"""The output stage: from a step's logits to each run's token, text and finish.

In order, for the rows whose choice is more than the argmax: the request's bias
and penalties (:class:`~.sampling.Penalties`), the end tokens banned until
``min_new_tokens``, the constraint's mask (:mod:`.constraint`), then the warpers
and the draw (:class:`~.sampling.Sampler`). A :class:`Chooser` does this for one
run (the server's) or a batch of rows in lockstep (``Generator.generate``);
:class:`Stream` turns a server run's tokens into :class:`~.requests.Delta` events
(end tokens, stop token ids, stop strings, ``max_tokens``, a done constraint);
:class:`Reading` is one launch's tokens and logprobs on their way to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .constraint import Guided
from .requests import Delta, Finish, Request, TokenLogprob, Usage
from .sampling import Penalties, Sampler
from .text import IncrementalText

# Each token's text as logprobs show it, and its own bytes.
Pieces = Callable[[list[int]], list[tuple[str, bytes]]]


class Chooser:
    """The next token of each row from its logits (see the module docstring).

    ``guides``: one :class:`~.constraint.Guided` (or None) per row. ``banned``: token
    ids at ``-inf`` while fewer than ``min_tokens`` were chosen. ``penalties_for``:
    the penalties made at the first step, given the vocabulary's size.
    """

    def __init__(
        self,
        sampler: Sampler,
        penalties: Penalties | None = None,
        *,
        penalties_for: Callable[[int], Penalties] | None = None,
        guides: Sequence[Guided | None] = (),
        banned: torch.Tensor | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.sampler, self.penalties, self._penalties_for = sampler, penalties, penalties_for
        self.guides = list(guides) if any(g is not None for g in guides) else []
        self.banned, self.min_tokens = banned, min_tokens
        self.steps = 0  # tokens chosen so far

    @property
    def plain(self) -> bool:
        """Whether the choice is the logits' argmax (no penalty, constraint or sampling)."""
        plain = self.penalties is None and self._penalties_for is None
        return plain and not self.guides and not self.sampler.do_sample

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The ``(rows, vocab)`` scores the next tokens are drawn from."""
        if self._penalties_for is not None:
            self.penalties, self._penalties_for = self._penalties_for(logits.shape[-1]), None
        scores = logits if self.penalties is None else self.penalties.apply(logits)
        if self.banned is not None and self.steps < self.min_tokens:
            scores = scores.index_fill(1, self.banned, -float("inf"))
        if self.guides:
            rows = [
                scores[i : i + 1] if g is None else g.mask(scores[i : i + 1])
                for i, g in enumerate(self.guides)
            ]
            scores = torch.cat(rows)
        return self.sampler.process(scores)

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        return self.sampler.pick(scores)

    def chosen(self, tokens: torch.Tensor) -> None:
        """The ``(rows,)`` tokens the rows take (after any padding of ended rows)."""
        self.steps += 1
        if self.penalties is not None:
            self.penalties.count(tokens)
        for i, guide in enumerate(self.guides):
            if guide is not None:
                guide.chose(tokens[i])

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        tokens = self.pick(self.scores(logits))
        self.chosen(tokens)
        return tokens


def request_chooser(request: Request, device: torch.device, vocab: int, index: int = 0) -> Chooser:
    """One server run's chooser (its choice ``index``): its sampler, penalties over its
    prompt, constraint."""
    sampler = Sampler(
        request.temperature > 0,
        request.temperature or 1.0,
        request.top_k,
        request.top_p,
        None if request.seed is None else request.seed + index,
        device,
        min_p=request.min_p,
    )
    penalties = None
    if request.penalized:
        penalties = Penalties(
            torch.tensor([request.prompt], device=device),
            vocab,
            logit_bias=dict(request.logit_bias),
            presence=request.presence_penalty,
            frequency=request.frequency_penalty,
            repetition=request.repetition_penalty,
        )
    constraint = request.constraint
    if isinstance(constraint, tuple):
        constraint = constraint[index]
    guide = Guided(constraint) if constraint is not None else None
    return Chooser(sampler, penalties, guides=[guide])


class Stream:
    """A server run's tokens so far, their text, and when it ends."""

    def __init__(
        self,
        request: Request,
        chooser: Chooser,
        *,
        eos: frozenset[int],
        tokenizer: Any,
        with_ids: bool,
        pieces: Pieces,
        index: int = 0,
    ) -> None:
        self.request, self.chooser, self.index = request, chooser, index
        self.eos = eos
        self.ends = (frozenset() if request.ignore_eos else eos) | request.stop_token_ids
        self.text = IncrementalText(tokenizer, request.stop) if tokenizer is not None else None
        self.with_ids = with_ids or tokenizer is None
        self.tokens: list[int] = []
        # The prompt's tokens the decode step is fed before any is chosen (prompt_logprobs).
        self.forced = list(request.prompt[1:]) if request.prompt_logprobs is not None else []
        self.prompt_entries: list[TokenLogprob] = []
        self.cached = 0  # the prompt's tokens a slot's kept entries held (not prefilled)
        if request.prompt_logprobs is not None:
            ((text, raw),) = pieces([request.prompt[0]])
            self.prompt_entries.append(TokenLogprob(text, raw, None, token_id=request.prompt[0]))

    @property
    def prefilled(self) -> tuple[int, ...]:
        """The tokens the prefill takes: the prompt, or its first token alone where the
        rest is teacher-forced for its logprobs."""
        return self.request.prompt[:1] if self.forced else self.request.prompt

    def fed(self) -> tuple[int, ...]:
        """The tokens whose entries the slot's cache holds so far: the prompt's (a
        teacher-forced one once the step after it is launched) and each new token but
        the last, which the next step takes as its input."""
        prompt, tokens = self.request.prompt, tuple(self.tokens)
        if self.request.prompt_logprobs is not None and not tokens:
            return prompt[: max(len(self.prompt_entries) - 1, 1)]
        return prompt + tokens[:-1]

    def force(self) -> int | None:
        """The prompt token this launch feeds on, instead of a choice (None: choose)."""
        return self.forced.pop(0) if self.forced else None

    def next(self, token: int, logprobs: tuple[TokenLogprob, ...], forced: bool) -> Delta | None:
        """The run's next token as an event, with its finish if the run ends there; a
        prompt token (``forced``) is news once the whole prompt is in."""
        request = self.request
        prompt = len(request.prompt)
        if forced or request.max_tokens == 0:
            self.prompt_entries += logprobs if forced else ()
            if len(self.prompt_entries) < prompt:
                return None
            finish = None
            if request.max_tokens == 0:
                finish = Finish("length", Usage(prompt, 0, self.cached))
            return Delta((), "", (), 0, finish, self.index, tuple(self.prompt_entries))
        self.tokens.append(token)
        if self.text is not None and token not in self.eos:
            self.text.add(token)
        reason = None
        guides = self.chooser.guides
        if token in self.ends or (guides and guides[0].done_after(len(self.tokens))):
            reason = "stop"
        elif len(self.tokens) >= request.max_tokens:
            reason = "length"
        text, stopped = ("", False)
        if self.text is not None:
            text, stopped = self.text.take(reason is not None)
        if stopped:
            reason = "stop"
        finish = None
        if reason is not None:
            finish = Finish(reason, Usage(len(request.prompt), len(self.tokens), self.cached))
        ids = (token,) if self.with_ids else ()
        return Delta(ids, text, logprobs, len(self.tokens), finish, self.index)


class Reading:
    """The tokens one launch chose, on the device, and on their way to the host.

    Everything is derived from the step's logits before the next step is launched (a
    CUDA-graph step's logits are overwritten by the next replay); the host copies are
    non-blocking and one event marks their end, so :meth:`results` waits for this launch
    only, not for the steps queued behind it. ``rows``: (row of the logits, key, stream).
    """

    def __init__(
        self, logits: torch.Tensor, rows: list[tuple[int, Any, Stream]], pieces: Pieces
    ) -> None:
        self.rows, self.pieces = rows, pieces
        self.tokens = logits.argmax(-1)
        self.forced: list[bool] = []
        extra: list[torch.Tensor] = []
        for row, _, stream in rows:
            prompt_token = stream.force()
            self.forced.append(prompt_token is not None)
            if prompt_token is not None:  # teacher-forced: the prompt's own next token
                self.tokens[row] = prompt_token
            elif not stream.chooser.plain:
                chooser = stream.chooser
                self.tokens[row] = chooser.pick(chooser.scores(logits[row : row + 1]))[0]
                chooser.chosen(self.tokens[row : row + 1])
            request = stream.request
            top = request.logprobs if prompt_token is None else request.prompt_logprobs
            if top is not None:
                logprobs = logits[row].log_softmax(-1)
                best = logprobs.topk(top)
                chosen = logprobs[self.tokens[row]]
                extra += [chosen, best.values, best.indices]
                if prompt_token is not None:
                    extra.append((logprobs > chosen).sum() + 1)
        self.host = [t.to("cpu", non_blocking=True) for t in (self.tokens, *extra)]
        self.done = None
        if logits.device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()

    def results(
        self,
    ) -> list[tuple[tuple[int, Any, Stream], int, tuple[TokenLogprob, ...], bool]]:
        """Per row: the row, its token, its logprob (if asked), whether it was forced."""
        if self.done is not None:
            self.done.synchronize()
        tokens, extra = self.host[0].tolist(), iter(self.host[1:])
        out = []
        for row, forced in zip(self.rows, self.forced):
            token, entries = tokens[row[0]], ()
            request = row[2].request
            if (request.prompt_logprobs if forced else request.logprobs) is not None:
                chosen, values, ids = next(extra), next(extra), next(extra)
                rank = int(next(extra)) if forced else 0
                pieces = self.pieces(ids.tolist())
                top = tuple((t, lp, b) for (t, b), lp in zip(pieces, values.tolist()))
                ((piece, raw),) = self.pieces([token])
                entries = (
                    TokenLogprob(piece, raw, float(chosen), top, token, tuple(ids.tolist()), rank),
                )
            out.append((row, token, entries, forced))
        return out
