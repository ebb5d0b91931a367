"""Token ids to text while streaming: incremental decoding and stop strings.

Works with any tokenizer that has the Hugging Face `decode(ids, skip_special_tokens=...)`.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of the first output token so its leading space survives."""


class IncrementalDetokenizer:
    """Turns one request's output ids into text pieces, one `add()` at a time.

    Prefix/read offsets: `ids[prefix_offset:read_offset]` is a short window of tokens
    whose text was already emitted. Each new token is decoded together with that
    window and the window's own text is cut off the front, so tokenizers whose text
    for a token depends on its neighbours (SentencePiece's leading spaces, byte-level
    BPE's split UTF-8 sequences) stream correctly, at O(window) cost per token.
    Text ending in U+FFFD is an incomplete UTF-8 sequence and is held back.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def add(self, new_ids: list[int]) -> str:
        """Text completed by `new_ids`; never ends in a partial character."""
        pieces = []
        for token_id in new_ids:
            self.ids.append(token_id)
            pieces.append(self._advance(final=False))
        return "".join(pieces)

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (partial bytes become U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text


class StopStringMatcher:
    """Cuts a text stream before the first stop string, holding back possible starts of one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        assert all(stop), f"stop strings must be non-empty: {stop!r}"
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.held = ""
        self.matched: str | None = None
        """The stop string that ended the stream, once one did."""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached); after a stop, ("", True)."""
        if self.stopped:
            return "", True
        buffer = self.held + text
        hit = _earliest_match(buffer, self.stop)
        if hit is not None:
            start, self.matched = hit
            self.held = ""
            return buffer[:start], True
        keep = self._partial_match_len(buffer)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, for a stream that ended for another reason."""
        held, self.held = self.held, ""
        return held

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        for size in range(min(len(buffer), self.max_stop_len - 1), 0, -1):
            suffix = buffer[-size:]
            if any(s.startswith(suffix) for s in self.stop):
                return size
        return 0


def _earliest_match(text: str, stop: tuple[str, ...], ends_after: int = -1) -> tuple[int, str] | None:
    """(index, stop string) of the earliest occurrence ending after index `ends_after`; longer wins ties."""
    best: tuple[int, str] | None = None
    for s in stop:
        idx = text.find(s, max(0, ends_after - len(s) + 1))
        if idx != -1 and (best is None or idx < best[0] or (idx == best[0] and len(s) > len(best[1]))):
            best = (idx, s)
    return best


def find_stop_string(tokenizer: Any, output_ids: list[int], stop: tuple[str, ...],
                     skip_special_tokens: bool = True) -> str | None:
    """The stop string that the newest token completes, or None.

    Only a tail of the output is decoded: enough tokens to hold the longest stop string
    before the newest token (doubled while tokens turn out to carry too few characters).
    A match counts only if it ends inside the newest token's text, so a stop string fires
    once, on the token that completes it; a character still missing bytes belongs to the
    token that completes it.
    """
    if not stop or not output_ids:
        return None
    max_len = max(len(s) for s in stop)
    num_tail = min(len(output_ids), max_len + 2)
    while True:
        tail = output_ids[-num_tail:]
        before = tokenizer.decode(tail[:-1], skip_special_tokens=skip_special_tokens) if len(tail) > 1 else ""
        boundary = len(before.rstrip(REPLACEMENT_CHAR))
        # leading U+FFFD come from a window that starts inside a character
        usable = boundary - (len(before) - len(before.lstrip(REPLACEMENT_CHAR)))
        if usable >= max_len or num_tail == len(output_ids):
            break
        num_tail = min(len(output_ids), num_tail * 2)
    text = tokenizer.decode(tail, skip_special_tokens=skip_special_tokens)
    hit = _earliest_match(text, stop, ends_after=boundary)
    return None if hit is None else hit[1]
