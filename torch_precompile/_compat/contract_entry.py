"""One entry of the private-name contract (:mod:`.contract`): a name, its uses, and
where and when it is checked."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One private name of PyTorch that ``_compat/`` uses."""

    name: str
    uses: tuple[str, ...] = ()  # keyword parameters, fields, members or config keys
    alternatives: tuple[str, ...] = ()
    cuda: bool = False
    after: str = ""  # a module that must be imported first (as the package's code path does)
    since: str = ""  # the first torch that has it (checked from there on)
    probe: str = ""  # a check run on a real object (a C++ signature, a run-time attribute)
    attrs: tuple[str, ...] = ()  # private attributes set at run time: checked by the probe
    until: str = ""  # the first torch that no longer has it (checked before that one)

    def places(self) -> tuple[str, ...]:
        return (self.name, *self.alternatives)


def entry(name: str, *uses: str, **options: Any) -> PrivateName:
    """An entry: its name, its uses, then any of the other fields by keyword."""
    return PrivateName(name, tuple(uses), **options)
