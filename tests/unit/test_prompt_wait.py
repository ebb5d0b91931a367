"""Launch pacing waits for a prompt the front end is tokenizing (scheduler/pacing.py): the front end says it is
coming, the scheduler reads the running decode step's tokens and launches nothing more until the prompt arrives or
its bounded wait runs out, then prefills it first."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from fastapi.testclient import TestClient

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.engine.scheduler import pacing
from radixmesh.engine.scheduler.loop import SchedulerLoop
from radixmesh.engine.scheduler.pacing import (
    MAX_PROMPT_WAIT_S,
    PROMPT_HOP_S,
    PROMPT_SLACK,
    LaunchPacer,
    PacingHook,
)
from radixmesh.gateway.app import create_app
from radixmesh.gateway.config import GatewayConfig
from radixmesh.gateway.local_backend import LocalEngineBackend
from radixmesh.wire.messages import PromptComingMsg, encoder, to_scheduler_decoder
from tests.unit.test_launch_pacing import FakeCuda
from tests.unit.test_serve_tokenize import ScriptedEngineClient
from tests.unit.test_tokenize_pool import random_text

from .scheduler_factory import assert_no_leak, clone, make_requests, make_scheduler, single_run_outputs


def _hook(wait: bool = True) -> PacingHook:
    return PacingHook(SimpleNamespace(), LaunchPacer(FakeCuda()), wait)  # type: ignore[arg-type]


def test_an_announced_prompt_is_waited_for_a_bounded_time_and_its_arrival_ends_the_wait() -> None:
    hook = _hook()
    assert hook.prompt_deadline() is None
    before = time.perf_counter()
    hook.prompt_coming(0.004)
    after = time.perf_counter()
    deadline = hook.prompt_deadline()
    wait_s = PROMPT_SLACK * 0.004 + PROMPT_HOP_S
    assert deadline is not None and before + wait_s <= deadline <= after + wait_s
    hook.prompt_coming(5.0)  # a long text: never more than the cap
    assert max(hook.awaited) <= time.perf_counter() + MAX_PROMPT_WAIT_S
    assert hook.prompt_deadline() == deadline  # the earliest one
    hook.take_request(SimpleNamespace())  # type: ignore[arg-type]
    hook.take_request(SimpleNamespace())  # type: ignore[arg-type]
    assert hook.prompt_deadline() is None
    hook.take_request(SimpleNamespace())  # type: ignore[arg-type]  (an unannounced request: nothing to end)
    hook.prompt_coming(0.0)  # only the hop's allowance, then it is given up
    time.sleep(PROMPT_HOP_S * 2)
    assert hook.prompt_deadline() is None and not hook.awaited


def test_with_the_flag_no_prompt_is_waited_for() -> None:
    hook = _hook(wait=False)
    hook.prompt_coming(0.004)
    assert hook.prompt_deadline() is None
    from radixmesh.cli import build_parser
    from radixmesh.engine.args import engine_kwargs

    args = build_parser("generate").parse_args(["generate", "--disable-prompt-wait", "--prompt", "hi"])
    assert engine_kwargs(args)["disable_prompt_wait"] is True
    for disabled in (False, True):
        sched = SimpleNamespace(config=EngineConfig(device="cpu", overlap_schedule="on", disable_prompt_wait=disabled),
                                runner=SimpleNamespace(device=SimpleNamespace(type="cuda")))
        hook = pacing.create_hook(sched)  # type: ignore[arg-type]
        assert hook is not None and hook.wait_for_prompts is not disabled


def test_the_scheduler_prefills_an_awaited_prompt_first_and_outputs_do_not_change() -> None:
    reqs = make_requests(4, seed=11, max_new_tokens=10)
    expected = single_run_outputs(reqs)
    sched, col = make_scheduler(overlap_schedule="on")
    cuda = FakeCuda()
    sched.hooks.add(PacingHook(sched, LaunchPacer(cuda)), first=True)
    assert sched.prompt_deadline() is None  # nothing in flight
    for req in reqs[:3]:
        sched.add_request(clone(req))
    late = clone(reqs[3])
    waits = 0
    while sched.has_work or late is not None:
        cuda.now_ms += 1.0
        cuda.done_ms = cuda.now_ms - 1.5
        in_flight = sched.in_flight
        if late is not None and in_flight is not None and in_flight.batch.is_decode and not sched.prefill.waiting:
            sched.prompt_coming(0.05)  # announced while a decode step runs and nobody waits
            assert sched.prompt_deadline() is not None
            sched.process_in_flight()  # the loop reads the running step's tokens, launches nothing
            assert sched.in_flight is None and sched.prompt_deadline() is None  # nothing in flight: no wait
            sched.add_request(late)  # the prompt arrives
            late = None
            waits += 1
            sched.step()
            launched = sched.in_flight
            assert launched is not None and not launched.batch.is_decode  # its prefill, on an idle device
            assert [r.rid for r in launched.batch.reqs] == [reqs[3].rid]
            continue
        sched.step()
    assert waits == 1
    assert col.tokens == expected  # waiting changes when, never what
    assert_no_leak(sched)


class FakeScheduler:
    """Records the loop's calls; one iteration, then the loop stops."""

    def __init__(self, loop_ref: list[SchedulerLoop], prompt_wait_s: float | None) -> None:
        self.calls: list[str] = []
        self.loop_ref = loop_ref
        self.prompt_wait_s = prompt_wait_s
        self.announced: list[float] = []

    def launch_deadline(self) -> float:
        self.calls.append("launch_deadline")
        return time.perf_counter() - 1.0  # already past: no hold

    def prompt_deadline(self) -> float | None:
        self.calls.append("prompt_deadline")
        return None if self.prompt_wait_s is None else time.perf_counter() + self.prompt_wait_s

    def process_in_flight(self) -> bool:
        self.calls.append("process_in_flight")
        return True

    def prompt_coming(self, tokenize_s: float) -> None:
        self.announced.append(tokenize_s)

    def step(self) -> bool:
        self.calls.append("step")
        self.loop_ref[0].stopping = True
        return True


