"""Text from a file or a model, made safe for a terminal: control characters escaped,
long strings cut."""

from __future__ import annotations

from typing import Any

FIELD_LIMIT = 500  # characters of one string from a file
LINE_LIMIT = 4000  # characters of one line of inspect's view


def terminal_text(text: str) -> str:
    """Generated text safe for a terminal: lines and tabs kept, every other control
    or format character (an ANSI escape the model wrote) escaped by :func:`printable`."""
    return "\n".join("\t".join(printable(p) for p in line.split("\t")) for line in text.split("\n"))


def one_line(exc: BaseException, path: str) -> str:
    """An error as one printable line (an OS error as ``path: reason``)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{path}: {exc.strerror}"
    return printable(text, limit=2000)


# Characters a terminal may act on: C0/C1 controls (ANSI escapes start with ESC),
# DEL, and the invisible format characters that reorder text (bidi overrides).
_UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def printable(text: str, *, limit: int | None = None) -> str:
    """``text`` safe to write to a terminal: control and format characters (ANSI escape
    sequences, bidi overrides, newlines) shown as ``\\x1b``-style escapes, and cut at
    ``limit`` characters."""
    import unicodedata

    out = "".join(
        ch.encode("unicode_escape").decode("ascii")
        if not " " <= ch <= "~" and unicodedata.category(ch) in _UNPRINTABLE_CATEGORIES
        else ch
        for ch in text
    )
    if limit is not None and len(out) > limit:
        out = f"{out[:limit]}... ({len(out) - limit} more characters)"
    return out


def printable_tree(value: Any) -> Any:
    """``value`` (decoded JSON) with every string made printable and cut to a sane length."""
    if isinstance(value, str):
        return printable(value, limit=FIELD_LIMIT)
    if isinstance(value, dict):
        return {printable(str(k), limit=FIELD_LIMIT): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    return value
