"""Output held to a grammar: a request's ``response_format`` (``json_object``,
``json_schema``, ``structural_tag``) or vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``: Lark or GBNF, ``structural_tag``; or its older
``guided_*`` fields) as a :class:`Constraint` the engine applies to the request's
slot at each step.

The grammar engine is llguidance (the ``serve`` extra): its tokenizer is built once
per file, from the tokenizers JSON the file holds, and each grammar is compiled once
(kept in an LRU keyed by the grammar's text, so a schema sent again costs a copy).
The compile and the first mask run where the request is parsed, on a worker thread
(``app.py``), not on the engine's step: a new schema delays no other slot. JSON is
written as Python's ``json.dumps`` writes it (``", "`` and ``": "``, no other
whitespace), so a model cannot spend its tokens on spaces.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .errors import ApiError

# Compiled grammars a server keeps, the least recently used dropped past it.
_CACHED = 64
_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_INSTALL = "pip install 'torch_precompile[serve]'"
_AS_BOOL = bytes(int(i > 0) for i in range(256))
# vLLM's older fields, each one of structured_outputs' keys (vLLM still reads them).
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class Constraint:
    """One request's grammar as the engine applies it: before each sampling step
    :meth:`allowed_mask`, after it :meth:`accept`; :meth:`done` once nothing may follow."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._next: bytes | None = self._mask()  # the first, off the engine's step

    def _mask(self) -> bytes:
        # One byte per token (0 or 200), made 0 or 1 by a C call on the bytes: on a
        # busy CPU, even one torch op over the vocabulary could stall for ms.
        return self._matcher.compute_logit_bias().translate(_AS_BOOL)

    def copy(self) -> Constraint:
        """The same grammar from its start, for another choice of the request."""
        return Constraint(self._matcher.deep_copy())

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        """The tokens that may come next: a bool tensor of ``vocab_size`` (tokens the
        tokenizer does not have, a model's padded rows, are not allowed)."""
        mask, self._next = (self._next if self._next is not None else self._mask()), None
        mask = mask[:vocab_size] + bytes(max(0, vocab_size - len(mask)))
        return torch.frombuffer(bytearray(mask), dtype=torch.bool)

    def accept(self, token_id: int) -> None:
        """The token chosen; one the grammar did not allow ends the constraint (``done``)."""
        self._next = None
        self._matcher.consume_token(token_id)

    def done(self) -> bool:
        """Whether the grammar is complete and nothing may follow (or it failed)."""
        return self._matcher.is_stopped() or self._matcher.is_error()


