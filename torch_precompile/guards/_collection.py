"""``Guards``: the immutable, ordered record each stage extends."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ._base import PHASES, Guard, guard_kinds


class Guards(Sequence[Guard]):
    """An immutable, ordered collection of :class:`Guard` entries.

    ``capture_id`` names the Dynamo capture the entries derive from (``save``
    uses it to refuse guards of another capture). The collection a stage hands
    out also carries, privately, what the next stage takes over from
    (:meth:`carrying`): the seed's ``joint, guards = aot_autograd(gm, guards)``
    passes only the pieces. It is never compared, written or copied.
    """

    __slots__ = ("__weakref__", "_capture_id", "_carried", "_entries")

    def __init__(self, entries: Sequence[Guard] = (), *, capture_id: str | None = None):
        object.__setattr__(self, "_entries", tuple(entries))
        object.__setattr__(self, "_capture_id", capture_id)
        object.__setattr__(self, "_carried", None)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: Any) -> Any:
        return self._entries[index]

    def __iter__(self) -> Iterator[Guard]:
        return iter(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Guards) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(self._entries)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Guards is immutable; use extend() to get a new one")

    @property
    def capture_id(self) -> str | None:
        """Identifies the Dynamo capture these guards were derived from."""
        return self._capture_id

    def by_phase(self, phase: str) -> Guards:
        """The entries one stage added (``dynamo``, ``aot_autograd`` or ``inductor``)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        return Guards([g for g in self._entries if g.phase == phase], capture_id=self._capture_id)

    def of_kind(self, kind: type[Guard]) -> list[Any]:
        """The entries of one kind (``guards.of_kind(RangeGuard)``)."""
        return [g for g in self._entries if isinstance(g, kind)]

    def carrying(self, state: Any) -> Guards:
        """These entries, as a new collection carrying ``state`` (read by the stages only)."""
        guards = Guards(self._entries, capture_id=self._capture_id)
        object.__setattr__(guards, "_carried", state)
        return guards

    def extend(self, entries: Sequence[Guard]) -> Guards:
        """A new collection with these entries appended."""
        return Guards(self._entries + tuple(entries), capture_id=self._capture_id)

    def to_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self._entries]

    @classmethod
    def from_json(cls, data: Sequence[Mapping[str, Any]], capture_id: str | None = None) -> Guards:
        kinds = guard_kinds()  # once: a generator's file holds thousands of entries
        return cls([Guard.from_json(d, kinds) for d in data], capture_id=capture_id)

    def __str__(self) -> str:
        lines = []
        for phase in PHASES:
            entries = [g for g in self._entries if g.phase == phase]
            if entries:
                lines.append(f"{phase} ({len(entries)}):")
                lines.extend(f"  {g.expr}" for g in entries)
        return "\n".join(lines) if lines else "(no guards)"

    def __repr__(self) -> str:
        counts = ", ".join(f"{p}={sum(g.phase == p for g in self._entries)}" for p in PHASES)
        return f"Guards({len(self)} entries: {counts})"