@pytest.mark.parametrize("prompt_wait_s", [None, 0.06])
def test_the_loop_reads_the_running_step_then_listens_for_the_prompt(prompt_wait_s: float | None) -> None:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = recv.bind_to_random_port("tcp://127.0.0.1")
    send.connect(f"tcp://127.0.0.1:{port}")
    loops: list[SchedulerLoop] = []
    sched = FakeScheduler(loops, prompt_wait_s)
    loop = SchedulerLoop(scheduler=sched, send=send)  # type: ignore[arg-type]
    loops.append(loop)
    try:
        loop.handle(to_scheduler_decoder.decode(encoder.encode(PromptComingMsg(0.003))))
        assert sched.announced == [0.003]
        start = time.perf_counter()
        loop.run(recv)
        waited = time.perf_counter() - start
    finally:
        recv.close(0)
        send.close(0)
    if prompt_wait_s is None:
        assert sched.calls == ["launch_deadline", "prompt_deadline", "step"]
    else:
        assert sched.calls == ["launch_deadline", "prompt_deadline", "process_in_flight", "step"]
        assert 0.04 <= waited <= 2.0  # it listened until the wait ran out (2 s: a loaded machine)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


class AnnouncingClient(ScriptedEngineClient):
    def __init__(self, prepared: Any, tokenizer: Any) -> None:
        super().__init__(prepared, tokenizer)
        self.announced: list[tuple[float, int]] = []  # (estimate, prompts the engine had been sent by then)

    async def prompt_coming(self, tokenize_s: float) -> None:
        self.announced.append((tokenize_s, len(self.prompts)))


def test_serves_front_end_announces_a_text_prompt_before_tokenizing_it(default_model_dir: Path,
                                                                       tokenizer: Any) -> None:
    prepared = prepare_model(str(default_model_dir), need_weights=False)
    client = AnnouncingClient(prepared, tokenizer)
    backend = LocalEngineBackend(client, tokenizer_workers=2)
    pool = backend.tokenize_pool
    assert pool is not None
    text = random_text(tokenizer, 1500, seed=4)
    with TestClient(create_app(backend, GatewayConfig())) as http:
        assert http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1}).status_code == 200
        assert client.announced == []  # token ids: nothing to tokenize, nothing announced
        default_rate = pool.s_per_char
        reply = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        assert reply.status_code == 200, reply.text
        assert client.announced == [(pytest.approx(len(text) * default_rate), 1)]  # before its ids were sent
        assert pool.s_per_char != default_rate  # the estimate follows what encoding took
        rate_then = pool.s_per_char
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                       "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert len(client.announced) == 2 and client.announced[1][1] == 2  # the conversation's, before its ids
        assert client.announced[1][0] == pytest.approx(len(text) * rate_then)
