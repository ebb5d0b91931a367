"""Role blocks in the model's own chat template, derived from the template itself.

A template is a function of whole conversations, but a program writes one message at a
time. The text that opens and closes a `role` message after messages of roles `history`
is found by rendering the conversation with placeholder contents twice, without and with
the new message: the difference, split at the new placeholder, is (opening, closing).
This holds for every template whose rendering of a conversation starts with the rendering
of its earlier messages (ChatML, Llama 3, Qwen, ...); others are reported as errors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from radixmesh.common.errors import invalid_argument

PLACEHOLDER = "RADIXMESHROLECONTENT"
Render = Callable[[list[dict[str, str]]], str]
"""Renders messages in the chat template, with no generation prompt at the end."""


def role_markers(render: Render, history: tuple[str, ...], role: str) -> tuple[str, str]:
    """(opening, closing) text of a `role` message that follows messages of roles `history`."""
    earlier = [{"role": r, "content": f"{PLACEHOLDER}{i}"} for i, r in enumerate(history)]
    marker = f"{PLACEHOLDER}{len(history)}"
    before = render(earlier) if earlier else ""
    after = render([*earlier, {"role": role, "content": marker}])
    if not after.startswith(before) or after.count(marker) != 1:
        raise invalid_argument(f"the chat template cannot be written one message at a time (adding a {role} "
                               f"message after {list(history)} rewrites the earlier text)", "role")
    opening, _, closing = after[len(before):].partition(marker)
    return opening, closing


class RoleMarkerCache:
    """`role_markers` memoized per (history, role): one render pair per new conversation shape."""

    def __init__(self, render: Render) -> None:
        self.render = render
        self._cache: dict[tuple[tuple[str, ...], str], tuple[str, str]] = {}
        self._lock = threading.Lock()

    def get(self, history: tuple[str, ...], role: str) -> tuple[str, str]:
        key = (history, role)
        with self._lock:
            found = self._cache.get(key)
        if found is None:
            found = role_markers(self.render, history, role)
            with self._lock:
                self._cache[key] = found
        return found
