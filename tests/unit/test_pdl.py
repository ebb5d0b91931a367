"""The PDL switch (`radixmesh.kernels._pdl`): which launches take programmatic dependent launch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest
import torch

from radixmesh.kernels import _pdl


@pytest.fixture(autouse=True)
def _restore() -> None:
    yield
    _pdl.set_pdl(True)


def test_cpu_launches_never_take_pdl() -> None:
    assert not _pdl.pdl_enabled(torch.device("cpu"))
    assert _pdl.pdl_args(torch.device("cpu")) == {"PDL": False}


def test_hopper_takes_pdl_unless_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pdl, "AVAILABLE", True)
    monkeypatch.setattr(_pdl, "_supports", lambda index: index == 0)  # device 0 is sm_90, device 1 older
    assert _pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert _pdl.pdl_args(torch.device("cuda", 1)) == {"PDL": False}
    _pdl.set_pdl(False)
    assert _pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": False}
    _pdl.set_pdl(True)
    assert _pdl.pdl_enabled(torch.device("cuda", 0))


def test_without_triton_support_nothing_takes_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pdl, "AVAILABLE", False)
    monkeypatch.setattr(_pdl, "_supports", lambda index: True)
    assert _pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": False}


def test_the_engine_flag_exists() -> None:
    from radixmesh.engine.config import EngineConfig

    assert EngineConfig(model="m").disable_pdl is False
    assert EngineConfig(model="m", disable_pdl=True).disable_pdl is True

