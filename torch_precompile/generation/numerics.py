"""Numerics as the field measures them: greedy outputs compared as vLLM does.

In bf16 two correct implementations drift apart on some token (a tie between
two logits broken differently by a reordered sum), and after that their
tokens differ for good; equal tokens are then the wrong test. vLLM's
``check_logprobs_close`` walks both outputs and, at the first token where they
differ, asks each side's token to be among the other side's top-k (k = 5): a
near tie passes, a wrong logit does not. The top-k of each side is taken
along its own output, as it generated it: ``model.generate``'s scores for
transformers, and the generator's own prefill and decode programs fed its own
tokens (:func:`generator_topk`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["Divergence", "check_logprobs_close", "generator_topk", "topk_of_scores"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two outputs first differ, and whether each token is in the other's top-k."""

    index: int  # position among the new tokens
    token_0: int
    token_1: int
    token_0_in_topk_1: bool
    token_1_in_topk_0: bool

    @property
    def close(self) -> bool:
        return self.token_0_in_topk_1 and self.token_1_in_topk_0


def check_logprobs_close(
    tokens_0: Sequence[int],
    topk_0: Sequence[Sequence[int]],
    tokens_1: Sequence[int],
    topk_1: Sequence[Sequence[int]],
    *,
    name_0: str = "reference",
    name_1: str = "test",
) -> Divergence | None:
    """``None`` if the outputs are equal (on their common length), else their first
    :class:`Divergence`; ``AssertionError`` naming both when it is not close.

    ``topk_i[j]`` holds output ``i``'s k most likely token ids at new token ``j``.
    """
    for j, (a, b) in enumerate(zip(tokens_0, tokens_1)):
        if a == b:
            continue
        if j >= len(topk_0) or j >= len(topk_1):
            raise ValueError(f"no top-k at new token {j}: give one per generated token")
        found = Divergence(j, int(a), int(b), a in topk_1[j], b in topk_0[j])
        if not found.close:
            raise AssertionError(
                f"{name_0} and {name_1} first differ at new token {j}: {name_0} chose {a} "
                f"({'in' if found.token_0_in_topk_1 else 'not in'} {name_1}'s top-k "
                f"{list(topk_1[j])}), {name_1} chose {b} "
                f"({'in' if found.token_1_in_topk_0 else 'not in'} {name_0}'s top-k "
                f"{list(topk_0[j])})"
            )
        return found
    return None


def topk_of_scores(scores: Sequence[torch.Tensor], k: int = 5, row: int = 0) -> list[list[int]]:
    """The top-k token ids of each step from ``generate(..., output_scores=True)``'s
    ``scores`` (raw logits with ``output_logits=True``), for one row."""
    return [s[row].float().topk(k).indices.tolist() for s in scores]


@torch.no_grad()
def generator_topk(
    generator: object, prompt: torch.Tensor, tokens: Sequence[int], k: int = 5
) -> list[list[int]]:
    """The top-k token ids a generator's step gives at each of ``tokens`` (one row),
    fed its prompt (a prefill) then each token in turn (decode steps), as
    ``Generator.generate`` runs them: teacher-forced along its own output."""
    step = generator.step  # type: ignore[attr-defined]
    spec = generator.spec  # type: ignore[attr-defined]
    device = torch.device(spec.device)
    ids = prompt.reshape(1, -1).to(device)
    n = ids.shape[1]
    if n + len(tokens) > spec.max_length:
        raise ValueError(
            f"prompt {n} plus {len(tokens)} tokens exceeds max_length {spec.max_length}"
        )
    cache = [t[:1] for t in generator.cache()]  # type: ignore[attr-defined]
    full = torch.zeros((1, spec.max_length), dtype=torch.long, device=device)
    full[:, :n] = 1
    positions = torch.arange(n, device=device).reshape(1, -1)
    start = torch.zeros((), dtype=torch.long, device=device)
    out = []
    for i in range(len(tokens)):
        at = spec.start_of(start, 1, ids.shape[1])
        logits = step(ids, full, positions, at, *cache)[:, -1, :].float()
        out.append(logits[0].topk(k).indices.tolist())
        full[:, n + i] = 1
        start = start + ids.shape[1]
        positions = torch.full((1, 1), n + i, dtype=torch.long, device=device)
        ids = torch.full((1, 1), int(tokens[i]), dtype=torch.long, device=device)
    return out
