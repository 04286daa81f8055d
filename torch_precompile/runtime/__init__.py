"""The call path of an artifact: binding, guards, the compiled call, outputs."""
