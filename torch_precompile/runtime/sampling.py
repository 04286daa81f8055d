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
