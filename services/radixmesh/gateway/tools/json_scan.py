"""Incremental reading of JSON tool-call objects in text that may still be growing.

A tool call is written by every supported family as a JSON object with a `name` string and an
`arguments` (or `parameters`) value, `{"name": "f", "arguments": {"x": 1}}`. `scan_call` reads as
much of such an object as the text holds: the name once its string is complete, where the
arguments value starts and (once complete) ends, and where the object ends. Nothing is parsed
twice into Python values except the short name string.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")
"""Keys of the arguments value (OpenAI's name, and Llama's)."""


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


_STRING_STOP = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'[{}\[\]"]')
_SCALAR_END = re.compile(r"[,}\] \t\r\n]")


Memo = dict[tuple[str, int], tuple[int, int]]
"""Where scanning of a value (by kind and start index) stopped when the text ran out: (depth, resume index).
The text only grows, so a later scan of the same value resumes there instead of starting over; one memo per
growing text (a stream), never shared between texts."""


def string_end(text: str, pos: int, memo: Memo | None = None) -> int | None:
    """Index just past the JSON string opening at text[pos] == '"', or None when the text ends inside it."""
    i = memo.get(("s", pos), (0, pos + 1))[1] if memo is not None else pos + 1
    while True:
        stop = _STRING_STOP.search(text, i)
        if stop is None or (stop.group() == "\\" and stop.end() >= len(text)):
            if memo is not None:
                memo[("s", pos)] = (0, i)
            return None
        if stop.group() == '"':
            return stop.end()
        i = stop.end() + 1  # past the escaped character


def value_end(text: str, pos: int, memo: Memo | None = None) -> int | None:
    """Index just past the JSON value starting at text[pos] (no leading whitespace), or None when the text
    ends before the value does. Malformed values end where their brackets balance; json.loads judges them."""
    ch = text[pos]
    if ch == '"':
        return string_end(text, pos, memo)
    if ch not in "{[":
        stop = _SCALAR_END.search(text, pos)
        return stop.start() if stop is not None else None
    depth, i = memo.get(("v", pos), (0, pos)) if memo is not None else (0, pos)
    while True:
        stop = _STRUCTURE.search(text, i)
        if stop is None:
            if memo is not None:
                memo[("v", pos)] = (depth, len(text))
            return None
        if stop.group() == '"':
            end = string_end(text, stop.start(), memo)
            if end is None:
                if memo is not None:
                    memo[("v", pos)] = (depth, stop.start())
                return None
            i = end
            continue
        depth += 1 if stop.group() in "{[" else -1
        if depth == 0:
            return stop.end()
        i = stop.end()


@dataclass
class CallScan:
    """What the text holds so far of one call object."""

    valid: bool = True
    """False once the text cannot be a call object (not an object, a key without a value, a non-string name)."""
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None
    """Index just past the object's closing brace, once the text has it."""

    @property
    def complete(self) -> bool:
        return self.end is not None

    def arguments(self, text: str) -> str | None:
        """The arguments as JSON text, as far as known: the raw value (possibly partial); a string value that
        holds JSON (some models write `"arguments": "{...}"`) only once complete, decoded; "{}" when a
        complete object has none. None while nothing can be said yet."""
        if self.args_start is None:
            return "{}" if self.complete else None
        raw = text[self.args_start:self.args_end if self.args_end is not None else len(text)]
        if not raw.startswith('"'):
            return raw
        if self.args_end is None:
            return None
        try:
            decoded = json.loads(raw)
        except ValueError:
            return raw
        return decoded if isinstance(decoded, str) else raw


def scan_call(text: str, pos: int, memo: Memo | None = None) -> CallScan:
    """Read the call object whose '{' is at text[pos]."""
    scan = CallScan()
    if pos >= len(text) or text[pos] != "{":
        scan.valid = False
        return scan
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        after = _member(text, i, scan, memo)
        if after is None or not scan.valid:
            return scan
        i = skip_ws(text, after)
        if i >= len(text):
            return scan
        if text[i] == ",":
            i += 1
        elif text[i] == "}":
            scan.end = i + 1
            return scan
        else:
            scan.valid = False
            return scan


def _member(text: str, i: int, scan: CallScan, memo: Memo | None) -> int | None:
    """Read `"key": value` from text[i]; the index after it, or None when the text ends first."""
    if text[i] != '"':
        scan.valid = False
        return None
    key_end = string_end(text, i, memo)
    if key_end is None:
        return None
    key = _loads(text[i:key_end])
    i = skip_ws(text, key_end)
    if i >= len(text):
        return None
    if text[i] != ":":
        scan.valid = False
        return None
    i = skip_ws(text, i + 1)
    if i >= len(text):
        return None
    if key in ARGUMENT_KEYS and scan.args_start is None:
        scan.args_start = i
    end = value_end(text, i, memo)
    if end is None:
        if key == "name" and text[i] != '"':
            scan.valid = False
        return None
    if key == "name":
        name = _loads(text[i:end])
        if not isinstance(name, str):
            scan.valid = False
            return None
        scan.name = name
    elif key in ARGUMENT_KEYS and scan.args_start == i:
        scan.args_end = end
    return end


@functools.lru_cache(maxsize=1024)
def _loads(text: str) -> object:
    """A key or name string, decoded (the same few are read again each time a stream's text grows)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass
class CallRun:
    """Calls read from a run of call objects (`{...}` sep `{...}` ... close)."""

    calls: list[tuple[CallScan, int]]
    """Each named call with the index its object starts at."""
    end: int | None = None
    """Index just past the run (after `close`, or after the last object when the run has no close), once the
    text shows the run is over."""
    failed_at: int | None = None
    """Index of the first element that is not a call: the run ends there and the text from it is not calls."""

    @property
    def pending(self) -> bool:
        """The text may still extend the run."""
        return self.end is None and self.failed_at is None


def read_run(text: str, pos: int, separator: str, close: str, memo: Memo | None = None) -> CallRun:
    """Call objects from text[pos] (a '{'), joined by `separator`, ended by `close` ("": by anything that is
    not the separator). An element without a name, once complete or malformed, ends the run as failed."""
    run = CallRun([])
    i = pos
    while True:
        scan = scan_call(text, i, memo)
        if scan.name is None:
            if not scan.valid or scan.complete:
                run.failed_at = i
            return run
        run.calls.append((scan, i))
        if not scan.valid:  # malformed after its name: the call is cut there and the rest of the output dropped
            run.end = len(text)
            return run
        if scan.end is None:
            return run
        after = skip_ws(text, scan.end)
        if after >= len(text):
            return run
        if separator and text.startswith(separator, after):
            i = skip_ws(text, after + len(separator))
            if i >= len(text):
                return run
            continue
        if separator and separator.startswith(text[after:]):
            return run  # the start of a separator
        if close and text.startswith(close, after):
            run.end = after + len(close)
        elif close and close.startswith(text[after:]):
            return run
        elif close:
            run.failed_at = after
        else:
            run.end = scan.end
        return run
