"""What a request's output must match: one grammar spec, read from the sampling parameters.

A spec is plain data (kind + source text) so that it can be checked at the edge, keyed
by content, sent to the grammar service and compiled by any backend.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.engine.sampling.params import SamplingParams

KINDS = ("json_schema", "regex", "ebnf", "json")
ANY_JSON = "$$ANY$$"
"""A `json_schema` value that asks for the built-in any-JSON grammar (SGLang's spelling)."""
MAX_SPEC_BYTES = 1 << 20
KEY_LAYOUT = b"radixmesh-grammar-key/1"
"""Bumped whenever the compile options behind a key change (whitespace, strictness)."""


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar constraint, as text; `kind` says how `source` is read."""

    kind: str
    """json_schema | regex | ebnf | json (the built-in any-JSON grammar; `source` is empty)."""
    source: str
    """A JSON schema (compact JSON text), a regular expression, or an EBNF grammar with rule `root`."""

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
        if len(source.encode()) > MAX_SPEC_BYTES:
            raise invalid_argument(f"{param} is longer than {MAX_SPEC_BYTES} bytes", param)
        return cls(kind, _compact_json(source) if kind == "json_schema" else source)


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def grammar_spec(params: SamplingParams) -> GrammarSpec | None:
    """The spec of a request's `json_schema` / `regex` / `ebnf` field, or None when it has none."""
    given = [(name, value) for name, value in (("json_schema", params.json_schema), ("regex", params.regex),
                                               ("ebnf", params.ebnf)) if value is not None]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise invalid_argument(f"give at most one of json_schema, regex and ebnf (got {names})", given[1][0])
    name, source = given[0]
    if name == "json_schema" and source == ANY_JSON:
        return GrammarSpec("json", "")
    return GrammarSpec.parse(name, source)


def _compact_json(source: str) -> str:
    """Whitespace-free JSON text (property order kept: it is the order the output follows)."""
    try:
        value = json.loads(source)
    except ValueError as exc:
        raise invalid_argument(f"json_schema is not valid JSON: {exc}", "json_schema") from None
    if not isinstance(value, dict | bool):
        raise invalid_argument("json_schema must be a JSON object (a JSON Schema)", "json_schema")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
