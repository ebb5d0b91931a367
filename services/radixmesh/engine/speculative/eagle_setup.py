"""EAGLE heads' set-up on both sides: the head's config (its published `architectures` may name the plain Llama
class) and the target's feature capture (`HiddenCapture`), built before the target's CUDA graphs are captured."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import PreparedModel
    from radixmesh.engine.model_config import ModelConfig
    from radixmesh.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

EAGLE_ARCHITECTURES = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}
"""--speculative-algorithm -> the head's architecture."""


def as_head(config: EngineConfig, prepared: PreparedModel, target_context_len: int | None = None) -> PreparedModel:
    """An EAGLE algorithm's draft as its head class (the published EAGLE checkpoints say LlamaForCausalLM); its
    rotary table reaches the target's context (heads are often configured for fewer positions)."""
    arch = EAGLE_ARCHITECTURES.get(config.speculative_algorithm or "")
    if arch is None:
        return prepared
    mc = prepared.config
    positions = max(mc.max_position_embeddings, target_context_len or 0, config.context_length or 0)
    return dataclasses.replace(prepared, config=dataclasses.replace(
        mc, architecture=arch, max_position_embeddings=positions))


def feature_layers(config: EngineConfig, head: ModelConfig, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose inputs the head reads (EAGLE-3), or () for the last normed hidden state (EAGLE)."""
    if config.speculative_algorithm != "eagle3":
        return ()
    from radixmesh.engine.models.eagle import eagle3_capture_layers

    layers = eagle3_capture_layers(head, target.num_layers)
    if any(not 0 <= i <= target.num_layers for i in layers):
        raise invalid_argument(f"the EAGLE-3 head reads target layers {list(layers)}, but the target has "
                               f"{target.num_layers}", "speculative_draft_model")
    return layers


def feature_width(config: EngineConfig, target: ModelConfig) -> int:
    """Values stored per token for the head: one hidden state (EAGLE), three (EAGLE-3), none otherwise."""
    algorithm = config.speculative_algorithm
    if algorithm not in EAGLE_ARCHITECTURES:
        return 0
    return target.hidden_size * (3 if algorithm == "eagle3" else 1)


def build_capture(runner: ModelRunner) -> None:
    """With an EAGLE head: every target pass stores each token's features by KV slot (a build step before the
    CUDA graphs, so that they store them too)."""
    config = runner.config
    width = feature_width(config, runner.model_config)
    if not width:
        return
    from radixmesh.engine.models.llama import CausalLM, HiddenCapture
    from radixmesh.engine.speculative.draft_setup import prepare_draft

    model = runner.model
    if not isinstance(model, CausalLM) or runner.tp.enabled:
        raise invalid_argument(f"--speculative-algorithm {config.speculative_algorithm} drafts for the Llama and "
                               "Qwen text models at --tp-size 1", "speculative_algorithm")
    head = prepare_draft(config).config
    layers = feature_layers(config, head, runner.model_config)
    pool = torch.zeros(runner.kv_pool.size + 1, width, dtype=runner.dtype, device=runner.device)
    model.model.capture = HiddenCapture(pool, layers)
    logger.info("EAGLE features: %s of every token, %.1f MiB", f"inputs of layers {list(layers)}" if layers
                else "the last hidden state", pool.numel() * pool.element_size() / 2**20)
