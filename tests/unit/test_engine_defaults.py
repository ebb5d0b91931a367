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
