"""Choosing the next token from a step's logits: greedy, or sampled after temperature,
top-k and top-p as transformers' warpers, on the device."""

from __future__ import annotations

import torch


class Sampler:
    """Greedy (argmax) or sampling after temperature, top-k and top-p, on the device."""

    def __init__(
        self,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
        device: torch.device | str,
    ) -> None:
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be positive when sampling, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be 1 or more, got {top_k}")
        self.do_sample, self.temperature, self.top_k, self.top_p = (
            do_sample,
            temperature,
            top_k,
            top_p,
        )
        self.generator = None
        if do_sample:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores the tokens are chosen from: ``logits`` themselves when greedy, else
        warped by temperature, top-k then top-p (filtered tokens at ``-inf``), as
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
        return scores

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        """A token per row from :meth:`process`'s scores: argmax, or a seeded draw."""
        if not self.do_sample:
            return scores.argmax(-1)
        return torch.multinomial(scores.softmax(-1), 1, generator=self.generator)[:, 0]


class Penalties:
    """One request's logit bias and repetition penalties (OpenAI's ``logit_bias``,
    ``presence_penalty`` and ``frequency_penalty``, vLLM's ``repetition_penalty``), kept
    and applied on the device, so choosing a token never waits for the host.

    In order, on the model's logits: the bias is added; transformers' repetition
    penalty divides a positive logit (multiplies a negative one) of every token seen in
    the prompt or the output so far; then ``frequency * count + presence * (count > 0)``
    is subtracted, ``count`` being the token's occurrences in the output (OpenAI's
    formula). Temperature, top-k and top-p come after, in :class:`Sampler`.
    """

    def __init__(
        self,
        vocab: int,
        device: torch.device | str,
        prompt: list[int],
        *,
        logit_bias: dict[int, float] | None = None,
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition: float = 1.0,
    ) -> None:
        if not repetition > 0:
            raise ValueError(f"repetition penalty must be positive, got {repetition}")
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self.bias = None
        if logit_bias:
            self.bias = torch.zeros(vocab, dtype=torch.float32)
            self.bias[list(logit_bias)] = torch.tensor(list(logit_bias.values()))
            self.bias = self.bias.to(device)
        self.seen = None
        if repetition != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[prompt] = True
            self.seen = self.seen.to(device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (rows of the vocabulary, float32) after the bias and penalties."""
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

    def count(self, token: torch.Tensor) -> None:
        """Add the chosen ``token`` (a one-element tensor on the device) to the output."""
        self.counts.index_add_(0, token.reshape(1), self._one)
