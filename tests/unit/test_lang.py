"""radixmesh.lang without a server: program semantics over a scripted backend, role markers from a
ChatML template, and RuntimeEndpoint's wire handling over a mocked HTTP transport."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import jinja2
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.lang import (
    BaseBackend,
    GenResult,
    ProgramState,
    RuntimeEndpoint,
    SelectResult,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)
from radixmesh.lang.chat import role_markers
from radixmesh.lang.ir import GenParams

CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nDefault prompt<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return jinja2.Template(CHATML).render(messages=messages, add_generation_prompt=add_generation_prompt)


class ScriptedBackend(BaseBackend):
    """Generates "<gen N>" after `delay_s`; select prefers the longest choice; records every call.
    With `meet`, every generate waits at that barrier first (the calls must be in flight together)."""

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None,
                 meet: threading.Barrier | None = None) -> None:
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.meet = meet
        self.calls: list[tuple[str, str, float, float]] = []
        self.lock = threading.Lock()
        self.count = 0

    def generate(self, prompt: str, params: GenParams, on_text: Callable[[str], None] | None = None) -> GenResult:
        start = time.perf_counter()
        if self.fail_on is not None and prompt.endswith(self.fail_on):
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT, "scripted failure", "temperature")
        if self.meet is not None:
            self.meet.wait()
        time.sleep(self.delay_s)
        with self.lock:
            self.count += 1
            text = f"<gen {self.count}>"
        if on_text is not None:
            for piece in (text[:4], text[4:]):
                on_text(piece)
        end = time.perf_counter()
        with self.lock:
            self.calls.append(("generate", prompt, start, end))
        return GenResult(text, {"params": params.to_wire()}, start, end)

    def select(self, prompt: str, choices: tuple[str, ...]) -> SelectResult:
        scores = [float(len(c)) for c in choices]
        best = max(range(len(choices)), key=scores.__getitem__)
        return SelectResult(best, scores, [1] * len(choices))

    def cache_prefix(self, prompt: str) -> None:
        self.calls.append(("cache_prefix", prompt, 0.0, 0.0))

    def role_markers(self, history: tuple[str, ...], role: str) -> tuple[str, str]:
        return role_markers(render_chatml, history, role)


# ---- expressions ---------------------------------------------------------------------------------
def test_gen_params_wire_and_defaults() -> None:
    g = gen("x", max_tokens=5, stop=["a", "b"], json_schema={"type": "object"})
    wire = g.params.merged_over(GenParams(max_tokens=128, temperature=0.0)).to_wire()
    assert wire == {"max_new_tokens": 5, "stop": ["a", "b"], "temperature": 0.0, "json_schema": '{"type": "object"}'}
    with pytest.raises(RadixMeshError):
        gen("x", regex="a", json_schema="{}")
    with pytest.raises(RadixMeshError):
        select("x", choices=[])


# ---- chat templates ------------------------------------------------------------------------------
def test_role_markers_rebuild_the_template_one_message_at_a_time() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    text = ""
    roles: tuple[str, ...] = ()
    for m in messages:
        opening, closing = role_markers(render_chatml, roles, m["role"])
        text += opening + m["content"] + closing
        roles += (m["role"],)
    assert text == render_chatml(messages)
    assert role_markers(render_chatml, (), "user")[0].startswith("<|im_start|>system\nDefault prompt")


def test_role_markers_refuse_a_template_that_rewrites_history() -> None:
    def only_last(messages: list[dict[str, str]]) -> str:
        return f"[{messages[-1]['role']}] {messages[-1]['content']}"

    with pytest.raises(RadixMeshError, match="one message at a time"):
        role_markers(only_last, ("user",), "assistant")


# ---- program semantics ---------------------------------------------------------------------------
@function
def chat_program(s, question):
    s += system("Be brief.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8))
    with s.user():
        s += "Right?"
    s += assistant(select("verdict", choices=["yes", "absolutely"]))


def test_roles_gen_and_select() -> None:
    backend = ScriptedBackend()
    state = chat_program.run(question="Why?", backend=backend, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "<gen 1>"}, {"role": "user", "content": "Right?"},
                {"role": "assistant", "content": "absolutely"}]
    assert state.messages() == messages
    assert state.text() == render_chatml(messages)
    assert state["answer"] == "<gen 1>" and state["verdict"] == "absolutely"
    assert state.get_meta_info("answer")["params"] == {"max_new_tokens": 8, "temperature": 0}
    assert state.get_meta_info("verdict")["logprobs"] == [3.0, 10.0]


def test_fork_runs_branches_concurrently_and_join_gathers() -> None:
    # a barrier, not a sleep: branches run one after another would break it instead of racing a timer
    backend = ScriptedBackend(meet=threading.Barrier(3, timeout=30))

    @function
    def fan(s: ProgramState) -> None:
        s += "Shared. "
        branches = s.fork(3)
        for i, branch in enumerate(branches):
            branch += f"Branch {i}: " + gen("out")
        branches.join()
        s += "Done."

    state = fan.run(backend=backend)
    assert state.text() == "Shared. Done."
    assert sorted(state["out"]) == ["<gen 1>", "<gen 2>", "<gen 3>"]
    assert backend.calls[0][:2] == ("cache_prefix", "Shared. ")
    gens = [c for c in backend.calls if c[0] == "generate"]
    assert max(c[2] for c in gens) < min(c[3] for c in gens)  # all three in flight at once
    assert sorted(c[1] for c in gens) == [f"Shared. Branch {i}: " for i in range(3)]


def test_join_concat_appends_branch_text_in_order() -> None:
    @function
    def fan(s: ProgramState) -> None:
        s += "A"
        branches = s.fork(2)
        branches[0] += "-left"
        branches[1] += "-right"
        branches.join("concat")

    state = fan.run(backend=ScriptedBackend())
    assert state.text() == "A-left-right"
    with pytest.raises(RadixMeshError):
        fan.run(backend=ScriptedBackend()).fork(2).join("zip")


def test_streaming_yields_every_piece_in_order() -> None:
    @function
    def story(s: ProgramState) -> None:
        s += "Start "
        s += gen("g")
        s += " end"

    state = story.run(backend=ScriptedBackend(), stream=True)
    chunks = list(state)
    assert chunks == ["Start ", "<gen", " 1>", " end"]
    assert "".join(chunks) == state.text()


def test_backend_errors_surface_when_reading_and_stop_the_program() -> None:
    backend = ScriptedBackend(fail_on="boom")

    @function
    def failing(s: ProgramState) -> None:
        s += "boom" + gen("x")
        s += gen("never")

    with pytest.raises(RadixMeshError, match="scripted failure"):
        failing.run(backend=backend)
    assert not [c for c in backend.calls if c[0] == "generate"]
    streamed = failing.run(backend=backend, stream=True)
    with pytest.raises(RadixMeshError, match="scripted failure"):
        list(streamed)


def test_role_blocks_must_nest_properly() -> None:
    @function
    def nested(s: ProgramState) -> None:
        s += user("outer " + user("inner"))

    with pytest.raises(RadixMeshError, match="cannot start inside"):
        nested.run(backend=ScriptedBackend())


def test_run_batch_keeps_order_and_raises_the_first_error() -> None:
    @function
    def echo(s: ProgramState, word: str) -> None:
        s += word + gen("g")

    backend = ScriptedBackend(delay_s=0.05, fail_on="boom")
    states = echo.run_batch([{"word": w} for w in ["a", "b", "c", "d"]], backend=backend, num_threads=3)
    assert [s.text()[0] for s in states] == ["a", "b", "c", "d"]
    with pytest.raises(RadixMeshError):
        echo.run_batch([{"word": "ok"}, {"word": "boom"}], backend=backend)
    with pytest.raises(RadixMeshError):
        echo.run_batch([{"word": "a"}], backend=backend, num_threads=0)


def test_run_needs_a_backend() -> None:
    with pytest.raises(RadixMeshError, match="set_default_backend"):
        chat_program.run(question="?")


# ---- RuntimeEndpoint over a mocked transport -----------------------------------------------------
def _endpoint(handler: Callable[[str, dict[str, Any]], tuple[int, Any]]) -> RuntimeEndpoint:
    def respond(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        status, payload = handler(request.url.path, body)
        return httpx.Response(status, json=payload)

    return RuntimeEndpoint("http://server", api_key="k", transport=httpx.MockTransport(respond))


def test_select_scores_from_where_each_choice_begins() -> None:
    sent: list[dict[str, Any]] = []

    def handler(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/model_info":
            return 200, {"model_path": "m"}
        if path == "/tokenize":  # the second choice merges with the prefix's last token
            return 200, {"tokens": [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9]], "count": [3, 5, 3]}
        sent.append(body)
        logprobs = [[[-0.5, 4, None], [-0.25, 5, None]], [[-2.0, 9, None]]]
        return 200, [{"text": "", "meta_info": {"input_token_logprobs": lps}} for lps in logprobs]

    result = _endpoint(handler).select("prefix", ("ab", "c"))
    assert sent[0]["logprob_start_len"] == [3, 2] and sent[0]["input_ids"] == [[1, 2, 3, 4, 5], [1, 2, 9]]
    assert sent[0]["return_logprob"] is True
    assert result.index == 0 and result.logprobs == [-0.75, -2.0] and result.num_tokens == [2, 1]


def test_server_errors_become_domain_errors() -> None:
    def handler(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/model_info":
            return 200, {}
        return 400, {"error": {"message": "invalid temperature=-1", "type": "invalid_request_error",
                               "param": "temperature", "code": "invalid_argument"}}

    with pytest.raises(RadixMeshError) as info:
        _endpoint(handler).generate("Hi", GenParams(temperature=-1))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.param == "temperature"

    with pytest.raises(RadixMeshError) as unauthorized:
        _endpoint(lambda path, body: (401, {"error": {"message": "no", "code": "invalid_api_key"}}))
    assert unauthorized.value.code is ErrorCode.UNAUTHENTICATED


def test_unreachable_server_is_unavailable() -> None:
    with pytest.raises(RadixMeshError) as info:
        RuntimeEndpoint("http://127.0.0.1:1", timeout_s=2)
    assert info.value.code is ErrorCode.UNAVAILABLE
