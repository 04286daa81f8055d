"""The ``torch-precompile`` command line."""
