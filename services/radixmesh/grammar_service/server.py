"""Run the grammar service until SIGTERM."""

from __future__ import annotations

import asyncio

from radixmesh.common import aio
from radixmesh.common.errors import invalid_argument
from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.engine.grammar.registry import grammar_backend_class
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.grammar_service.service import SERVICE_NAME, GrammarServicer
from radixmesh.grammar_service.store import GrammarStore, StoreConfig
from radixmesh.protocol import grammar_pb2_grpc
from radixmesh.wire.fingerprint import tokenizer_fingerprint

REDIS_PROBE_S = 2.0
"""Seconds between checks of the grammar cache's Redis."""


async def build_servicer(model: str | None, load_format: str, store_config: StoreConfig, backend: str = "xgrammar",
                         num_threads: int = 2, tokenizer_source: str | None = None) -> GrammarServicer:
    """A servicer for the model's tokenizer (or `tokenizer_source`); vocab size and stop ids default to the
    model's. The model's weights are never read."""
    prepared = await asyncio.to_thread(prepare_model, model, load_format, tokenizer=tokenizer_source,
                                       need_weights=False)
    if prepared.tokenizer_path is None:
        raise invalid_argument(f"model {prepared.name} has no tokenizer", "model")
    tokenizer = await asyncio.to_thread(load_tokenizer, prepared.tokenizer_path)
    fingerprint = await asyncio.to_thread(tokenizer_fingerprint, tokenizer)
    eos_ids = list(prepared.config.eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id else [])
    return GrammarServicer(tokenizer, fingerprint, grammar_backend_class(backend), GrammarStore(store_config),
                           prepared.config.vocab_size, eos_ids, num_threads)


async def watch_cache(server: GrpcServer, store: GrammarStore, interval_s: float = REDIS_PROBE_S) -> None:
    """The shared Redis cache is optional: while it is down the service is degraded, never unready."""
    redis_url = store.config.redis_url
    if not redis_url:
        return
    server.readiness.add("cache", f"the grammar cache at {redis_url}", required=False)
    while True:
        up = await store.probe()
        server.readiness.set("cache", up, "" if up else store.redis_error)
        await asyncio.sleep(interval_s)


async def serve_grammar(config: GrpcServerConfig, model: str | None, load_format: str, store_config: StoreConfig,
                        backend: str = "xgrammar", num_threads: int = 2, tokenizer_source: str | None = None) -> int:
    servicer = await build_servicer(model, load_format, store_config, backend, num_threads, tokenizer_source)
    server = GrpcServer(config, "grammar", [SERVICE_NAME])
    grammar_pb2_grpc.add_GrammarServiceServicer_to_server(servicer, server.server)
    await server.start()
    watcher = asyncio.create_task(watch_cache(server, servicer.store))
    try:
        await server.run_until_signal()
    finally:
        await aio.cancel_and_wait(watcher)
        servicer.close()
        await servicer.store.close()
    return 0
