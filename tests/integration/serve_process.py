"""`radixmesh serve` as a process under test: its URL, its PID, its log, the API key its tests pass."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

API_KEY = "sk-radixmesh-test"
STARTUP_TIMEOUT_S = 600.0


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=60, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=120, **kwargs)

    def server_info(self) -> dict[str, Any]:
        response = self.get("/server_info")
        assert response.status_code == 200, response.text
        info: dict[str, Any] = response.json()
        return info


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"radixmesh serve exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"radixmesh serve did not become healthy:\n{log_path.read_text()}")
