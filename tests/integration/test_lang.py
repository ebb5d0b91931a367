"""radixmesh.lang programs against a real `radixmesh serve` (default model, CPU), and the server
features they rely on: prompt log-probs on /generate, /tokenize and /apply_chat_template.

One server for the module, started like the one of test_gateway_server.py (its helpers are
reused) and stopped by PID. Generations are short: the point is the plumbing, not the prose.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.lang import ProgramState, RuntimeEndpoint, assistant, function, gen, select, system, user
from tests.ports import free_port

from .serve_process import API_KEY, Server, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="radixmesh-lang-test-")) / "serve.log"
    cmd = [sys.executable, "-m", "radixmesh.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--api-key", API_KEY, "--graceful-shutdown-s", "1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path)
        yield Server(url, proc, log_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def backend(server: Server) -> Iterator[RuntimeEndpoint]:
    with RuntimeEndpoint(server.url, api_key=API_KEY) as endpoint:
        yield endpoint


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"radixmesh_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tokens(server: Server, text: str) -> list[int]:
    response = server.post("/tokenize", {"prompt": text})
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


# ---- server support ------------------------------------------------------------------------------
def test_generate_returns_prompt_logprobs_per_prompt(server: Server) -> None:
    texts = ["The capital of France is", "One, two, three, four"]
    ids = [_tokens(server, t) for t in texts]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": [0, 2], "top_logprobs_num": 2, "return_text_in_logprobs": True}
    response = server.post("/generate", body)
    assert response.status_code == 200, response.text
    first, second = response.json()
    prompt = first["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in prompt] == ids[0]
    assert prompt[0][0] is None and all(lp < 0 for lp, _, _ in prompt[1:])
    assert "".join(text for _, _, text in prompt) == texts[0]
    assert first["meta_info"]["input_top_logprobs"][0] is None
    assert all(len(row) == 2 for row in first["meta_info"]["input_top_logprobs"][1:])
    assert [t for _, t, _ in second["meta_info"]["input_token_logprobs"]] == ids[1][2:]
    assert len(first["meta_info"]["output_token_logprobs"]) == 2


def test_generate_rejects_a_start_past_the_prompt(server: Server) -> None:
    body = {"text": "Hi there", "return_logprob": True, "logprob_start_len": 50,
            "sampling_params": {"max_new_tokens": 1}}
    response = server.post("/generate", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logprob_start_len"


def test_tokenize_and_chat_template(server: Server) -> None:
    single = server.post("/tokenize", {"prompt": "Hello world"}).json()
    batch = server.post("/tokenize", {"prompt": ["Hello world", "Hi"]}).json()
    assert batch["tokens"][0] == single["tokens"] and batch["count"] == [single["count"], len(batch["tokens"][1])]
    assert single["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hi"}]
    open_turn = server.post("/apply_chat_template", {"messages": messages}).json()["text"]
    closed = server.post("/apply_chat_template", {"messages": messages, "add_generation_prompt": False}).json()["text"]
    assert open_turn.startswith(closed) and len(open_turn) > len(closed) and "Hi" in closed


# ---- the examples --------------------------------------------------------------------------------
def _run_example(server: Server, name: str, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    module = _example(name)
    assert module.main(["--url", server.url, "--api-key", API_KEY, *flags]) == 0
    return capsys.readouterr().out


def test_essay_judge_example(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_example(server, "lang_essay_judge", capsys, "--max-tokens", "8")
    module = _example("lang_essay_judge")
    for dimension in module.DIMENSIONS:
        assert re.search(rf"^{dimension}: \S", out, re.MULTILINE), out
    assert re.search(r"^Summary: ", out, re.MULTILINE), out
    grade = re.search(r"^Grade: (\S+)$", out, re.MULTILINE)
    assert grade is not None and grade.group(1) in module.GRADES, out


def test_chat_example(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_example(server, "lang_chat", capsys, "--max-tokens", "8")
    module = _example("lang_chat")
    for question in module.QUESTIONS:
        assert f"user: {question}" in out
    assert out.count("\nassistant: ") == len(module.QUESTIONS)
    cached = re.search(r"per turn: \[(.*)\]", out)
    assert cached is not None, out
    per_turn = [int(n) for n in cached.group(1).split(",")]
    assert per_turn[1] > per_turn[0] and per_turn[2] > per_turn[1]  # each turn reuses the conversation so far


def test_classifier_example(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_example(server, "lang_classifier", capsys, "--threads", "4")
    module = _example("lang_classifier")
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == len(module.REVIEWS)
    for line, review in zip(lines, module.REVIEWS):
        assert line.split()[0] in module.LABELS and review in line


# ---- language semantics against the real model ---------------------------------------------------
SHARED = ("You are a librarian. A reader asks for book recommendations about the sea, "
          "about mountains and about cities. Answer each request with a title.\n")


@function
def fan_out(s, topics: list[str]):
    s += SHARED
    branches = s.fork(len(topics))
    for branch, topic in zip(branches, topics):
        branch += f"A book about {topic}:" + gen("title", max_tokens=6, ignore_eos=True)
    branches.join()


def test_fork_branches_overlap_and_reuse_the_shared_prefix(backend: RuntimeEndpoint, server: Server) -> None:
    topics = ["the sea", "mountains", "cities"]
    state = fan_out.run(topics=topics, backend=backend, temperature=0)
    titles = state["title"]
    metas = state.get_meta_info("title")
    assert len(titles) == len(topics) and all(isinstance(t, str) and t for t in titles)
    # the branches' requests were in flight at the same time
    assert max(m["start_s"] for m in metas) < min(m["end_s"] for m in metas)
    shared_len = len(_tokens(server, SHARED))
    for meta in metas:
        assert meta["cached_tokens"] >= shared_len - 1, (meta["cached_tokens"], shared_len)
        assert meta["completion_tokens"] == 6


PREFIX = "Q: What is the capital of France?\nA: The capital of France is"
CHOICES = [" Paris", " London", " a large city", " Berlin, of course"]


@function
def pick(s, prefix: str, choices: list[str]):
    s += prefix + select("answer", choices=choices)


def _direct_scores(server: Server, prefix: str, choices: list[str]) -> list[float]:
    """Each choice alone: whole-prompt log-probs, summed from where the choice's tokens begin."""
    prefix_ids = _tokens(server, prefix)
    scores = []
    for choice in choices:
        body = {"text": prefix + choice, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        response = server.post("/generate", body)
        assert response.status_code == 200, response.text
        entries = response.json()["meta_info"]["input_token_logprobs"]
        start = next((i for i, (a, (_, b, _)) in enumerate(zip(prefix_ids, entries)) if a != b), len(prefix_ids))
        scores.append(sum(lp for lp, _, _ in entries[start:] if lp is not None))
    return scores


@pytest.mark.parametrize("prefix", [PREFIX, PREFIX + " "], ids=["clean-boundary", "merging-boundary"])
def test_select_picks_the_most_likely_choice(backend: RuntimeEndpoint, server: Server, prefix: str) -> None:
    choices = [c.lstrip() for c in CHOICES] if prefix.endswith(" ") else CHOICES
    state = pick.run(prefix=prefix, choices=choices, backend=backend)
    meta = state.get_meta_info("answer")
    direct = _direct_scores(server, prefix, choices)
    for got, want in zip(meta["logprobs"], direct):
        assert math.isclose(got, want, abs_tol=2e-2), (meta["logprobs"], direct)
    assert state["answer"] == choices[max(range(len(direct)), key=direct.__getitem__)]
    assert state.text() == prefix + state["answer"]


@function
def two_turns(s):
    s += system("You are terse.")
    s += user("Say hello.")
    s += assistant(gen("reply", max_tokens=6))
    with s.user():
        s += "Now say goodbye."
    s += assistant(gen("reply2", max_tokens=6))


def test_role_blocks_render_the_servers_chat_template(backend: RuntimeEndpoint, server: Server) -> None:
    state = two_turns.run(backend=backend, temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[4]["content"] == state["reply2"]
    rendered = server.post("/apply_chat_template", {"messages": messages, "add_generation_prompt": False})
    assert rendered.json()["text"] == state.text()


@function
def story(s):
    s += "Once upon a time"
    s += gen("rest", max_tokens=8, ignore_eos=True)
    s += " The end."


def test_streaming_yields_the_text_as_it_is_written(backend: RuntimeEndpoint) -> None:
    state = story.run(backend=backend, stream=True, temperature=0)
    chunks = list(state)
    assert "".join(chunks) == state.text()
    assert chunks[0] == "Once upon a time" and chunks[-1] == " The end."
    assert len(chunks) >= 4  # the generated text arrived in several pieces


@function
def constrained(s):
    s += "Pick a number between 100 and 999 and say if it is even: "
    s += gen("answer", regex=r"[1-9][0-9]{2} (even|odd)", max_tokens=12)


def test_regex_constrains_gen(backend: RuntimeEndpoint) -> None:
    state = constrained.run(backend=backend, temperature=0.7, seed=3)
    assert re.fullmatch(r"[1-9][0-9]{2} (even|odd)", state["answer"]), state["answer"]


def test_server_errors_surface_when_reading(backend: RuntimeEndpoint) -> None:
    @function
    def bad(s: ProgramState) -> None:
        s += "Hello" + gen("x", temperature=-1.0)

    with pytest.raises(RadixMeshError) as info:
        bad.run(backend=backend)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.param == "temperature"
    with pytest.raises(RadixMeshError) as refused:
        RuntimeEndpoint(backend.base_url, api_key="wrong")
    assert refused.value.code is ErrorCode.UNAUTHENTICATED


def test_run_batch_keeps_the_order(backend: RuntimeEndpoint) -> None:
    states = pick.run_batch([{"prefix": PREFIX, "choices": CHOICES[:2]},
                             {"prefix": "Q: What is 2 + 2?\nA:", "choices": [" 4", " 5"]}],
                            backend=backend, num_threads=2)
    assert states[0].text().startswith(PREFIX) and states[1].text().startswith("Q: What is 2 + 2?")
    assert all(s["answer"] in c for s, c in zip(states, [CHOICES[:2], [" 4", " 5"]]))
