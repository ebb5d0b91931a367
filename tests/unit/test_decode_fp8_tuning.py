"""RADIXMESH_DECODE_FP8_TILES / _WIDEN: read and checked in one place, applied to decode over FP8 pools only."""

from __future__ import annotations

from typing import Any

import pytest

from radixmesh.common.env import DecodeFp8Tuning, decode_fp8_tuning
from radixmesh.common.errors import RadixMeshError


def test_unset_means_the_kernel_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXMESH_DECODE_FP8_TILES", raising=False)
    monkeypatch.delenv("RADIXMESH_DECODE_FP8_WIDEN", raising=False)
    assert decode_fp8_tuning() == DecodeFp8Tuning() and decode_fp8_tuning().is_default


def test_settings_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXMESH_DECODE_FP8_TILES", " 128,4,3 ")
    monkeypatch.setenv("RADIXMESH_DECODE_FP8_WIDEN", "f16")
    assert decode_fp8_tuning() == DecodeFp8Tuning((128, 4, 3), "f16")


@pytest.mark.parametrize(("tiles", "widen", "param"), [
    ("128,4", "f32", "TILES"), ("a,b,c", "f32", "TILES"), ("96,4,2", "f32", "TILES"), ("512,4,2", "f32", "TILES"),
    ("128,3,2", "f32", "TILES"), ("128,4,0", "f32", "TILES"), ("", "bf16", "WIDEN")])
def test_malformed_settings_are_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, tiles: str, widen: str,
                                                            param: str) -> None:
    monkeypatch.setenv("RADIXMESH_DECODE_FP8_TILES", tiles)
    monkeypatch.setenv("RADIXMESH_DECODE_FP8_WIDEN", widen)
    with pytest.raises(RadixMeshError) as info:
        decode_fp8_tuning()
    assert info.value.param == f"RADIXMESH_DECODE_FP8_{param}"


def test_widenings_match_the_kernel() -> None:
    from radixmesh.common.env import DECODE_FP8_WIDENS
    from radixmesh.kernels.decode_attention import FP8_WIDENS

    assert DECODE_FP8_WIDENS == FP8_WIDENS


@pytest.mark.parametrize("pool_dtype", ["float8_e4m3fn", "bfloat16"])
def test_the_backend_launches_fp8_decode_with_the_settings(monkeypatch: pytest.MonkeyPatch, pool_dtype: str) -> None:
    import torch

    from radixmesh.engine.attention import triton_backend

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(triton_backend, "decode_attention_fwd", lambda *args, **kwargs: calls.append(kwargs))
    backend = triton_backend.TritonBackend(fp8_tuning=DecodeFp8Tuning((128, 8, 3), "direct"))
    dtype = getattr(torch, pool_dtype)
    k_buf = torch.zeros(8, 1, 16, dtype=dtype)

    class Pool:
        def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
            return k_buf, k_buf

        def scales(self, layer_id: int) -> tuple[float, float]:
            return 1.0, 1.0

    class Batch:
        is_decode, batch_size, token_to_kv_pool = True, 1, Pool()

    class Layer:
        layer_id, num_heads, num_kv_heads, head_dim, scaling = 0, 1, 1, 16, 0.25

    backend.metadata = triton_backend.TritonForwardMetadata(torch.zeros(2, dtype=torch.int64),
                                                            torch.zeros(1, dtype=torch.int64), None, 0, 1,
                                                            scratch=object())  # type: ignore[arg-type]
    q = torch.zeros(1, 16, dtype=torch.bfloat16)
    backend.forward(q, q, q, Layer(), Batch(), save_kv=False)  # type: ignore[arg-type]
    expected = {"tiles": (128, 8, 3), "fp8_widen": "direct"} if pool_dtype.startswith("float8") else \
        {"tiles": None, "fp8_widen": "f32"}
    expected["rope"] = None  # (a plain decode pass: the rotary was done before the attention)
    assert calls == [expected]
