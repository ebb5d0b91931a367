"""Incremental reading of JSON tool-call objects (gateway/tools/json_scan): strings and values that end or not
yet, call objects read prefix by prefix (with and without a memo: the same answers), and runs of calls."""

from __future__ import annotations

import json

import pytest

from radixmesh.gateway.tools.json_scan import (
    CallScan,
    Memo,
    read_run,
    scan_call,
    skip_ws,
    string_end,
    value_end,
)


def test_skip_ws_stops_at_text_or_end() -> None:
    assert skip_ws(" \t\r\n x", 0) == 5 and skip_ws("x", 0) == 0 and skip_ws("  ", 0) == 2


@pytest.mark.parametrize(("text", "expected"), [
    ('"abc" rest', 5),
    ('"a\\"b"', 6),  # an escaped quote does not end it
    ('"a\\\\"x', 5),  # an escaped backslash before the quote does
    ('"abc', None),
    ('"ab\\', None),  # ends inside an escape
])
def test_string_end(text: str, expected: int | None) -> None:
    assert string_end(text, 0) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("123, x", 3),
    ("true}", 4),
    ("12", None),  # a number may still grow
    ('{"a": [1, "}"]} tail', 15),  # brackets inside strings do not count
    ('[{"a": 1}, [2]]', 15),
    ('{"a": "x', None),
    ('{"a": {"b": 1}', None),
])
def test_value_end(text: str, expected: int | None) -> None:
    assert value_end(text, 0) == expected


def test_value_end_with_a_memo_resumes_and_agrees_on_every_prefix() -> None:
    text = '{"k": ["a\\"]", {"n": [1, 2, {"deep": "}}"}]}], "z": null} after'
    memo: Memo = {}
    for cut in range(1, len(text) + 1):
        assert value_end(text[:cut], 0, memo) == value_end(text[:cut], 0), cut
    assert value_end(text, 0) == text.index(" after")


CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'


def test_a_complete_call_has_its_name_arguments_and_end() -> None:
    scan = scan_call(CALL, 0)
    assert scan.valid and scan.complete and scan.end == len(CALL) and scan.name == "get_weather"
    assert json.loads(scan.arguments(CALL) or "") == {"city": "Paris", "days": [1, 2]}


def test_a_growing_call_reports_the_name_then_partial_arguments() -> None:
    memo: Memo = {}
    seen_name_at = None
    for cut in range(1, len(CALL) + 1):
        text = CALL[:cut]
        scan, fresh = scan_call(text, 0, memo), scan_call(text, 0)
        assert scan == fresh, cut
        assert scan.valid
        if scan.name is not None and seen_name_at is None:
            seen_name_at = cut
        args = scan.arguments(text)
        if args is not None:
            assert CALL.startswith(args, CALL.index('{"city"'))  # always a prefix of the final arguments
    assert seen_name_at == CALL.index('", "arguments"') + 1  # the name once its closing quote arrived


def test_arguments_given_as_a_json_string_are_decoded_once_complete() -> None:
    text = '{"name": "f", "arguments": "{\\"x\\": 1}"}'
    assert scan_call(text, 0).arguments(text) == '{"x": 1}'
    partial = text[:text.index("1")]
    assert scan_call(partial, 0).arguments(partial) is None  # a partial string says nothing yet
    bad = '{"name": "f", "arguments": "a\\qb"}'  # an invalid escape: not decodable, so it stays raw
    assert scan_call(bad, 0).arguments(bad) == '"a\\qb"'


def test_parameters_key_and_calls_without_arguments() -> None:
    text = '{"parameters": {"q": 1}, "name": "search"}'
    scan = scan_call(text, 0)
    assert scan.name == "search" and scan.arguments(text) == '{"q": 1}'
    bare = '{"name": "ping"}'
    assert scan_call(bare, 0).arguments(bare) == "{}"
    assert scan_call(bare[:-1], 0).arguments(bare[:-1]) is None  # not complete: arguments may still come


@pytest.mark.parametrize("text", [
    '["name"]',  # not an object
    '{name: "f"}',  # an unquoted key
    '{"name" 1}',  # no colon
    '{"name": 5}',  # a name that is not a string
    '{"name": "f" "x": 1}',  # no comma
])
def test_text_that_cannot_be_a_call_is_invalid(text: str) -> None:
    assert not scan_call(text, 0).valid


def test_a_non_string_name_is_refused_before_it_ends() -> None:
    assert not scan_call('{"name": {"a"', 0).valid
    assert scan_call('{"name": "ab', 0).valid  # a string name still arriving is fine


def test_scan_call_reads_from_an_offset() -> None:
    text = "<tool_call>" + CALL
    scan = scan_call(text, len("<tool_call>"))
    assert scan.name == "get_weather" and scan.end == len(text)
    assert scan_call(text, 0) == CallScan(valid=False)


# ---- runs of calls -------------------------------------------------------------------------------------------
def test_a_run_with_separator_and_close() -> None:
    second = '{"name": "b", "arguments": {}}'
    text = f"[{CALL}, {second}] then text"
    run = read_run(text, 1, ",", "]")
    assert [scan.name for scan, _ in run.calls] == ["get_weather", "b"]
    assert [at for _, at in run.calls] == [1, text.index(second)]
    assert run.end == text.rindex("]") + 1 and not run.pending


def test_a_run_waits_on_a_partial_separator_or_close() -> None:
    text = CALL + "<|sep"
    run = read_run(text, 0, "<|sep|>", "<|end|>")
    assert run.pending and len(run.calls) == 1
    run = read_run(CALL + " <|e", 0, "<|sep|>", "<|end|>")
    assert run.pending
    run = read_run(CALL + " <|end|>", 0, "<|sep|>", "<|end|>")
    assert run.end == len(CALL) + len(" <|end|>")


def test_a_run_without_close_ends_at_its_last_object() -> None:
    run = read_run(CALL + "; ", 0, ";", "")
    assert run.pending  # a separator: another call may follow
    run = read_run(CALL + "; more", 0, ";", "")
    assert run.failed_at == len(CALL) + 2  # what follows the separator is not a call
    run = read_run(CALL + " and so on", 0, ";", "")
    assert run.end == len(CALL) and [s.name for s, _ in run.calls] == ["get_weather"]


def test_text_after_a_call_that_is_neither_separator_nor_close_fails_the_run_there() -> None:
    text = CALL + " oops"
    run = read_run(text, 0, ",", "]")
    assert run.failed_at == len(CALL) + 1 and len(run.calls) == 1


def test_an_element_without_a_name_fails_the_run_at_it() -> None:
    text = f'{CALL}, {{"arguments": {{}}}}]'
    run = read_run(text, 0, ",", "]")
    assert len(run.calls) == 1 and run.failed_at == text.index('{"arguments"')


def test_a_call_malformed_after_its_name_ends_the_run_with_the_rest_dropped() -> None:
    text = '{"name": "f" ; garbage'
    run = read_run(text, 0, ",", "]")
    assert [s.name for s, _ in run.calls] == ["f"] and run.end == len(text)
    assert not run.calls[0][0].valid
