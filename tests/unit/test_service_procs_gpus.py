"""The test harness's GPU choice for service processes: indices into the GPUs the suite itself was given."""

from __future__ import annotations

import pytest

from tests.integration.service_procs import within_visible_gpus


def test_indices_map_into_the_suites_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert within_visible_gpus({"CUDA_VISIBLE_DEVICES": "1,0", "X": "y"}) == {"CUDA_VISIBLE_DEVICES": "3,2", "X": "y"}
    with pytest.raises(ValueError, match="does not see"):
        within_visible_gpus({"CUDA_VISIBLE_DEVICES": "2"})


def test_without_a_visible_list_indices_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert within_visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert within_visible_gpus({}) == {}
