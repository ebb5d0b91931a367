"""The nixl transport's parts around one READ, without NIXL: the staging buffer's regions, the remote agents
held (LRU, metadata checks), and a posted READ's states (done, failed, cancelled, a handle that will not go)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.disagg.transport.nixl_read import STAGING_UNIT_BYTES, PendingRead, RemoteAgents, StagingBuffer


class FakeAgent:
    """The few calls of a nixl_agent these parts make, recorded; states and failures set by the test."""

    def __init__(self) -> None:
        self.added: list[bytes] = []
        self.removed: list[str] = []
        self.released: list[Any] = []
        self.states: list[str] = []
        self.add_error: Exception | None = None
        self.remove_error: Exception | None = None
        self.check_error: Exception | None = None
        self.release_errors: int = 0

    def add_remote_agent(self, metadata: bytes) -> bytes:
        if self.add_error is not None:
            raise self.add_error
        self.added.append(metadata)
        return metadata.split(b"|")[0]  # the test's metadata starts with the agent name

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)
        if self.remove_error is not None:
            raise self.remove_error

    def check_xfer_state(self, handle: Any) -> str:
        if self.check_error is not None:
            raise self.check_error
        return self.states.pop(0)

    def release_xfer_handle(self, handle: Any) -> None:
        if self.release_errors:
            self.release_errors -= 1
            raise RuntimeError("busy")
        self.released.append(handle)


# ---- StagingBuffer ----------------------------------------------------------------------------------------
def test_staging_rounds_up_to_units_and_hands_out_disjoint_regions() -> None:
    buf = StagingBuffer(4 * STAGING_UNIT_BYTES + 100, torch.device("cpu"))
    assert buf.num_units == 4 and buf.nbytes == 4 * STAGING_UNIT_BYTES
    assert buf.address == buf.tensor.data_ptr()
    a = buf.allocate("a", 1)  # one byte still takes a whole unit
    b = buf.allocate("b", STAGING_UNIT_BYTES + 1)  # two units
    assert a == 0 and b == STAGING_UNIT_BYTES and buf.num_regions == 2
    c = buf.allocate("c", STAGING_UNIT_BYTES)
    assert c == 3 * STAGING_UNIT_BYTES
    assert buf.allocate("d", 1) is None  # full
    buf.free("b")
    assert buf.num_regions == 2 and buf.allocate("d", 2 * STAGING_UNIT_BYTES) == STAGING_UNIT_BYTES


def test_staging_refuses_a_region_larger_than_the_buffer_and_zero_is_one_unit() -> None:
    buf = StagingBuffer(2 * STAGING_UNIT_BYTES, torch.device("cpu"))
    assert buf.allocate("big", 3 * STAGING_UNIT_BYTES) is None and buf.num_regions == 0
    assert buf.allocate("zero", 0) == 0 and buf.allocate("next", 1) == STAGING_UNIT_BYTES
    tiny = StagingBuffer(10, torch.device("cpu"))  # below one unit: still one unit
    assert tiny.num_units == 1 and tiny.allocate("x", STAGING_UNIT_BYTES) == 0


def test_staging_view_is_a_typed_window_on_the_region() -> None:
    buf = StagingBuffer(2 * STAGING_UNIT_BYTES, torch.device("cpu"))
    offset = buf.allocate("t", 3 * 4 * 2)
    assert offset is not None
    view = buf.view(offset, (3, 4), torch.float16)
    assert view.shape == (3, 4) and view.dtype == torch.float16
    view.copy_(torch.arange(12, dtype=torch.float16).view(3, 4))
    again = buf.view(offset, (12,), torch.float16)
    assert again.tolist() == list(range(12))  # the same bytes of the one registered tensor
    other = buf.view(STAGING_UNIT_BYTES, (2,), torch.int32)
    other.fill_(7)
    assert buf.view(offset, (12,), torch.float16).tolist() == list(range(12))


# ---- RemoteAgents -------------------------------------------------------------------------------------------
def test_ensure_loads_metadata_once_and_keeps_recent_agents() -> None:
    agent = FakeAgent()
    agents = RemoteAgents(agent, max_agents=2)
    agents.ensure("p0", b"p0|meta")
    agents.ensure("p0", b"")  # held: no metadata needed, nothing loaded again
    assert agent.added == [b"p0|meta"] and agents.names == ["p0"]
    agents.ensure("p1", b"p1|meta")
    agents.ensure("p0", b"")  # p0 becomes the most recent
    agents.ensure("p2", b"p2|meta")  # over the limit: the least recently used (p1) goes
    assert agents.names == ["p0", "p2"] and agent.removed == ["p1"]


def test_ensure_without_metadata_for_an_unknown_agent_is_unavailable() -> None:
    agents = RemoteAgents(FakeAgent())
    with pytest.raises(RadixMeshError) as err:
        agents.ensure("p0", b"")
    assert err.value.code is ErrorCode.UNAVAILABLE and "p0" in err.value.message
    assert agents.names == []


def test_metadata_that_fails_to_load_is_unavailable() -> None:
    agent = FakeAgent()
    agent.add_error = ValueError("bad blob")
    agents = RemoteAgents(agent)
    with pytest.raises(RadixMeshError) as err:
        agents.ensure("p0", b"p0|x")
    assert err.value.code is ErrorCode.UNAVAILABLE and "bad blob" in err.value.message
    assert agents.names == []


def test_metadata_of_another_agent_is_refused_and_unloaded() -> None:
    agent = FakeAgent()
    agents = RemoteAgents(agent)
    with pytest.raises(RadixMeshError) as err:
        agents.ensure("p0", b"p9|meta")
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and "p9" in err.value.message
    assert agent.removed == ["p9"] and agents.names == []


def test_forget_drops_a_held_agent_and_ignores_unknown_ones() -> None:
    agent = FakeAgent()
    agents = RemoteAgents(agent)
    agents.ensure("p0", b"p0|m")
    agents.forget("nobody")
    assert agent.removed == []
    agent.remove_error = RuntimeError("already gone")  # NIXL's side forgot it first: still dropped here
    agents.forget("p0")
    assert agents.names == [] and agent.removed == ["p0"]
    with pytest.raises(RadixMeshError):
        agents.ensure("p0", b"")  # its metadata is needed again


def test_remote_agents_needs_room_for_one() -> None:
    with pytest.raises(AssertionError, match="max_agents"):
        RemoteAgents(FakeAgent(), max_agents=0)


# ---- PendingRead --------------------------------------------------------------------------------------------
def make_read(agent: FakeAgent) -> tuple[PendingRead, list[str]]:
    events: list[str] = []
    read = PendingRead(agent, handle="h1", peer="prefill-0", lease_s=5.0,
                       on_done=lambda r: events.append("done"),
                       on_failed=lambda r, why: events.append(f"failed:{why}"))
    return read, events


def test_read_is_done_after_processing_and_stays_done() -> None:
    agent = FakeAgent()
    agent.states = ["PROC", "PROC", "DONE"]
    read, events = make_read(agent)
    assert read.lease_s == 5.0 and read.is_open
    assert not read.poll() and not read.poll() and events == []
    assert read.poll() and read.state == "done" and not read.is_open
    assert read.poll()  # stays True without asking NIXL again
    assert events == ["done"] and agent.released == ["h1"]
    assert read.cancel()  # nothing writes the slots any more
    assert events == ["done"]


def test_read_error_state_fails_once_and_raises_on_every_poll() -> None:
    agent = FakeAgent()
    agent.states = ["ERR"]
    read, events = make_read(agent)
    for _ in range(2):
        with pytest.raises(RadixMeshError) as err:
            read.poll()
        assert err.value.code is ErrorCode.UNAVAILABLE and "prefill-0" in err.value.message
    assert read.state == "failed" and agent.released == ["h1"]
    assert events == [f"failed:{read.error}"] and "the transfer failed" in read.error


def test_read_whose_peer_disconnected_fails_naming_the_exception() -> None:
    agent = FakeAgent()
    agent.check_error = ConnectionError("peer gone")
    read, events = make_read(agent)
    with pytest.raises(RadixMeshError, match="ConnectionError: peer gone"):
        read.poll()
    assert len(events) == 1 and events[0].startswith("failed:")


def test_a_finished_handle_that_cannot_be_released_still_finishes() -> None:
    agent = FakeAgent()
    agent.states = ["DONE"]
    agent.release_errors = 1
    read, events = make_read(agent)
    assert read.poll() and events == ["done"]


def test_cancel_releases_the_handle_or_reports_that_it_could_not() -> None:
    agent = FakeAgent()
    agent.release_errors = 1
    read, events = make_read(agent)
    assert not read.cancel() and read.is_open and events == []  # still running: poll until it ends
    assert read.cancel() and read.state == "cancelled" and events == ["failed:cancelled"]
    assert read.cancel() and events == ["failed:cancelled"]  # once only
    assert read.poll() is False


def test_wait_blocks_until_done_and_raises_when_failed() -> None:
    agent = FakeAgent()
    agent.states = ["PROC", "PROC", "PROC", "DONE"]
    read, _ = make_read(agent)
    read.wait()
    assert read.state == "done" and agent.states == []
    failing = FakeAgent()
    failing.states = ["PROC", "ERR"]
    bad, _ = make_read(failing)
    with pytest.raises(RadixMeshError):
        bad.wait()