class Grammars:
    """A file's grammars: its tokenizer made once (at the first use), compiled grammars
    in an LRU. Without llguidance, or without the file's tokenizer, a request that
    needs a grammar is a 400 saying what is missing."""

    def __init__(self, tokenizer_json: str | None, eos: Sequence[int], cached: int = _CACHED):
        self._json, self._eos, self._cached = tokenizer_json, list(eos), cached
        self._tokenizer: Any = None
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many compiled grammars are kept."""
        return len(self._compiled)

    def _engine(self, param: str) -> Any:
        try:
            import llguidance
        except ImportError:
            raise ApiError(
                400,
                f"'{param}' needs the grammar engine llguidance, which is not installed: "
                f"{_INSTALL}",
                param=param,
            ) from None
        if self._json is None:
            raise ApiError(
                400,
                f"'{param}' needs the model's tokenizer, which its file does not hold",
                param=param,
            )
        if not self._eos:  # a grammar ends at an end token
            raise ApiError(
                400,
                f"'{param}' needs the model's end token, which its file does not name "
                "(build it from a model whose generation_config has an eos_token_id)",
                param=param,
            )
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._json, eos_token=self._eos)
        return llguidance

    def constraint(self, kind: str, source: Any, param: str) -> Constraint:
        """A new :class:`Constraint` of ``kind`` (``json``: a schema, ``regex``,
        ``choice``: a list of strings, ``grammar``: Lark or GBNF, ``structural_tag``:
        vLLM's, ``lark``); a grammar that does not compile is a
        400 naming ``param``."""
        llguidance = self._engine(param)
        key = f"{kind}\0{json.dumps(source, sort_keys=True)}"
        with self._lock:
            prototype = self._compiled.get(key)
            if prototype is not None:
                self._compiled.move_to_end(key)
        if prototype is None:
            prototype = self._compile(llguidance, kind, source, param)
            with self._lock:
                self._compiled[key] = prototype
                while len(self._compiled) > self._cached:
                    self._compiled.popitem(last=False)
        return Constraint(prototype.deep_copy())

    def _compile(self, llguidance: Any, kind: str, source: Any, param: str) -> Any:
        matcher = llguidance.LLMatcher
        try:
            if kind == "json":
                grammar = matcher.grammar_from_json_schema(json.dumps(source), overrides=_JSON)
            elif kind == "regex":
                grammar = matcher.grammar_from_regex(source)
            elif kind == "choice":
                grammar = matcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in source)
                )
            elif kind == "grammar":
                grammar = llguidance.grammar_from("grammar", source)
            elif kind == "structural_tag":
                grammar = _structural_tag(llguidance, source)
            else:
                grammar = matcher.grammar_from_lark(source)
        except (ValueError, AssertionError) as exc:
            raise ApiError(400, f"'{param}' is not a valid grammar: {exc}", param=param) from None
        compiled = matcher(self._tokenizer, grammar, log_level=0)  # drops the GIL
        if compiled.is_error():
            first = compiled.get_error().strip().splitlines()[0]
            raise ApiError(400, f"'{param}' does not compile: {first}", param=param)
        return compiled


def _structural_tag(llguidance: Any, spec: dict[str, Any]) -> str:
    """vLLM's structural tag (``structures`` of ``begin``, ``schema``, ``end``, each
    beginning with one of ``triggers``) as llguidance's grammar, as vLLM's guidance
    backend makes it: free text, and after a trigger the structure it begins."""
    triggers, tags = spec.get("triggers"), []
    structures = spec.get("structures")
    if not isinstance(triggers, list) or not isinstance(structures, list) or not structures:
        raise ValueError("it needs 'structures' (a non-empty list) and 'triggers' (a list)")
    for s in structures:
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise ValueError("each structure needs 'begin' and 'end' strings and a 'schema'")
        trigger = next(
            (t for t in triggers if isinstance(t, str) and s["begin"].startswith(t)), None
        )
        if not trigger:
            raise ValueError(f"{s['begin']!r} begins with none of the triggers {triggers}")
        schema = s.get("schema", True)
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"])
        )
    return llguidance.StructTag.to_grammar(tags)


def _tag_spec(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError(400, f"'{param}' must be a structural tag (JSON)", param=param) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"'{param}' must be a structural tag (an object)", param=param)
    return value


def _schema(value: Any, param: str) -> dict[str, Any] | bool:
    """A JSON schema as sent: an object (or ``true``), or a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError(400, f"'{param}' must be a JSON schema", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise ApiError(400, f"'{param}' must be a JSON schema (an object)", param=param)
    return value


def _response_format(fmt: Any) -> tuple[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, "'response_format' must be an object", param="response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(
                400,
                "'response_format' json_schema needs 'json_schema': {'name', 'schema'}",
                param="response_format",
            )
        return "json", _schema(spec["schema"], "response_format")
    if kind == "structural_tag":
        return "structural_tag", fmt
    raise ApiError(
        400,
        f"'response_format' {kind!r} is not one of 'text', 'json_object', 'json_schema', "
        "'structural_tag'",
        param="response_format",
    )


_KINDS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")


def _structured_outputs(spec: Any, param: str = "structured_outputs") -> tuple[str, Any] | None:
    """vLLM's ``structured_outputs``: exactly one of :data:`_KINDS`."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ApiError(400, f"'{param}' must be an object", param=param)
    # vLLM's own keys beside the grammar (whitespace, the backend's options): no grammar.
    given = {
        k: v for k, v in spec.items() if v not in (None, False) and not k.startswith("disable_")
    }
    given = {k: v for k, v in given.items() if k not in ("whitespace_pattern", "backend")}
    refused = sorted(set(given) - set(_KINDS))
    if refused:
        raise ApiError(
            400, f"'{param}' {refused[0]!r} is not one of {', '.join(_KINDS)}", param=param
        )
    if len(given) != 1:
        raise ApiError(400, f"'{param}' takes one of {', '.join(_KINDS)}", param=param)
    ((kind, value),) = given.items()
    if kind == "json_object":
        return "json", {"type": "object"}
    if kind == "json":
        return "json", _schema(value, f"{param}.json")
    if kind == "structural_tag":
        return kind, _tag_spec(value, f"{param}.structural_tag")
    if kind in ("regex", "grammar") and isinstance(value, str) and value:
        return kind, value
    if (
        kind == "choice"
        and isinstance(value, list)
        and value
        and all(isinstance(c, str) and c for c in value)
    ):
        return "choice", value
    raise ApiError(
        400,
        f"'{param}.{kind}' must be a non-empty "
        + ("string" if kind in ("regex", "grammar") else "list of strings"),
        param=param,
    )


def requested(body: dict[str, Any]) -> tuple[str, Any, str] | None:
    """The grammar a request asks for, as ``(kind, source, param)``, or None."""
    guided = {kind: body[name] for name, kind in _GUIDED.items() if body.get(name) is not None}
    named = next((name for name in _GUIDED if body.get(name) is not None), "guided_json")
    asked = [
        (found, param)
        for found, param in (
            (_response_format(body.get("response_format")), "response_format"),
            (_structured_outputs(body.get("structured_outputs")), "structured_outputs"),
            (_structured_outputs(guided or None, named), named),
        )
        if found is not None
    ]
    if len(asked) > 1:
        names = " and ".join(f"'{param}'" for _, param in asked)
        raise ApiError(400, f"{names} each set the output's form: send one", param=asked[1][1])
    return (*asked[0][0], asked[0][1]) if asked else None


def constraint_of(
    body: dict[str, Any], forced: tuple[str, Any, str] | None, grammars: Grammars | None
) -> Constraint | None:
    """The constraint a request's output is held to: its ``response_format`` or
    ``structured_outputs``, or ``forced`` (``tool_choice``'s grammar), never two."""
    asked = requested(body)
    if asked is not None and forced is not None:
        raise ApiError(
            400,
            f"'{asked[2]}' and tool_choice {body.get('tool_choice')!r} both set the output's "
            "form: send one",
            param="tool_choice",
        )
    asked = asked or forced
    if asked is None:
        return None
    if grammars is None:
        raise ApiError(400, f"'{asked[2]}' needs the model's tokenizer", param=asked[2])
    return grammars.constraint(*asked)
