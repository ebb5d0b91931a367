"""Engine defaults that depend on the device."""

from __future__ import annotations

import pytest


def test_mem_fraction_defaults_by_device_memory() -> None:
    from radixmesh.common.errors import RadixMeshError
    from radixmesh.engine.config import EngineConfig

    cfg = EngineConfig(model="m")
    assert cfg.mem_fraction(80 << 30) == 0.9  # an H100: more of it for the KV pool
    assert cfg.mem_fraction(24 << 30) == 0.85  # a smaller GPU keeps more headroom
    assert cfg.mem_fraction(None) == 0.85  # the CPU's share of free RAM
    assert EngineConfig(model="m", mem_fraction_static=0.5).mem_fraction(80 << 30) == 0.5
    with pytest.raises(RadixMeshError, match="mem_fraction_static"):
        EngineConfig(model="m", mem_fraction_static=1.5)


@pytest.mark.parametrize(("device_bytes", "chunk"), [
    (None, 4096),  # the CPU
    (24 << 30, 2048),  # an L4 or a 4090
    (48 << 30, 4096),  # an L40S
    (80 << 30, 8192),  # an H100
    (141 * 10**9, 8192),  # an H200
    (192 << 30, 16384),  # a B200
])
def test_chunked_prefill_size_defaults_by_device_memory(device_bytes, chunk) -> None:
    from radixmesh.engine.config import EngineConfig

    cfg = EngineConfig(model="m")
    assert cfg.chunked_prefill_size is None and cfg.chunk_size == 4096  # unset until the device is known
    resolved = cfg.with_device_memory(device_bytes)
    assert resolved.chunked_prefill_size == chunk == resolved.prefill_token_budget
    assert resolved.chunking_enabled
    # a size given on the command line, or chunking turned off, stays as given
    assert EngineConfig(model="m", chunked_prefill_size=512).with_device_memory(device_bytes).chunk_size == 512
    off = EngineConfig(model="m", chunked_prefill_size=-1, max_prefill_tokens=999).with_device_memory(device_bytes)
    assert not off.chunking_enabled and off.prefill_token_budget == 999


def test_scheduler_takes_the_runners_chunk_size() -> None:
    from .scheduler_factory import make_scheduler

    sched, _ = make_scheduler()
    assert sched.runner.config.chunked_prefill_size == 4096  # the runner filled it in (the CPU's size)
    assert sched.config.chunked_prefill_size == 4096 == sched.config.prefill_token_budget
    assert sched.stats()["chunked_prefill_size"] == 4096
