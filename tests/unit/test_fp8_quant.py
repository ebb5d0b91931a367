"""FP8 quantization options: config checks, checkpoint formats, the weight adapter, device requirements."""

from __future__ import annotations

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.quant.checkpoint import parse_quantization_config
from radixmesh.engine.quant.device import require_fp8, resolve_kv_dtype
from radixmesh.engine.quant.weights import Fp8WeightAdapter, checkpoint_modules, target_param
from radixmesh.kernels.fp8_ref import dequantize_rows, quantize_rows

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("field,value,match", [
    ("quantization", "awq", "quantization must be one of fp8"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype must be one of auto, fp8_e4m3, fp8_e5m2"),
    ("fp8_gemm_backend", "cublas", "fp8_gemm_backend must be one of auto, scaled-mm, triton"),
])
def test_config_rejects_unknown_values(field: str, value: str, match: str) -> None:
    with pytest.raises(RadixMeshError, match=match) as err:
        EngineConfig(**{field: value})
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and err.value.param == field


# ---- checkpoint formats ---------------------------------------------------------------------------------

def _ct(weights: dict, acts: dict | None = None, **extra: object) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            **extra}


FLOAT8 = {"type": "float", "num_bits": 8}


@pytest.mark.parametrize("cfg,source,scheme,ignore", [
    ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}, "fp8", "static",
     ("lm_head",)),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}, "fp8", "dynamic", ()),
    ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]}, "fbgemm_fp8", "dynamic", ("lm_head",)),
    (_ct({**FLOAT8, "strategy": "channel"}, {**FLOAT8, "strategy": "token", "dynamic": True}, ignore=["lm_head"]),
     "compressed-tensors", "dynamic", ("lm_head",)),
    (_ct({**FLOAT8, "strategy": "tensor"}, {**FLOAT8, "strategy": "tensor", "dynamic": False}),
     "compressed-tensors", "static", ()),
    (_ct({**FLOAT8, "strategy": "channel"}), "compressed-tensors", "none", ()),
])
def test_supported_checkpoint_formats(cfg: dict, source: str, scheme: str, ignore: tuple) -> None:
    quant = parse_quantization_config(cfg)
    assert quant is not None and quant.method == "fp8"
    assert (quant.source_format, quant.activation_scheme, quant.ignore) == (source, scheme, ignore)


