"""The fault proxy of `bench faults`: pass-through, added latency, cut connections; the load summary."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from radixmesh.cluster.faults.load import RequestRecord, summarize
from radixmesh.cluster.faults.proxy import FaultProxy


@pytest.fixture
def echo() -> Iterator[str]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)


def _round_trip_s(address: str, payload: bytes = b"ping") -> float:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(payload)
        assert sock.recv(4096) == payload
        return time.monotonic() - start


def test_pass_delay_and_cut(echo: str) -> None:
    proxy = FaultProxy(echo, delay_s=0.5).start()
    try:
        assert _round_trip_s(proxy.address) < 0.5  # pass adds nothing (a delayed leg alone takes 0.5 s)
        proxy.set_mode("delay")
        assert _round_trip_s(proxy.address) >= 1.0  # 0.5 s each way
        host, port = proxy.address.rsplit(":", 1)
        proxy.set_mode("pass")
        with socket.create_connection((host, int(port)), timeout=10) as open_conn:
            open_conn.sendall(b"x")
            assert open_conn.recv(10) == b"x"
            proxy.set_mode("cut")
            with pytest.raises(OSError):  # the open connection is reset
                open_conn.sendall(b"y")
                if not open_conn.recv(10):
                    raise ConnectionResetError
        with socket.create_connection((host, int(port)), timeout=10) as new_conn, pytest.raises(OSError):
            new_conn.sendall(b"z")  # a new one is accepted, then reset at once
            if not new_conn.recv(10):
                raise ConnectionResetError
        proxy.set_mode("pass")
        assert _round_trip_s(proxy.address) < 1.0
    finally:
        proxy.stop()


def test_summary_counts_failures_of_requests_without_a_token_at_the_fault() -> None:
    records = [RequestRecord("chat", 0.0, 0.5, 3.0, "completed"),
               RequestRecord("chat", 0.0, 0.5, 1.2, "failed", "cut mid-stream"),  # streaming at the fault
               RequestRecord("chat", 0.8, None, 1.5, "failed", "HTTP 503"),  # no token yet
               RequestRecord("chat", 0.7, None, 1.3, "failed", "worker w failed mid-stream: reset"),  # tokens en route
               RequestRecord("chat", 1.1, None, None, "hung", "no end"),
               RequestRecord("chat", 0.1, 0.2, 0.4, "failed", "before the fault"),
               RequestRecord("chat", 2.0, 2.2, 2.4, "aborted")]
    summary = summarize(records, fault_s=1.0)
    assert (summary["sent"], summary["completed"], summary["failed_clear"], summary["hung"],
            summary["aborted"]) == (7, 1, 4, 1, 1)
    assert summary["failed_no_text_at_fault"] == 3
    assert summary["failed_not_started"] == 2
    assert summary["first_failure_s"] == pytest.approx(0.2)
