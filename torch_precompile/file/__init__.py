"""The artifact file: its container, typed header, stand-in module, save and load.

- :mod:`.layout`: the byte layout (magic, fixed fields, flags), regular-file checks;
- :mod:`.write`, :mod:`.read`: the checksummed, optionally signed container of
  named byte sections (atomic write; whole-file or header-first reads);
- :mod:`.header`: the typed header ``Precompile.save`` writes, read back once;
- :mod:`.standin`: a model's weights and plain attributes, without its class;
- :mod:`.save`, :mod:`.load`: ``Precompile.save`` / ``Precompile.load``.

Importing this package imports nothing: ``torch-precompile inspect`` reads a
header with :mod:`.read` and :mod:`.header` alone, without torch's compiler.
"""
