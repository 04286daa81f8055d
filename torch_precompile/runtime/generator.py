"""A generator served with torch alone: a loaded generator file's step and its calls.

:func:`~torch_precompile.generation.compile_generator` compiles a step of a
decoder language model over a static key/value cache held in plain tensors;
this module runs it and imports neither the model's library nor the
compiler. :class:`Generator` owns the cache (``max_batch`` x ``max_length``
per layer, allocated on the first call and reused: entries of earlier calls
are masked) and checks a ``generate`` call's inputs and settings; the engine's
loop decodes them (``Scheduler.drive`` over ``engine/batch.py``'s lockstep runner:
the prompt through the step, then one token at a time, greedy or sampled on the
device, rows stopped at an end of sequence token as transformers' ``generate`` does).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import GenerationLimitError
from ..engine.batch import Batch, LockstepRunner, Rows, guides_for
from ..engine.constraint import Constraint, Guided
from ..engine.output import Chooser
from ..engine.sampling import Penalties, Sampler
from ..engine.scheduler import Scheduler
from ..lean.cudagraphs import not_recorded
from .generator_spec import DEFAULT_NEW_TOKENS, SAMPLING_DEFAULTS, GeneratorSpec
from .loop import LoopCall


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """What ``generate(..., return_dict_in_generate=True)`` returns, as transformers'
    ``GenerateDecoderOnlyOutput``: the token ids and, when asked for, each step's
    ``(batch, vocab)`` scores (processed, as the sampler used them) and raw logits."""

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


class Generator:
    """``generate(input_ids, ...)`` on a precompiled step; ``step`` is the raw artifact.

    ``step(input_ids, attention_mask, position_ids, start, *cache)`` returns the
    logits of each row's last position, ``(batch, 1, vocab)``; the cache
    tensors are written in place at positions ``start .. start + length - 1``.
    Where ``spec.slots``, ``start`` may also be a ``(batch,)`` tensor with one
    token per row: each row at its own offset (``torch_precompile/serve``).

    One cache serves every call, so calls take turns: ``lock`` is held by each
    ``generate`` from its first step to its last (threads sharing a generator
    each get their own result, one after another). Whoever drives the cache
    another way (a scheduler stepping ``step`` itself) holds ``lock`` too.

    ``beside``: threads still setting the device up when the generator is made (a
    load's warm-up, ``warm.py``). A step that may record a CUDA graph waits for them
    (a capture fails if another thread synchronises or allocates meanwhile): every
    step but ``generate``'s prefill, which records none; reading ``step`` waits too.
    """

    def __init__(
        self,
        step: Any,
        spec: GeneratorSpec,
        tokenizer_json: bytes | None = None,
        *,
        beside: Sequence[threading.Thread] = (),
    ) -> None:
        self._step = step
        self.spec = spec
        self.tokenizer_json = tokenizer_json
        self.lock = threading.Lock()
        self._cache: list[torch.Tensor] | None = None
        self._runtime = getattr(step, "runtime", None)
        self._beside = tuple(beside)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"Generator({s.model_type or 'decoder'}, max_batch={s.max_batch}, "
            f"max_length={s.max_length}, {s.dtype} on {s.device})"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The raw step (see the class docstring)."""
        return self.step(*args, **kwargs)

    @property
    def step(self) -> Any:
        """The raw step, the artifact (see the class docstring), once :meth:`settle` returns."""
        self.settle()
        return self._step

    def settle(self) -> None:
        """Wait for the work started beside the generator's load (``beside``) to end."""
        if self._beside:
            for thread in self._beside:
                thread.join()
            self._beside = ()  # after every join: a caller that sees () may go on

    def run_step(self, *args: Any) -> Any:
        """The step on inputs made by this package (the decode loop's, the server's).

        Their strides are already contiguous ones, so the artifact's own call, which
        makes them so (a Python pass over every cache tensor, each token), is skipped.
        """
        self.settle()
        if self._runtime is None:
            return self._step(*args)
        return self._runtime(args, {})

    def loop(self, fixed: Sequence[torch.Tensor], *, settled: bool = True) -> Callable[..., Any]:
        """The step as one loop calls it, again and again, with the same ``fixed``
        tensors last (the cache views it decodes into): ``loop(*moving)``. The
        artifact's guards are checked at the loop's first call of each input layout,
        not at every step (:class:`~torch_precompile.runtime.loop.LoopCall`), so
        one loop's steps must not change the model in between. ``settled=False``: the
        work beside the load may still run (the caller settles before a step that
        may record a CUDA graph)."""
        if settled:
            self.settle()
        return self._loop(fixed)

    def _loop(self, fixed: Sequence[torch.Tensor]) -> Callable[..., Any]:
        if self._runtime is None:
            fixed = tuple(fixed)
            return lambda *moving: self._step(*moving, *fixed)
        return LoopCall(self._runtime, fixed)

    def unrecorded(self) -> Any:
        """A context whose steps record no CUDA graph (a prefill: one a prompt length
        would pile up; ``lean/cudagraphs.py``)."""
        return not_recorded()

    def cache(self) -> list[torch.Tensor]:
        """The key/value tensors, ``max_batch`` rows each, allocated on first use."""
        if self._cache is None:
            dtype = getattr(torch, self.spec.dtype)
            self._cache = [
                torch.zeros(
                    (self.spec.max_batch, heads, self.spec.max_length, dim),
                    dtype=dtype,
                    device=self.spec.device,
                )
                for heads, dim in self.spec.kv_shapes
            ]
        return self._cache

    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` saved with the generator (``tokenizers`` imported here)."""
        if self.tokenizer_json is None:
            raise ValueError(
                "this generator was built without a tokenizer: pass token ids, or build it "
                "with compile_generator(..., tokenizer=...)"
            )
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.tokenizer_json.decode())

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int = 0,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = -1,
        pad_token_id: int | None = -1,
        streamer: Any = None,
        return_dict_in_generate: bool = False,
        output_scores: bool = False,
        output_logits: bool = False,
        constraint: Constraint | Sequence[Constraint | None] | None = None,
    ) -> torch.Tensor | GenerateOutput:
        """Generate up to ``max_new_tokens`` per row: ``(batch, prompt + new)`` token ids.
        Left out (None), as many as :meth:`new_tokens` says: the model's.

        As transformers' ``generate``: rows padded on the left (``attention_mask``
        0), a row stops at an ``eos_token_id`` (default: the model's; ``None``:
        never) and is filled with ``pad_token_id`` afterwards; the result ends
        when every row has stopped. ``do_sample=True`` samples from the
        distribution warped by ``temperature``, ``top_k`` (0: off), ``top_p`` then
        ``min_p``, with a generator seeded by ``seed`` (the same seed, the same
        tokens); ``repetition_penalty`` applies greedy or sampled, over each row's
        prompt (its padding left out) and output. A setting left out (None) is the
        model's (its generation_config at build), else transformers' default
        (greedy; when sampling, top_k 50), as ``generate``'s. A ``streamer`` is
        called with each step's ``(batch,)`` tokens (or its ``put``, then ``end``,
        as transformers' streamers).

        ``return_dict_in_generate=True`` returns a :class:`GenerateOutput` instead:
        ``.sequences``, and with ``output_scores`` / ``output_logits`` each step's
        scores after the repetition penalty, ``min_new_tokens`` and the warpers
        (what the tokens were chosen from) and the model's raw logits, as
        transformers'.

        ``constraint``: the tokens each row may take next
        (:class:`~torch_precompile.engine.constraint.Constraint`), one per row (None:
        free), or one for a call of one row; a row whose constraint is done stops.

        Calls on one generator from several threads run one at a time (``lock``).
        """
        ids, mask, max_new_tokens = self._check(
            input_ids, attention_mask, max_new_tokens, min_new_tokens
        )
        asked = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k}
        asked.update(top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
        chosen = self.settings(**asked)
        if not chosen["repetition_penalty"] > 0:
            raise ValueError(
                f"repetition_penalty must be above 0, got {chosen['repetition_penalty']}"
            )
        sampler = Sampler(
            chosen["do_sample"],
            chosen["temperature"],
            chosen["top_k"] or None,  # 0: off, as transformers'
            chosen["top_p"],
            seed,
            self.spec.device,
            min_p=chosen["min_p"],
        )
        rows = self._rows(ids, mask, eos_token_id, pad_token_id)
        repetition = chosen["repetition_penalty"]

        def penalties(vocab: int) -> Penalties:
            return Penalties(rows.ids, vocab, prompt_mask=rows.mask, repetition=repetition)

        chooser = Chooser(
            sampler,
            penalties_for=penalties if repetition != 1.0 else None,
            guides=[Guided(c) if c is not None else None for c in guides_for(constraint, len(ids))],
            banned=torch.tensor(rows.eos, device=rows.ids.device) if rows.eos else None,
            min_tokens=min_new_tokens,
        )
        keep = (output_scores, output_logits)
        batch = Batch(rows, chooser, max_new_tokens=max_new_tokens, streamer=streamer, keep=keep)
        with self.lock:
            if not batch.over:
                runner = LockstepRunner(self, [t[: len(ids)] for t in self.cache()], rows)
                Scheduler(self, max_queue=1, runner=runner).drive(batch)
        out = batch.result()
        if not return_dict_in_generate:
            return out.sequences
        return GenerateOutput(
            out.sequences,
            tuple(out.scores) if output_scores else None,
            tuple(out.logits) if output_logits else None,
        )

    def _rows(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        eos_token_id: int | Sequence[int] | None,
        pad_token_id: int | None,
    ) -> Rows:
        """The call's rows on the device, with its end tokens (-1: the model's) and pad
        (-1: the model's; None: the first end token, else 0)."""
        spec = self.spec
        eos = _eos_ids(spec.eos_token_id if eos_token_id == -1 else eos_token_id)
        pad = spec.pad_token_id if pad_token_id == -1 else pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        device = torch.device(spec.device)
        return Rows(_row_major(ids.to(device)), mask.to(device), tuple(eos), pad, spec.max_length)

    def new_tokens(self, prompt: int, asked: int | None = None) -> int:
        """How many tokens a call with a prompt of ``prompt`` tokens generates at most, as
        transformers' ``generate`` counts them: ``asked``; else the model's
        ``max_new_tokens``; else up to its ``max_length``, the prompt included (a
        ``ValueError`` when the prompt reaches it); else 20. A count the call did not ask
        for stops where the generator's cache ends, as transformers' stops at the
        model's ``max_position_embeddings``."""
        if asked is not None:
            return asked
        own = dict(self.spec.lengths)
        if "max_new_tokens" in own:
            wanted = own["max_new_tokens"]
        elif "max_length" in own:
            wanted = own["max_length"] - prompt
            if wanted <= 0:
                raise ValueError(
                    f"a prompt of {prompt} tokens reaches the model's max_length="
                    f"{own['max_length']} (its generation_config): pass max_new_tokens"
                )
        else:
            wanted = DEFAULT_NEW_TOKENS
        return min(wanted, max(self.spec.max_length - prompt, 1))

    def settings(self, **asked: Any) -> dict[str, Any]:
        """Each sampling setting of :data:`SAMPLING_DEFAULTS`: as asked, else the model's
        (its generation_config at build), else transformers' default."""
        own = dict(self.spec.sampling)
        return {
            key: asked[key] if asked.get(key) is not None else own.get(key, SAMPLING_DEFAULTS[key])
            for key in SAMPLING_DEFAULTS
        }

    def _check(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int | None,
        min_new_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The call's ids and mask (long) and its ``max_new_tokens`` (:meth:`new_tokens`),
        checked against the generator's limits before any kernel runs."""
        spec = self.spec
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a (batch, prompt) tensor of token ids")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(
                f"input_ids has dtype {input_ids.dtype}: token ids are integers (torch.long); "
                "pass the tokenizer's ids, or convert with .long() if they are whole numbers"
            )
        batch, prompt = input_ids.shape
        if batch < 1 or prompt < 1:
            raise ValueError(f"input_ids is empty, shape {tuple(input_ids.shape)}")
        if batch > spec.max_batch:
            raise GenerationLimitError(
                f"{batch} rows asked for, the generator was built for at most max_batch="
                f"{spec.max_batch}: split the batch, or build it again with a larger max_batch"
            )
        max_new_tokens = self.new_tokens(prompt, max_new_tokens)
        if max_new_tokens < 0 or min_new_tokens < 0:
            raise ValueError("max_new_tokens and min_new_tokens must be 0 or more")
        if prompt + max_new_tokens > spec.max_length:
            raise GenerationLimitError(
                f"a prompt of {prompt} plus max_new_tokens={max_new_tokens} is "
                f"{prompt + max_new_tokens} positions, the generator's cache holds max_length="
                f"{spec.max_length}: shorten the prompt or max_new_tokens, or build it again "
                "with a larger max_length"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                f"{tuple(input_ids.shape)}: they must be the same"
            )
        mask = attention_mask.long()
        empty = (mask == 0).all(-1)
        if bool(empty.any()):
            rows = empty.nonzero().flatten().tolist()
            raise ValueError(
                f"attention_mask is all zeros in row(s) {rows}: every row needs at least one "
                "token to attend to; drop those rows or give them a prompt"
            )
        if bool((mask[:, -1] == 0).any()):
            raise ValueError(
                "a row's last token is padding: pad on the left (tokenizer padding_side='left')"
            )
        return input_ids.long(), mask, max_new_tokens


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied if its strides are not a fresh tensor's: a slice of a wider tensor
    (``tokens[:, :n]``, even of one row) has others, which the steps' guards refuse."""
    if t.stride() == torch.empty(t.shape, device="meta").stride():
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _eos_ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
