"""Example models and scripts for torch_precompile."""
