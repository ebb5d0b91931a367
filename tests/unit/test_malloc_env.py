"""The CPU malloc settings reach the processes the engine spawns, without overriding the user's."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from radixmesh.engine.malloc_env import CPU_MALLOC_ENV, compute_env, spawn_env


def test_cpu_gets_the_settings_and_the_users_values_win() -> None:
    env = compute_env("cpu", {"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "0"})
    assert env["PATH"] == "/bin" and env["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert env["MALLOC_MMAP_THRESHOLD_"] == CPU_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert compute_env("cuda", {"PATH": "/bin"}) == {"PATH": "/bin"}


def _child_env(queue: mp.Queue) -> None:
    queue.put({name: os.environ.get(name) for name in CPU_MALLOC_ENV})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_spawned_child_sees_them_and_the_parent_is_restored(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CPU_MALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with spawn_env(device):
        proc = ctx.Process(target=_child_env, args=(queue,))
        proc.start()
    seen = queue.get(timeout=60)
    proc.join(timeout=60)
    assert seen == (CPU_MALLOC_ENV if device == "cpu" else dict.fromkeys(CPU_MALLOC_ENV))
    assert not any(name in os.environ for name in CPU_MALLOC_ENV)
