"""Grammar backend id -> lazily imported class; --grammar-backend takes these ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.common.registry import LazyRegistry
from radixmesh.engine.grammar.spec import GrammarSpec

if TYPE_CHECKING:
    from radixmesh.engine.grammar.base import BaseGrammarBackend

GRAMMAR_BACKENDS: LazyRegistry[type[BaseGrammarBackend]] = LazyRegistry("grammar backend", {
    "xgrammar": "radixmesh.engine.grammar.xgrammar_backend:XGrammarBackend",
}, param="grammar_backend", dashes_for_underscores=True)
DEFAULT_GRAMMAR_BACKEND = "xgrammar"


def grammar_backend_class(name: str) -> type[BaseGrammarBackend]:
    return GRAMMAR_BACKENDS.load(name)


def check_grammar_syntax(spec: GrammarSpec, backend: str = DEFAULT_GRAMMAR_BACKEND) -> None:
    """Raise INVALID_ARGUMENT, naming the field and the problem, for a spec the backend cannot read."""
    grammar_backend_class(backend).check_syntax(spec)
