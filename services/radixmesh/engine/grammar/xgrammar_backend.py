"""The `xgrammar` grammar backend: JSON schema, regex, EBNF, structural tags and the built-in any-JSON grammar.

JSON is generated compactly (`{"a": 1, "b": [2, 3]}`: one space after ':' and ','; no
other whitespace) and strictly (objects take only the properties the schema declares
unless it allows more). Free whitespace would let a sampling model wander in blank
space; fixed separators also give jump-forward longer forced strings.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.grammar.base import BaseGrammarBackend, GrammarMatcher
from radixmesh.engine.grammar.spec import GrammarSpec
from radixmesh.engine.grammar.vocab_mask import num_mask_words

if TYPE_CHECKING:
    import xgrammar as xgr

THREADED_FILL_MIN_S = 0.004
"""Masks are filled by xgrammar's thread pool only when one thread would take longer than this:
a call into the pool costs about a millisecond, while a JSON-schema row takes a few microseconds."""
RECHECK_EVERY = 32
"""While the pool fills masks, every this many calls one thread fills them again, to re-measure."""
_LOG_PREFIX = re.compile(r"^\[[0-9:. ]+\]\s*\S+:\d+:\s*")


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its C++ log prefix (timestamp, file, line)."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return next((line for line in lines if line), type(exc).__name__)


@functools.lru_cache(maxsize=512)
def _syntax_error(kind: str, source: str) -> str | None:
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(source)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(source)
    except (RuntimeError, ValueError, TypeError) as exc:
        return _clean(exc)
    return None


class XGrammarBackend(BaseGrammarBackend):
    """xgrammar compiler and matchers for one tokenizer and the model's vocabulary width."""

    id = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int = 1) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        # Caching is ours (by content key), so xgrammar's own cache would only hold copies.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max(num_threads, 1), cache_enabled=False)
        self._threads = max(num_threads, 1)
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self._threads)
        self._row_fill_s = 0.0  # one thread's time per row, a moving average
        self._threaded_calls = 0

    @classmethod
    def check_syntax(cls, spec: GrammarSpec) -> None:
        error = _syntax_error(spec.kind, spec.source)
        if error is not None:
            raise invalid_argument(f"invalid {spec.param}: {error}", spec.param)

    @property
    def serialization_version(self) -> str:
        return f"xgrammar-{self._xgr.get_serialization_version()}"

    def compile(self, spec: GrammarSpec) -> Any:
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.source)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.source)
            return compiler.compile_builtin_json_grammar()
        except (RuntimeError, ValueError, TypeError) as exc:
            raise invalid_argument(f"invalid {spec.param}: {_clean(exc)}", spec.param) from None

    def serialize(self, compiled: Any) -> bytes:
        return str(compiled.serialize_json()).encode()

    def deserialize(self, data: bytes) -> Any:
        try:
            return self._xgr.CompiledGrammar.deserialize_json(data.decode(), self.info)
        except (RuntimeError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot load the compiled grammar: {_clean(exc)}") from None

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        matcher: GrammarMatcher = self._xgr.GrammarMatcher(compiled)
        return matcher

    def allocate_mask(self, batch_size: int, pinned: bool = False) -> torch.Tensor:
        # xgrammar's layout (32 tokens per int32 word, all bits set = all allowed), in memory we choose
        return torch.full((batch_size, num_mask_words(self.vocab_size)), -1, dtype=torch.int32, pin_memory=pinned)

    def fill_masks(self, matchers: list[GrammarMatcher], mask: torch.Tensor, rows: list[int]) -> None:
        assert len(matchers) == len(rows), f"{len(matchers)} matchers for {len(rows)} rows"
        own = cast("list[xgr.GrammarMatcher]", matchers)  # new_matcher made every one of them
        if (self._threads > 1 and len(rows) * self._row_fill_s > THREADED_FILL_MIN_S
                and self._threaded_calls < RECHECK_EVERY - 1):
            self._threaded_calls += 1
            self._batch_matcher.batch_fill_next_token_bitmask(own, mask, rows)
            return
        rechecking, self._threaded_calls = self._threaded_calls > 0, 0
        start = time.perf_counter()
        for matcher, row in zip(own, rows):
            matcher.fill_next_token_bitmask(mask, row)
        per_row = (time.perf_counter() - start) / max(len(rows), 1)
        smooth = self._row_fill_s > 0.0 and not rechecking
        self._row_fill_s = 0.8 * self._row_fill_s + 0.2 * per_row if smooth else per_row
