"""Preparing a draft model: its files, its share of memory, and the check that it speaks the target's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import PreparedModel
    from radixmesh.engine.model_config import ModelConfig


@dataclass(frozen=True)
class DraftMemory:
    """What a draft model takes beside the target: its weights and its KV per token."""

    weight_bytes: int = 0
    kv_bytes_per_token: int = 0


def prepare_draft(config: EngineConfig) -> PreparedModel:
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.speculative.eagle_setup import as_head

    assert config.speculative_draft_model is not None, "a draft model was asked for without its name"
    return as_head(config, prepare_model(config.speculative_draft_model, config.speculative_draft_load_format,
                                         progress=False))


def num_parameters(model_config: ModelConfig) -> int:
    """Parameters of a model of this shape (tied embeddings counted once), built on the meta device."""
    from radixmesh.engine.models.registry import model_class

    with torch.device("meta"):
        model = model_class(model_config.family)(model_config)
    return sum(p.numel() for p in model.parameters())


def draft_memory_need(config: EngineConfig, dtype: torch.dtype, target: ModelConfig | None = None) -> DraftMemory:
    """The draft model's memory when one runs (`draft`, or `oracle` at a draft's cost; nothing otherwise): the
    target's KV pool is sized so that the draft's weights and an equal-length draft pool fit too."""
    if config.speculative_draft_model is None:
        return DraftMemory()
    from radixmesh.engine.memory import TokenToKVPool
    from radixmesh.engine.speculative.eagle_setup import feature_width

    mc = prepare_draft(config).config
    itemsize = torch.empty((), dtype=dtype).element_size()
    features = feature_width(config, target) * itemsize if target is not None else 0  # EAGLE: the target's features
    return DraftMemory(num_parameters(mc) * itemsize,
                       TokenToKVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype) + features)


def check_draft_fits(target: ModelConfig, target_context_len: int, target_tokenizer: Any, target_tokenizer_path: Any,
                     draft: PreparedModel) -> None:
    """Raise INVALID_ARGUMENT when the draft cannot propose for the target: another vocabulary (size or
    token ids), or a shorter context."""
    name = draft.name
    if draft.config.vocab_size != target.vocab_size:
        raise invalid_argument(
            f"the draft model {name} has a vocabulary of {draft.config.vocab_size} tokens and the target "
            f"{target.vocab_size}: a draft must use the target's tokenizer", "speculative_draft_model")
    if draft.config.context_len < target_context_len:
        raise invalid_argument(
            f"the draft model {name} reads {draft.config.context_len} positions, fewer than the target's context "
            f"of {target_context_len} (lower --context-length)", "speculative_draft_model")
    draft_path = draft.tokenizer_path
    if target_tokenizer is None or draft_path is None or _same_path(draft_path, target_tokenizer_path):
        return
    from radixmesh.engine.hf_tokenizer import load_tokenizer

    draft_vocab = load_tokenizer(draft_path).get_vocab()
    target_vocab = target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for tok, tid in draft_vocab.items() if target_vocab.get(tok) != tid)
        raise invalid_argument(
            f"the draft model {name}'s tokenizer ({draft_path}) differs from the target's: {differing} of its "
            f"{len(draft_vocab)} tokens have other ids (a draft must use the target's tokenizer)",
            "speculative_draft_model")


def _same_path(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, TypeError):
        return str(a) == str(b)
