"""One long prompt encoded on several threads: cut where the tokenizer always splits, encode the pieces at once.

The Rust tokenizer encodes one text on one thread (its time grows with the text: ~2-7 ms per 1,000 tokens of
the `random` workload's text on a server CPU); `encode_batch` releases the GIL, so pieces of one text encode in
parallel on the tokenizer pool's threads. The ids are the same as the whole text's when every stage of the
tokenizer works on the pieces as it would on the whole:

- a cut sits before a space whose left neighbour is a letter, digit or ASCII symbol: the pre-tokenizer's regex
  (GPT-2's, Llama 3's, Qwen2's) never lets a match run from such a character over the space, and matches carry
  no look-behind, so the whole text's matches are the pieces' matches;
- no normalizer, or NFC (a space is a starter: nothing composes or reorders across it);
- BPE on each pre-token alone; added tokens without whitespace and without lstrip/rstrip/single_word (an
  added token never spans or eats the space at a cut);
- the post-processor (BOS, EOS, templates) runs once, on the joined pieces, as `encode` runs it.

Any other tokenizer (Metaspace/SentencePiece-style, other regexes, other models) is encoded whole.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from radixmesh.common.env import tokenize_min_piece_chars

MIN_PIECE_CHARS = 4096
"""Shortest piece worth its own thread on a small host (about 600-1,000 tokens: on a busy 2-core machine, pieces of
a 1k-token prompt cost more in hand-offs than they saved)."""
MIN_PIECE_CHARS_MANY_CORES = 1536
"""Shortest piece on a host of `MANY_CORES`+ cores (a GPU host's): cutting costs no encode time (a 4k-token random
prompt: 33 ms whole, 30 ms in eight pieces one after the other), so idle cores take pieces of ~250+ tokens."""
MANY_CORES = 8


def default_min_piece_chars(cores: int) -> int:
    """The shortest piece for a host whose process may run on `cores` cores (RADIXMESH_TOKENIZE_MIN_PIECE_CHARS
    when set: for A/B runs on a GPU host)."""
    chosen = tokenize_min_piece_chars()
    if chosen is not None:
        return chosen
    return MIN_PIECE_CHARS_MANY_CORES if cores >= MANY_CORES else MIN_PIECE_CHARS

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPLIT_PATTERNS = frozenset({GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN})
"""Pre-tokenizer regexes (of a `Split` stage) for which a cut before " X" is always a match boundary."""


def _pre_tokenizer_splits(stage: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer stage (or Sequence) keeps every cut a pre-token boundary."""
    if stage is None:
        return False
    kind = stage.get("type")
    if kind == "Sequence":
        stages = stage.get("pretokenizers") or []
        return bool(stages) and all(_pre_tokenizer_splits(s) or _is_byte_mapping(s) for s in stages) \
            and any(_pre_tokenizer_splits(s) for s in stages)
    if kind == "ByteLevel":
        return bool(stage.get("use_regex")) and not stage.get("add_prefix_space")
    if kind == "Split":
        pattern = stage.get("pattern") or {}
        return pattern.get("Regex") in SPLIT_PATTERNS and stage.get("behavior") == "Isolated" \
            and not stage.get("invert")
    return False


def _is_byte_mapping(stage: dict[str, Any]) -> bool:
    """Stages that work character by character or digit by digit (safe anywhere, but cut nothing themselves)."""
    if stage.get("type") == "ByteLevel":
        return not stage.get("use_regex") and not stage.get("add_prefix_space")
    return stage.get("type") == "Digits"


def can_split(backend: Any) -> bool:
    """Whether a Rust tokenizer (`tokenizers.Tokenizer`) encodes pieces cut by `cut_points` as the whole text."""
    if not all(hasattr(backend, name) for name in ("to_str", "encode_batch", "post_process")):
        return False
    try:
        config = json.loads(backend.to_str())
    except (TypeError, ValueError):
        return False
    normalizer = config.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return False
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return False
    for token in config.get("added_tokens") or []:
        content = str(token.get("content", ""))
        if not content or any(c.isspace() for c in content) or token.get("lstrip") or token.get("rstrip") \
                or token.get("single_word"):
            return False
    return _pre_tokenizer_splits(config.get("pre_tokenizer"))


def _may_cut_after(char: str) -> bool:
    """A letter, digit or visible ASCII character: never whitespace to any regex flavour."""
    return char.isalnum() or "!" <= char <= "~"


def cut_points(text: str, max_pieces: int, min_piece_chars: int = MIN_PIECE_CHARS) -> list[int]:
    """Where to cut `text` into at most `max_pieces` pieces of about equal length, each at least
    `min_piece_chars` long: positions of spaces after a letter, digit or ASCII symbol (empty: keep it whole)."""
    num_pieces = min(max_pieces, len(text) // min_piece_chars)
    cuts: list[int] = []
    for k in range(1, num_pieces):
        pos = max(k * len(text) // num_pieces, (cuts[-1] if cuts else 0) + min_piece_chars)
        while True:
            pos = text.find(" ", pos)
            if pos <= 0 or _may_cut_after(text[pos - 1]):
                break
            pos += 1
        if pos <= 0 or len(text) - pos < min_piece_chars:
            break
        cuts.append(pos)
    return cuts


class SplitEncoder:
    """`encode(texts, add_special_tokens) -> ids per text`: long texts in pieces, their later pieces on `executor`.

    A text gets at most `max_pieces` pieces, and at most one more than `spare_threads()` (the pool's workers
    that are idle now): under load every prompt is encoded whole, no more threads than workers compete for the
    cores. Call it from a thread that is not one of `executor`'s (the pool's own workers): it waits for the pieces.
    """

    def __init__(self, backend: Any, executor: Executor, max_pieces: int, min_piece_chars: int = MIN_PIECE_CHARS,
                 spare_threads: Callable[[], int] | None = None) -> None:
        from tokenizers import Encoding

        self.backend = backend
        self.executor = executor
        self.max_pieces = max_pieces
        self.min_piece_chars = min_piece_chars
        self.spare_threads = spare_threads
        self._merge: Callable[..., Any] = Encoding.merge
        self._encode_batch: Callable[..., list[Any]] = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def __call__(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        max_pieces = self.max_pieces if self.spare_threads is None else min(self.max_pieces, 1 + self.spare_threads())
        cuts = [cut_points(t, max_pieces, self.min_piece_chars) for t in texts] if max_pieces > 1 else []
        if not any(cuts):
            return [e.ids for e in self._encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        heads: list[str] = []
        later = []
        for text, points in zip(texts, cuts):
            bounds = [0, *points, len(text)]
            heads.append(text[:bounds[1]])
            later.append([self.executor.submit(self._encode_batch, [text[a:b]], add_special_tokens=False)
                          for a, b in itertools.pairwise(bounds[1:])])
        head_encodings = self._encode_batch(heads, add_special_tokens=False)
        ids = []
        for head, rest in zip(head_encodings, later):
            pieces = [head, *(future.result()[0] for future in rest)]
            joined = self._merge(pieces, growing_offsets=False) if len(pieces) > 1 else head
            ids.append(self.backend.post_process(joined, None, add_special_tokens).ids)
        return ids
