"""The engine: a generator file's step decoded for its clients, ``Generator.generate``
and ``torch-precompile serve``, with one output stage for both.

- ``requests.py``: the values passed: a :class:`Request` in; :class:`Delta` events
  (tokens, text, logprobs, the finish with its reason and usage) or :class:`Failed` out.
- ``errors.py``: what the engine refuses, typed (the HTTP layer maps them to statuses).
- ``constraint.py``: the :class:`Constraint` protocol (the tokens allowed next).
- ``sampling.py``: greedy or sampled choice, logit bias and penalties, on the device.
- ``output.py``: the output stage: penalties, bans, constraints, sampling; end tokens,
  stop strings, ``max_tokens``; logprobs.
- ``text.py``: a run's text decoded as its tokens come, each token's own text and bytes.
- ``runner.py``: the runner interface, and the step over the slots of one cache
  (prefill a slot, decode them all).
- ``scheduler.py``: the one decode loop (``Scheduler.cycle``): the queue, admission,
  slots and the order of prefills and decodes; the server's thread runs it
  (continuous batching), ``Generator.generate`` drives it (``Scheduler.drive``).
- ``batch.py``: one ``generate`` call's rows as a run, and the lockstep runner that
  prefills them together and decodes them at one cache index.

The engine imports no HTTP, no model library, no compiler and no runtime; a
loaded file (the runtime's ``Generator``) is handed to it, as ``runner.Loaded``.
"""

from .constraint import Constraint
from .errors import EngineBusy, EngineError, NotServable, RequestError
from .requests import Delta, Event, Failed, Finish, Request, TokenLogprob, Usage

__all__ = [
    "Constraint",
    "Delta",
    "EngineBusy",
    "EngineError",
    "Event",
    "Failed",
    "Finish",
    "NotServable",
    "Request",
    "RequestError",
    "TokenLogprob",
    "Usage",
]
