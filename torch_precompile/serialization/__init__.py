"""``Precompile.save`` and ``Precompile.load``: an artifact to its file and back."""
