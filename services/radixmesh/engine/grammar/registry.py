"""Grammar backend id -> lazily imported class; --grammar-backend takes these ids."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.grammar.spec import GrammarSpec

if TYPE_CHECKING:
    from radixmesh.engine.grammar.base import BaseGrammarBackend

GRAMMAR_BACKENDS: dict[str, str] = {
    "xgrammar": "radixmesh.engine.grammar.xgrammar_backend:XGrammarBackend",
}
DEFAULT_GRAMMAR_BACKEND = "xgrammar"


def grammar_backend_class(name: str) -> type[BaseGrammarBackend]:
    target = GRAMMAR_BACKENDS.get(name.replace("_", "-"))
    if target is None:
        raise invalid_argument(f"unknown grammar backend {name!r} (known: {', '.join(sorted(GRAMMAR_BACKENDS))})",
                               "grammar_backend")
    module, _, attr = target.partition(":")
    cls: type[BaseGrammarBackend] = getattr(importlib.import_module(module), attr)
    return cls


def check_grammar_syntax(spec: GrammarSpec, backend: str = DEFAULT_GRAMMAR_BACKEND) -> None:
    """Raise INVALID_ARGUMENT, naming the field and the problem, for a spec the backend cannot read."""
    grammar_backend_class(backend).check_syntax(spec)
