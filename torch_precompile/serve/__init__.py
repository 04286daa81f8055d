"""``torch-precompile serve FILE``: a generator file served as OpenAI's API, batching continuously.

- ``protocol.py``: OpenAI's request fields checked into a ``Job``; responses,
  stream chunks and errors written as OpenAI writes them.
- ``chat.py``: the chat template saved in the file, rendered in jinja2's sandbox.
- ``engine.py``: one scheduler thread owning the cache; each request a slot.
- ``detokenizer.py``: a run's text, decoded a few tokens at a time; stop strings.
- ``app.py``: the routes, on Starlette served by uvicorn.
- ``command.py``: the subcommand.

The serving process imports neither transformers nor the compiler: the file
is loaded by the lean runtime, text goes through ``tokenizers`` alone.
"""
