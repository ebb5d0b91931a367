"""What a request's output must match: one grammar spec, read from the sampling parameters.

A spec is plain data (kind + source text) so that it can be checked at the edge, keyed
by content, sent to the grammar service and compiled by any backend.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.wire.sampling import SamplingParams

KINDS = ("json_schema", "regex", "ebnf", "json", "structural_tag")
ANY_JSON = "$$ANY$$"
"""A `json_schema` value that asks for the built-in any-JSON grammar (SGLang's spelling)."""
MAX_SPEC_BYTES = 1 << 20
"""Longest grammar source (any kind), in UTF-8 bytes."""
MAX_SCHEMA_DEPTH = 64
"""Deepest JSON nesting of a JSON schema (objects and arrays); converting deeper ones takes time that
grows with the cube of the depth (400 levels of properties take ~13 s) and is done before admission."""
MAX_OPTIONAL_ATOMS = 16
"""Most `?`-quantified items in a regex, or in one EBNF rule: each doubles back through the automaton
and compile time grows steeply (`.?` 16 times: ~1 s; 32 times: ~7 s; 128 times: ~100 s)."""
KEY_LAYOUT = b"radixmesh-grammar-key/1"
"""Bumped whenever the compile options behind a key change (whitespace, strictness)."""


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar constraint, as text; `kind` says how `source` is read."""

    kind: str
    """json_schema | regex | ebnf | json (the built-in any-JSON grammar; `source` is empty) | structural_tag."""
    source: str
    """A JSON schema (compact JSON text), a regular expression, an EBNF grammar with rule `root`, or an
    xgrammar structural tag (compact JSON text: `{"type": "structural_tag", "format": {...}}`)."""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown grammar kind {self.kind!r}"

    @property
    def param(self) -> str:
        """The request field this spec came from, for error messages."""
        return "json_schema" if self.kind == "json" else self.kind

    def local_key(self) -> str:
        """Identity within one engine (one tokenizer): equal keys compile to the same grammar."""
        return _digest(KEY_LAYOUT, self.kind.encode(), self.source.encode())

    def content_key(self, tokenizer_fingerprint: str, serialization_version: str, vocab_size: int,
                    stop_token_ids: Sequence[int]) -> str:
        """Identity across engines: sha256(spec, tokenizer fingerprint, serialization version, vocab), hex.

        The byte layout is written in proto/radixmesh/v1/grammar.proto (CompileResponse.content_key).
        """
        return _digest(KEY_LAYOUT, self.kind.encode(), self.source.encode(), tokenizer_fingerprint.encode(),
                       serialization_version.encode(), str(vocab_size).encode(),
                       ",".join(str(t) for t in stop_token_ids).encode())

    @classmethod
    def parse(cls, kind: str, source: str) -> GrammarSpec:
        """A normalized spec (compact JSON schemas), or INVALID_ARGUMENT naming what is wrong."""
        if kind not in KINDS:
            raise invalid_argument(f"unknown grammar kind {kind!r} (known: {', '.join(KINDS)})", "kind")
        if kind == "json":
            return cls("json", "")
        param = kind
        if not source.strip():
            raise invalid_argument(f"{param} must not be empty", param)
        if len(source.encode(errors="replace")) > MAX_SPEC_BYTES:
            raise invalid_argument(f"{param} is longer than {MAX_SPEC_BYTES} bytes", param)
        if kind == "json_schema":
            return cls(kind, _compact_json(source))
        if kind == "structural_tag":
            return cls(kind, _compact_structural_tag(source))
        _check_optionals(kind, source)
        return cls(kind, source)


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The spec of a request's `json_schema` / `regex` / `ebnf` / `structural_tag` field, or None when it has
    none."""
    given = [(name, value) for name, value in (("json_schema", params.json_schema), ("regex", params.regex),
                                               ("ebnf", params.ebnf), ("structural_tag", params.structural_tag))
             if value is not None]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise invalid_argument(f"give at most one of json_schema, regex, ebnf and structural_tag (got {names})",
                               given[1][0])
    name, source = given[0]
    if name == "json_schema" and source == ANY_JSON:
        return GrammarSpec("json", "")
    return GrammarSpec.parse(name, source)


def _compact_json(source: str) -> str:
    """Whitespace-free JSON text (property order kept: it is the order the output follows)."""
    try:
        value = json.loads(source)
    except (ValueError, RecursionError) as exc:
        raise invalid_argument(f"json_schema is not valid JSON (or nested too deeply): {exc}", "json_schema") \
            from None
    if not isinstance(value, dict | bool):
        raise invalid_argument("json_schema must be a JSON object (a JSON Schema)", "json_schema")
    depth = json_depth(value)
    if depth > MAX_SCHEMA_DEPTH:
        raise invalid_argument(f"json_schema is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed",
                               "json_schema")
    if isinstance(value, dict):
        _check_ref_cycles(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _compact_structural_tag(source: str) -> str:
    """A structural tag as compact JSON; its depth is bounded like a schema's (it embeds schemas)."""
    try:
        value = json.loads(source)
    except (ValueError, RecursionError) as exc:
        raise invalid_argument(f"structural_tag is not valid JSON (or nested too deeply): {exc}",
                               "structural_tag") from None
    if not isinstance(value, dict):
        raise invalid_argument("structural_tag must be a JSON object", "structural_tag")
    depth = json_depth(value)
    if depth > 2 * MAX_SCHEMA_DEPTH:
        raise invalid_argument(f"structural_tag is nested {depth} levels deep; at most {2 * MAX_SCHEMA_DEPTH} are "
                               "allowed", "structural_tag")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_CONTAINERS = (dict, list)
_SCALARS = frozenset({str, int, float, bool, type(None)})
"""The types of JSON's scalars as `json.loads` makes them."""


def json_depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, `[]` and `{}` are 1); no recursion."""
    depth = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth = max(depth, level + 1)
        if _SCALARS.issuperset(map(type, children)):  # a flat list (a prompt's token ids): no loop in Python
            continue
        stack.extend((child, level + 1) for child in children if isinstance(child, _CONTAINERS))
    return depth


def _check_ref_cycles(schema: dict[str, object]) -> None:
    """Refuse `$ref` chains that come back to where they started without describing any output
    (`{"$ref": "#"}`, or two definitions that only point at each other): no token could ever match."""
    settled: set[int] = set()  # ref-only nodes whose chain is known to end in a real schema
    for start in _ref_only_nodes(schema):
        seen: set[int] = set()
        node: object = start
        while isinstance(node, dict) and _is_ref_only(node) and id(node) not in settled:
            if id(node) in seen:
                raise invalid_argument(f"json_schema has a $ref cycle ({node['$ref']!r}) that never describes a "
                                       "value; recursive schemas must go through properties or items",
                                       "json_schema")
            seen.add(id(node))
            node = _resolve_local_ref(schema, node["$ref"])
        settled |= seen


def _is_ref_only(node: dict[str, object]) -> bool:
    return isinstance(node.get("$ref"), str) and not set(node) & _VALUE_KEYWORDS


_VALUE_KEYWORDS = frozenset({"type", "properties", "items", "prefixItems", "enum", "const", "anyOf", "oneOf",
                             "allOf", "pattern", "format"})


def _ref_only_nodes(schema: dict[str, object]) -> list[dict[str, object]]:
    found = []
    stack: list[object] = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if _is_ref_only(item):
                found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _resolve_local_ref(schema: dict[str, object], ref: object) -> object:
    """The node a local JSON pointer (`#`, `#/$defs/a`) names, or None (remote or unknown refs are the
    grammar backend's to judge)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node: object = schema
    for part in (p for p in ref[1:].split("/") if p):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _check_optionals(kind: str, source: str) -> None:
    """Bound compile time: too many `?` items in a regex (or in one EBNF rule) are refused before they
    reach a compile thread that cannot be interrupted."""
    parts = [source] if kind == "regex" else re.split(r"::=", source)
    most = max(_count_optionals(part, kind) for part in parts)
    if most > MAX_OPTIONAL_ATOMS:
        where = "the regex" if kind == "regex" else "one rule"
        raise invalid_argument(f"{kind} is too complex to compile: {where} has {most} optional items ('?'), at most "
                               f"{MAX_OPTIONAL_ATOMS} are allowed; write x{{0,1}} for x?", kind)


def _count_optionals(text: str, kind: str) -> int:
    """`?` quantifiers outside character classes, escapes (and, in EBNF, string literals)."""
    count, i, in_class, quote = 0, 0, False, ""
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if quote:
            quote = "" if ch == quote else quote
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif kind == "ebnf" and ch in "\"'":
            quote = ch
        elif ch == "?" and i > 0 and text[i - 1] not in "(?*+}":
            count += 1
        i += 1
    return count
