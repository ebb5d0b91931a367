"""The model's shape, read from a Hugging Face `config.json` (or built for dummy weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.engine.models.registry import SUPPORTED_ARCHITECTURES, ModelFamily, family_of


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer of a supported family."""

    architecture: str
    """Hugging Face architecture name, e.g. LlamaForCausalLM."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (grouped-query attention when < num_heads)."""
    head_dim: int
    """Width of one head."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """Rotary scaling as in config.json (llama3 and linear are supported)."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    max_position_embeddings: int = 4096
    """Longest context the model was trained for; the engine's context length."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections have biases (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before rotary (Qwen3)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if any."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation unless ignore_eos is set."""
    torch_dtype: str = "float32"
    """Dtype the checkpoint was saved in."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The config.json this was built from."""

    def __post_init__(self) -> None:
        if family_of(self.architecture) is None:
            known = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise unsupported(f"unsupported architecture {self.architecture!r} (supported: {known})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise invalid_argument(f"model config: {name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise invalid_argument("model config: num_heads must be a multiple of num_kv_heads")

    @property
    def model_family(self) -> ModelFamily:
        """The family serving this architecture (engine/models/registry.py)."""
        family = family_of(self.architecture)
        assert family is not None, "checked at construction"
        return family

    @property
    def family(self) -> str:
        return self.model_family.id

    @property
    def is_multimodal(self) -> bool:
        """The model takes images besides text."""
        return self.model_family.multimodal

    @property
    def context_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or [""]
        arch = archs[0]
        family = family_of(arch)
        if family is None:
            known = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise unsupported(f"unsupported architecture {arch or cfg.get('model_type')!r} "
                              f"(supported: {known})")
        raw, cfg = cfg, _language_fields(cfg)
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rope_theta=float(cfg.get("rope_theta")
                                 or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
                rope_scaling=cfg.get("rope_scaling"),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family.qkv_bias
                                            or cfg.get("model_type") == "qwen2")),
                qk_norm=family.qk_norm,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                raw=dict(raw),
            )
        except KeyError as exc:
            raise invalid_argument(f"model config is missing {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise invalid_argument(f"no config.json in {path}")
        try:
            cfg = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise invalid_argument(f"corrupt config.json in {path}: {exc}") from None
        return cls.from_hf_dict(cfg)


def _language_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language-model fields at the top level: its `text_config` over the outer
    fields (Qwen2-VL's published configs keep them at the top); multimodal rotary sections are the
    model's own business (models/qwen2_vl.py), not a rope scaling. Other configs are returned as they are."""
    family = family_of((cfg.get("architectures") or [""])[0])
    if family is None or not family.multimodal:
        return cfg
    merged = {**cfg, **(cfg.get("text_config") or {}), "architectures": cfg["architectures"]}
    scaling = merged.get("rope_scaling") or {}
    if scaling.get("type") == "mrope" or scaling.get("rope_type") == "mrope" or "mrope_section" in scaling:
        merged["rope_scaling"] = None
    return merged
