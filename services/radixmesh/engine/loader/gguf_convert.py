"""Convert a GGUF file into a Hugging Face style directory (config.json, safetensors, tokenizer).

Every tensor is dequantized with the `gguf` package (vectorized numpy) and renamed to its
Hugging Face name. llama.cpp's converter rope-permutes the q and k projections of the
llama architecture (interleaved rotary pairs); that permutation is undone here so the
result is an ordinary Hugging Face checkpoint that our models and `transformers` both load.

Mixture-of-experts files (`qwen3moe`, and `llama` with an expert count: Mixtral) keep each layer's
experts in one 3-D tensor per projection (`ffn_gate_exps` `[E, I, H]`, ...); they are written back as
one Hugging Face tensor per expert and projection (gguf_experts.py).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from radixmesh.common.errors import invalid_argument, not_found, unsupported
from radixmesh.engine.loader.gguf_experts import (
    STACK_SUFFIX,
    expert_stack_name,
    moe_config_fields,
    split_expert_stack,
)
from radixmesh.engine.models.registry import FAMILIES, gguf_family

# Per-layer GGUF tensor -> Hugging Face name under `model.layers.{i}.`.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that only carry data for the config (llama3 rotary factors), not weights.
_NON_WEIGHTS = {"rope_freqs.weight"}
MAX_SHARD_BYTES = 4 << 30


def convert_gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path, progress: bool = True,
                           dtype: torch.dtype = torch.float32) -> Path:
    """Write `config.json`, safetensors weights, tokenizer files and `generation_config.json`.

    `out_dir` is created if needed; files in it are overwritten. Raises RadixMeshError for a
    missing or corrupt file and for architectures without a mapping.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    arch = _architecture(reader, gguf_path)
    config = gguf_hf_config(reader, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _iter_hf_tensors(reader, arch, config, gguf_path, progress)
    _write_safetensors(tensors, out_dir, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(config), indent=2) + "\n")
    _write_tokenizer(gguf_path, out_dir)
    return out_dir


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over `path`; a missing or unreadable file is one clear error."""
    import gguf

    if not path.is_file():
        raise not_found(f"GGUF file {path} not found")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise invalid_argument(f"corrupt GGUF file {path}: not a GGUF file (bad magic)")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors, ...
        raise invalid_argument(f"corrupt GGUF file {path} (truncated?): {_one_line(exc)}") from None


def gguf_hf_config(reader: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A Hugging Face config.json dict built from the GGUF metadata."""
    arch = _architecture(reader, Path(str(getattr(reader.data, "filename", "gguf"))))

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    hidden = int(field(f"{arch}.embedding_length"))
    num_heads = int(field(f"{arch}.attention.head_count"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // num_heads))
    tensor_names = {t.name for t in reader.tensors}
    vocab = field(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    theta = float(field(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [_hf_architecture(arch)],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")
                                 or field(f"{arch}.expert_feed_forward_length")),
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, head_dim, theta),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(field(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    config.update(moe_config_fields(arch, field, tensor_names, config["num_hidden_layers"]))
    return config


def hf_tensor_name(gguf_name: str) -> str:
    """Hugging Face parameter name of a GGUF tensor, e.g. blk.3.attn_q.weight -> model.layers.3....."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is not None and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise unsupported(f"GGUF tensor {gguf_name!r} has no Hugging Face mapping")


# llama.cpp interleaves the two rotary halves of every head: rows [head, 2, half, in]
# are stored as [head, half, 2, in]. `unpermute_rope` restores the Hugging Face order.
def permute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face q/k rows -> llama.cpp's GGUF order (what llama.cpp's converter does)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """GGUF q/k rows (llama arch) -> Hugging Face order; the inverse of `permute_rope`."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _architecture(reader: Any, path: Path) -> str:
    """The file's GGUF architecture, one a model family declares (engine/models/registry.py)."""
    f = reader.fields.get("general.architecture")
    arch = f.contents() if f is not None else None
    if not isinstance(arch, str) or gguf_family(arch) is None:
        known = ", ".join(sorted(fam.gguf_architecture for fam in FAMILIES if fam.gguf_architecture))
        raise unsupported(f"GGUF file {path.name}: unsupported architecture {arch!r} (supported: {known})")
    return arch


def _hf_architecture(gguf_architecture: str) -> str:
    """The Hugging Face architecture a GGUF architecture converts to: its family's first."""
    family = gguf_family(gguf_architecture)
    assert family is not None, "checked by _architecture"
    return next(iter(family.architectures))


def _rope_permuted(gguf_architecture: str) -> bool:
    """llama.cpp stored the file's q/k projections rope-permuted."""
    family = gguf_family(gguf_architecture)
    return family is not None and family.gguf_rope_permuted


def _rope_scaling(reader: Any, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind_field = reader.fields.get(f"{arch}.rope.scaling.type")
    kind = kind_field.contents() if kind_field is not None else None
    if kind == "linear":
        factor = float(reader.fields[f"{arch}.rope.scaling.factor"].contents())
        return {"rope_type": "linear", "factor": factor}
    if kind not in (None, "none"):
        raise unsupported(f"GGUF rope scaling {kind!r} is not supported")
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is None:
        return None
    return llama3_rope_scaling(np.asarray(rope_freqs.data, dtype=np.float64), head_dim, theta)


def llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover config.json's llama3 `rope_scaling` from llama.cpp's per-frequency divisors.

    GGUF keeps only the divisors; the factor is their maximum and the other parameters are
    the values every published Llama 3.x uses. The divisors are recomputed and compared so
    that any other scaling fails loudly instead of loading with the wrong rotary.
    """
    scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = llama3_rope_divisors(scaling, head_dim, theta)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-3):
        raise unsupported("GGUF rope_freqs do not match llama3 rope scaling; this scaling is not supported")
    return scaling


def llama3_rope_divisors(scaling: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling, as llama.cpp stores them in rope_freqs."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, blended))


def _iter_hf_tensors(reader: Any, arch: str, config: dict[str, Any], path: Path,
                     progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    import gguf

    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for t in tqdm(reader.tensors, desc="radixmesh: converting GGUF", unit="tensor", file=sys.stderr,
                  disable=not progress, leave=False):
        if t.name in _NON_WEIGHTS:
            continue
        name = expert_stack_name(t.name, config) or hf_tensor_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dims innermost first
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        except (NotImplementedError, ValueError) as exc:
            raise invalid_argument(f"GGUF file {path.name}: cannot dequantize {t.name} "
                                   f"({t.tensor_type.name}): {_one_line(exc)}") from None
        proj = name.split(".")[-2]
        if _rope_permuted(arch) and proj in heads:
            w = unpermute_rope(w, heads[proj])
        if name.endswith(STACK_SUFFIX):
            yield from split_expert_stack(name, w)
            continue
        yield name, w


def _write_safetensors(tensors: Iterator[tuple[str, np.ndarray]], out_dir: Path, dtype: torch.dtype) -> None:
    """One `model.safetensors`, or shards of at most MAX_SHARD_BYTES plus an index.

    A shard is written as soon as it is full, so memory holds one shard at a time.
    """
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    shard_files: list[Path] = []
    weight_map: dict[str, int] = {}  # name -> shard number
    total_bytes = 0

    def flush() -> None:
        shard_files.append(out_dir / f"model-part-{len(shard_files) + 1:05d}.safetensors")
        save_file(shard, str(shard_files[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, len(shard_files)))
        shard.clear()

    for name, w in tensors:
        if not w.flags.writeable:  # F32/F16 tensors are views of the read-only file mapping
            w = w.copy()
        t = torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > MAX_SHARD_BYTES:
            flush()
        shard[name] = t
        total_bytes += t.nbytes
    flush()
    if len(shard_files) == 1:
        shard_files[0].replace(out_dir / "model.safetensors")
        return
    num = len(shard_files)
    names = [f"model-{i:05d}-of-{num:05d}.safetensors" for i in range(1, num + 1)]
    for file, final in zip(shard_files, names):
        file.replace(out_dir / final)
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {k: names[i - 1] for k, i in weight_map.items()}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise unsupported(f"GGUF file {gguf_path.name}: cannot build its tokenizer: "
                          f"{_one_line(exc)}") from None
    tok.save_pretrained(str(out_dir))


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

