"""Connects an engine's block events and LoRA adapter changes to a `KVIndexWriter` (used by the worker service)."""

from __future__ import annotations

import logging
from typing import Any

from radixmesh.index.config import IndexConfig
from radixmesh.index.writer import KVIndexWriter, WriterIdentity
from radixmesh.wire.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEventsMsg

logger = logging.getLogger(__name__)


def apply_events(writer: KVIndexWriter, msg: KVEventsMsg) -> None:
    """Hand one step's events to the writer, in order."""
    assert msg.block_size == writer.config.block_size, (
        f"engine hashes blocks of {msg.block_size} tokens, the index expects {writer.config.block_size}")
    for event in msg.events:
        if isinstance(event, BlocksStored):
            writer.stored(event.block_hashes, event.tier)
        elif isinstance(event, BlocksRemoved):
            writer.removed(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            writer.cleared()


async def start_publisher(engine_client: Any, config: IndexConfig, identity: WriterIdentity) -> KVIndexWriter:
    """Start a writer fed by `engine_client` (an EngineClient started with kv_events_block_size set)."""
    block_size = engine_client.config.kv_events_block_size
    assert block_size == config.block_size, (
        f"the engine reports blocks of {block_size} tokens; the index uses {config.block_size}")
    writer = KVIndexWriter(config, identity)
    engine_client.on_kv_events = lambda msg: apply_events(writer, msg)
    if engine_client.config.lora_enabled:  # the lease names the adapters: those loaded at start, then each change
        width = engine_client.config.max_loras_per_batch
        engine_client.on_lora_change = lambda names: writer.set_lora_adapters(names, width)
        writer.set_lora_adapters([a["name"] for a in await engine_client.list_lora_adapters()], width)
    await writer.start()
    logger.info("index: worker %s publishes its cache to %s (namespace %s)", identity.worker_id,
                config.redis_url, config.namespace)
    return writer