@pytest.mark.parametrize("cfg,match", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-wise scales \(weight_block_size \[128, 128\]\)"),
    (_ct({**FLOAT8, "strategy": "block"}), "weight strategy 'block'"),
    (_ct({"type": "int", "num_bits": 8, "strategy": "channel"}), "int 8-bit weights; only float8"),
    (_ct({**FLOAT8, "strategy": "channel"}, {"type": "int", "num_bits": 8}), "quantizes activations to int 8-bit"),
    ({**_ct({**FLOAT8}), "format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
    ({"quant_method": "awq", "bits": 4}, "the checkpoint's quantization 'awq' is not supported"),
])
def test_unsupported_checkpoint_formats_are_refused_by_name(cfg: dict, match: str) -> None:
    with pytest.raises(RadixMeshError, match=match) as err:
        parse_quantization_config(cfg)
    assert err.value.code is ErrorCode.UNSUPPORTED


def test_ignore_lists_match_names_prefixes_and_patterns() -> None:
    quant = parse_quantization_config(_ct({**FLOAT8}, ignore=["lm_head", "re:.*layers\\.1\\..*", "model.layers.0.mlp"]))
    assert quant is not None
    assert quant.is_ignored("lm_head") and quant.is_ignored("model.layers.1.self_attn.q_proj")
    assert quant.is_ignored("model.layers.0.mlp.down_proj")
    assert not quant.is_ignored("model.layers.0.self_attn.q_proj")
    assert not quant.is_ignored("model.layers.10.mlp.up_proj")


def test_stacked_modules_map_to_their_checkpoint_sources() -> None:
    stacked = "model.layers.3.self_attn.qkv_proj.weight_scale"
    assert target_param("model.layers.3.self_attn.k_proj.weight_scale") == stacked
    assert target_param("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj.weight"
    assert checkpoint_modules("model.layers.0.mlp.gate_up_proj") == ["model.layers.0.mlp.gate_proj",
                                                                      "model.layers.0.mlp.up_proj"]
    assert checkpoint_modules("model.layers.0.self_attn.o_proj") == ["model.layers.0.self_attn.o_proj"]


# ---- the weight adapter ----------------------------------------------------------------------------------

def _params() -> dict[str, torch.Tensor]:
    return {"model.layers.0.self_attn.qkv_proj.weight": torch.empty(12, 8, dtype=E4M3),
            "model.layers.0.self_attn.qkv_proj.weight_scale": torch.empty(12),
            "model.layers.0.mlp.down_proj.weight": torch.empty(8, 16)}  # a layer the model keeps in float32


def test_adapter_pairs_scales_expands_per_tensor_and_drops_input_scales() -> None:
    gen = torch.Generator().manual_seed(0)
    q_w, q_s = quantize_rows(torch.randn(4, 8, generator=gen))  # per-channel
    k_w = torch.randn(4, 8, generator=gen).to(E4M3)  # per-tensor: one scalar
    down_w, down_s = quantize_rows(torch.randn(8, 16, generator=gen))
    stream = [("model.layers.0.self_attn.q_proj.weight_scale", q_s[:, None]),  # scale before its weight
              ("model.layers.0.self_attn.q_proj.weight", q_w),
              ("model.layers.0.self_attn.k_proj.weight", k_w),
              ("model.layers.0.self_attn.k_proj.input_scale", torch.tensor(0.1)),
              ("model.layers.0.self_attn.k_proj.weight_scale", torch.tensor(0.5)),
              ("model.layers.0.self_attn.v_proj.weight", torch.randn(4, 8, generator=gen)),  # float: quantized here
              ("model.layers.0.mlp.down_proj.weight", down_w), ("model.layers.0.mlp.down_proj.weight_scale", down_s),
              ("model.layers.0.self_attn.k_scale", torch.tensor(2.0)), ("model.layers.0.self_attn.v_scale",
                                                                         torch.tensor([3.0])),
              ("model.norm.weight", torch.ones(8))]
    adapter = Fp8WeightAdapter(_params(), torch.device("cpu"))
    out = dict(adapter(stream))
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8), q_w.view(torch.uint8))
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight_scale"], q_s)
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight_scale"], torch.full((4,), 0.5))
    assert out["model.layers.0.self_attn.v_proj.weight"].dtype == E4M3 and adapter.num_quantized_here == 1
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32  # dequantized for a kept layer
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"], dequantize_rows(down_w, down_s, torch.float32))
    assert "model.layers.0.mlp.down_proj.weight_scale" not in out and "model.norm.weight" in out
    assert adapter.num_input_scales == 1 and adapter.kv_scales == {0: {"k": 2.0, "v": 3.0}}


@pytest.mark.parametrize("stream,match", [
    ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 8, dtype=E4M3)),
      ("model.layers.0.self_attn.q_proj.weight_scale", torch.ones(1, 2))], "only per-tensor and per-channel"),
    ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 8, dtype=E4M3))], "FP8 weights without a weight_scale"),
    ([("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 8, dtype=torch.float8_e5m2)),
      ("model.layers.0.self_attn.q_proj.weight_scale", torch.ones(1))], "FP8 weights load as torch.float8_e4m3fn"),
])
def test_adapter_refuses_what_it_cannot_load(stream: list, match: str) -> None:
    with pytest.raises(RadixMeshError, match=match):
        list(Fp8WeightAdapter(_params(), torch.device("cpu"))(stream))


# ---- devices --------------------------------------------------------------------------------------------

def test_a_gpu_without_fp8_is_refused_naming_the_requirement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RadixMeshError, match=r"--quantization fp8 needs a GPU with FP8 support \(compute capability "
                                             r">= 8.9.*A100-SXM4-80GB has 8.0") as err:
        require_fp8(torch.device("cuda"), "--quantization fp8", "quantization")
    assert err.value.code is ErrorCode.UNSUPPORTED
    with pytest.raises(RadixMeshError, match="--kv-cache-dtype fp8_e5m2 needs a GPU with FP8 support"):
        resolve_kv_dtype("fp8_e5m2", torch.bfloat16, torch.device("cuda"), "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    require_fp8(torch.device("cuda"), "--quantization fp8", "quantization")  # Hopper: fine


def test_kv_cache_dtype_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu, "torch-native") == torch.bfloat16
    assert resolve_kv_dtype("fp8_e4m3", torch.float32, cpu, "torch-native") == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.float32, cpu, "triton") == torch.float8_e5m2
    with pytest.raises(RadixMeshError, match="flashinfer is not wired for FP8 KV"):
        resolve_kv_dtype("fp8_e4m3", torch.float32, cpu, "flashinfer")
