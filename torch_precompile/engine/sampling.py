"""Choosing the next token from a step's logits, on the device: greedy, or sampled after
temperature, top-k, top-p and min-p as transformers' warpers; before them, a request's
bias and repetition penalties (:class:`Penalties`)."""

from __future__ import annotations

import torch


class Sampler:
    """Greedy (argmax) or sampling after temperature, top-k, top-p and min-p, on the device."""

    def __init__(
        self,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        device: torch.device | str,
        min_p: float | None = None,
    ) -> None:
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be positive when sampling, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be 1 or more, got {top_k}")
        if min_p is not None and not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        self.do_sample, self.temperature, self.top_k, self.top_p = (
            do_sample,
            temperature,
            top_k,
            top_p,
        )
        self.min_p = min_p
        self.generator = None
        if do_sample:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores the tokens are chosen from: ``logits`` themselves when greedy, else
        warped by temperature, top-k, top-p then min-p (filtered tokens at ``-inf``), as
        transformers' warpers."""
        if not self.do_sample:
            return logits
        scores = logits / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = torch.sort(scores, descending=False, dim=-1)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative <= 1 - self.top_p
            drop[:, -1] = False  # keep at least one token
            scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        if self.min_p:  # below min_p times the likeliest token's probability
            probs = scores.softmax(-1)
            drop = probs < self.min_p * probs.amax(-1, keepdim=True)
            drop.scatter_(1, probs.argmax(-1, keepdim=True), False)  # keep at least one
            scores = scores.masked_fill(drop, -float("inf"))
        return scores

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        """A token per row from :meth:`process`'s scores: argmax, or a seeded draw."""
        if not self.do_sample:
            return scores.argmax(-1)
        return torch.multinomial(scores.softmax(-1), 1, generator=self.generator)[:, 0]


class Penalties:
    """Logit bias and repetition penalties (OpenAI's ``logit_bias``, ``presence_penalty``
    and ``frequency_penalty``; transformers' ``repetition_penalty``) for a batch of
    rows, kept and applied on the device, so choosing a token never waits for the host.

    In order, on the model's logits: the bias is added; the repetition penalty divides
    a positive logit (multiplies a negative one) of every token seen in the row's
    prompt (its padding left out) or output so far, as transformers'
    ``RepetitionPenaltyLogitsProcessor``; then ``frequency * count + presence *
    (count > 0)`` is subtracted, ``count`` being the token's occurrences in the output
    (OpenAI's formula). :class:`Sampler`'s warpers come after.
    """

    def __init__(
        self,
        prompt: torch.Tensor,
        vocab: int,
        *,
        prompt_mask: torch.Tensor | None = None,
        logit_bias: dict[int, float] | None = None,
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition: float = 1.0,
    ) -> None:
        if not repetition > 0:
            raise ValueError(f"repetition_penalty must be above 0, got {repetition}")
        rows, device = prompt.shape[0], prompt.device
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.counts = torch.zeros((rows, vocab), dtype=torch.float32, device=device)
        self._ones = torch.ones((rows, 1), dtype=torch.float32, device=device)
        self.bias = None
        if logit_bias:
            self.bias = torch.zeros(vocab, dtype=torch.float32)
            self.bias[list(logit_bias)] = torch.tensor(list(logit_bias.values()))
            self.bias = self.bias.to(device)
        self.seen = None
        if repetition != 1.0:  # the prompt's tokens; padding goes to a column cut off
            ids = prompt if prompt_mask is None else prompt.masked_fill(prompt_mask == 0, vocab)
            seen = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=device)
            self.seen = seen.scatter_(1, ids, True)[:, :vocab]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``(rows, vocab)``, float32) after the bias and penalties."""
        scores = logits if self.bias is None else logits + self.bias
        if self.seen is not None:
            repeated = self.seen | (self.counts > 0)
            penalized = torch.where(scores < 0, scores * self.repetition, scores / self.repetition)
            scores = torch.where(repeated, penalized, scores)
        if self.frequency:
            scores = scores - self.frequency * self.counts
        if self.presence:
            scores = scores - self.presence * (self.counts > 0).float()
        return scores

    def count(self, tokens: torch.Tensor) -> None:
        """Add each row's chosen token (``(rows,)``, on the device) to its output."""
        self.counts.scatter_add_(1, tokens.reshape(-1, 1), self._ones)
