"""Leaving a tensor-parallel group: CUDA graphs go first, and a teardown that never returns cannot hang
the worker's shutdown."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from radixmesh import cli
from radixmesh.engine.distributed import leader
from radixmesh.engine.model_runner import ModelRunner


def test_close_releases_the_graphs_before_leaving_the_group() -> None:
    calls: list[str] = []
    runner = object.__new__(ModelRunner)
    runner.graph_runner = SimpleNamespace(release=lambda: calls.append("release graphs"))
    runner.tp_leader = SimpleNamespace(close=lambda: calls.append("leave group"))
    runner.close()
    assert calls == ["release graphs", "leave group"]


def test_a_teardown_that_never_returns_is_left_behind(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    never, entered = threading.Event(), threading.Event()
    seen: list[bool] = []

    def stuck_destroy(abort: bool = False) -> None:
        seen.append(abort)
        entered.set()
        never.wait(30)

    monkeypatch.setattr(leader.TorchCommunicator, "destroy", staticmethod(stuck_destroy))
    monkeypatch.setattr(leader, "TEARDOWN_TIMEOUT_S", 0.2)
    monkeypatch.setattr(leader, "GROUP_LEFT_UNFINISHED", False)
    start = time.monotonic()
    leader._leave_group(abort=True)
    assert time.monotonic() - start < 5
    assert entered.wait(10) and seen == [True]  # a loaded machine may start the thread after the 0.2 s join
    assert "did not finish within" in caplog.text
    assert leader.GROUP_LEFT_UNFINISHED
    exits: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    cli._exit_now_if_a_group_is_stuck(3)  # the command's code, without the destructor that would abort
    assert exits == [3]
    never.set()


def test_a_normal_exit_runs_the_destructors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leader, "GROUP_LEFT_UNFINISHED", False)
    exits: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    cli._exit_now_if_a_group_is_stuck(0)
    assert exits == []


class _StuckRank:
    """A rank process that ignores the stop message until it is killed."""

    pid = 4242

    def __init__(self) -> None:
        self.killed = False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def wait(self, timeout: float | None = None) -> int:
        if not self.killed:
            raise leader.subprocess.TimeoutExpired("rank", timeout or 0)
        return -9

    def kill(self) -> None:
        self.killed = True


def test_a_rank_killed_at_close_marks_the_group_unfinished(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import zmq

    monkeypatch.setattr(leader, "GROUP_LEFT_UNFINISHED", False)
    monkeypatch.setattr(leader, "STOP_TIMEOUT_S", 0.1)
    monkeypatch.setattr(leader, "_leave_group", lambda abort: None)
    rank = _StuckRank()
    lead = object.__new__(leader.TpLeader)
    ctx = zmq.Context()
    lead._closed, lead._sends, lead._procs, lead._ctx = False, [], [rank], ctx
    lead._status, lead._dir = ctx.socket(zmq.PULL), str(tmp_path / "tp")
    lead.close()
    assert rank.killed and leader.GROUP_LEFT_UNFINISHED


def test_the_cli_closes_a_group_the_command_left_open_before_it_decides_how_to_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that returns without closing its engine (the benchmarks) must not leave the group to `atexit`,
    where a teardown still running aborts the interpreter's finalization."""
    order: list[str] = []

    class _Open:
        def close(self) -> None:
            order.append("closed")
            leader._OPEN.discard(self)
            leader._mark_group_unfinished()  # its teardown got stuck

    monkeypatch.setattr(leader, "GROUP_LEFT_UNFINISHED", False)
    lead = _Open()
    leader._OPEN.add(lead)  # type: ignore[arg-type]
    exits: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: (order.append("exit"), exits.append(code)))
    cli._exit_now_if_a_group_is_stuck(0)
    assert order == ["closed", "exit"] and exits == [0]
    assert lead not in leader._OPEN
