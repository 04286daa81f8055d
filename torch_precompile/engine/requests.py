"""What passes through the engine, as frozen values: a :class:`Request` in, its
:class:`Delta` events out (tokens and text, then the finish with its reason and
usage), or a :class:`Failed` when the model's step fails."""

from __future__ import annotations

import dataclasses

from .constraint import Constraint


@dataclasses.dataclass(frozen=True)
class Request:
    """One run: the prompt (token ids) and how its tokens are chosen and end.

    ``temperature`` 0 is greedy. ``logprobs``: the top-n alternatives of each token
    (0: the chosen token's logprob alone; None: none). ``stop`` strings end the text
    before them; ``stop_token_ids`` end it after them, as the model's end tokens do
    unless ``ignore_eos``. ``constraint``: the tokens allowed at each step
    (:class:`~torch_precompile.engine.constraint.Constraint`). ``n``: choices from the
    one prompt, each in its own slot (choice ``i`` sampled with ``seed + i``).
    ``prompt_logprobs``: each prompt token's logprob after the tokens before it, with
    its top-n alternatives (0: none), teacher-forced through the decode step; then
    ``max_tokens`` (0: none) new tokens. ``constraint``: one, or a tuple of one per
    choice (each keeps its own state).
    """

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None
    constraint: Constraint | tuple[Constraint, ...] | None = dataclasses.field(
        default=None, compare=False
    )

    @property
    def penalized(self) -> bool:
        """Whether a bias or penalty changes the logits the token is chosen from."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and its ``top`` alternatives, each ``(text, logprob,
    bytes)`` (their ids in ``top_ids``); ``text`` as logprobs show the token alone;
    ``rank``: 1 for the likeliest token (prompt tokens only; else 0). The prompt's
    first token has none (``logprob`` None): nothing comes before it."""

    token: str
    bytes: bytes
    logprob: float | None
    top: tuple[tuple[str, float, bytes], ...] = ()
    token_id: int = -1
    top_ids: tuple[int, ...] = ()
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class Usage:
    """A run's tokens: ``cached_tokens`` of the prompt's were a slot's kept entries,
    not prefilled again (OpenAI's ``prompt_tokens_details.cached_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True)
class Finish:
    """Why a run ended (``"stop"``: an end token, stop string or done constraint;
    ``"length"``: ``max_tokens``) and what it used."""

    reason: str
    usage: Usage


@dataclasses.dataclass(frozen=True)
class Delta:
    """A step's news for one run: its token, the text that may be sent now (held back
    while it could begin a stop string), its logprob if asked, and the finish once
    the run ends. ``tokens``: the run's tokens so far; ``index``: its choice;
    ``prompt_logprobs``: the prompt's tokens, once, where asked."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    tokens: int
    finish: Finish | None = None
    index: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class Failed:
    """The model's step failed while the run was in it: the run is over."""

    message: str


Event = Delta | Failed
