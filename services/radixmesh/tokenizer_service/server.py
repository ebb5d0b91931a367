"""Run the tokenizer service until SIGTERM."""

from __future__ import annotations

import asyncio

from radixmesh.common.errors import invalid_argument
from radixmesh.common.grpc_server import GrpcServer, GrpcServerConfig
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.engine.mm.config import ImageLimits
from radixmesh.engine.mm.prompt import MultimodalProcessor
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS, check_num_workers
from radixmesh.protocol import tokenizer_pb2_grpc
from radixmesh.tokenizer_service.service import SERVICE_NAME, TokenizerServicer


async def serve_tokenizer(config: GrpcServerConfig, model: str | None, load_format: str = "auto",
                          block_size: int = 16, tokenizer_source: str | None = None,
                          image_limits: ImageLimits | None = None,
                          tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> int:
    """Serve the tokenizer of `model` (or `tokenizer_source`), and its image processor when it takes
    images; its weights are never read."""
    prepared = await asyncio.to_thread(prepare_model, model, load_format, tokenizer=tokenizer_source,
                                       need_weights=False)
    if prepared.tokenizer_path is None:
        raise invalid_argument(f"model {prepared.name} has no tokenizer; pass --tokenizer", "model")
    tokenizer = await asyncio.to_thread(load_tokenizer, prepared.tokenizer_path)
    images = MultimodalProcessor.for_model(prepared.config, [prepared.model_path, prepared.tokenizer_path], tokenizer,
                                           image_limits)
    check_num_workers(tokenizer_workers)
    servicer = TokenizerServicer(tokenizer, prepared.name, block_size, str(prepared.tokenizer_path), images,
                                 tokenizer_workers)
    server = GrpcServer(config, "tokenizer", [SERVICE_NAME])
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(servicer, server.server)
    await server.start()
    try:
        await server.run_until_signal()
    finally:
        servicer.pool.close()
    return 0
