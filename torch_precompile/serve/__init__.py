"""``torch-precompile serve FILE``: a generator file served as OpenAI's API, batching continuously.

- ``body.py``: a request's body read up to the size cap, parsed.
- ``errors.py``: ``ApiError``, a status and OpenAI's error body.
- ``prompts.py``: a completion's prompt, a chat's messages (content parts joined).
- ``protocol.py``: OpenAI's request fields checked into a ``Job``; responses and
  stream chunks written as OpenAI writes them.
- ``tokens.py``: the engine's tokenizer work (``engine/text.py``: encoding off the
  GIL with a bound on text, the chat template in jinja2's sandbox), under its old name.
- ``structured.py``: ``response_format`` and ``structured_outputs`` as a grammar
  the engine holds a request to (llguidance).
- ``tool_calls.py``: ``tools`` and ``tool_choice``; the answer's ``tool_calls``,
  whole and streamed.
- ``tool_parsers.py``: a model's calls read from its text (Hermes, Llama 3 JSON).
- ``engine.py``: the engine (``torch_precompile/engine``) taking a ``Job``, its
  refusals as statuses.
- ``detokenizer.py``: the engine's streaming text, under its old name.
- ``app.py``: the routes, on Starlette served by uvicorn.
- ``operations.py``: ``/tokenize``, ``/detokenize``, ``/version``, ``/metrics``.
- ``metrics.py``: the Prometheus metrics (prometheus-client).
- ``admission.py``: the API key, and the 503s of a drain.
- ``command.py``: the subcommand.

The serving process imports neither transformers nor the compiler: the file
is loaded by the lean runtime, text goes through ``tokenizers`` alone.
"""
