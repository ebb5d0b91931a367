"""The cluster gateway's backend: tokenizes and detokenizes with a copy of the tokenizer service's tokenizer (or, with
`--tokenize service` / `--detokenize service`, through the service), generates through a router (or straight
through one worker).

It composes three parts: the tokenizer upstream (tokenizer_upstream.py: text <-> tokens, the prompts' block
hashes), the Generate upstream (generate_upstream.py: replicas, failover, aborts, control calls) and the model card
reader (model_card.py); an `UpstreamWatcher` keeps both upstreams' readiness.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from radixmesh.common.errors import invalid_argument
from radixmesh.common.readiness import Readiness
from radixmesh.engine.mm.prompt import MultimodalPrompt, PromptWithImages
from radixmesh.engine.sampling.validation import validate_params
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS
from radixmesh.gateway.backend import GatewayBackend, GenerationChunk, ModelCard, SamplingParams
from radixmesh.gateway.config import DETOKENIZE_MODES, TOKENIZE_MODES
from radixmesh.gateway.generate_upstream import GenerateUpstream
from radixmesh.gateway.model_card import ModelCardReader
from radixmesh.gateway.tokenizer_upstream import TokenizerUpstream
from radixmesh.gateway.upstreams import Upstream, UpstreamGroup, UpstreamWatcher, WatchConfig, not_ready_error
from radixmesh.protocol import common_pb2, worker_pb2
from radixmesh.wire.convert import images_to_proto, proto_to_chunk, sampling_to_proto
from radixmesh.wire.images import MultimodalInputs, masked_text_ids
from radixmesh.wire.lora_info import adapter_info_from_proto, load_result_from_proto


class ClusterBackend(GatewayBackend):
    """Talks to a tokenizer service and to routers (target_kind "router", one or more replicas) or one worker.

    It connects in the background: `start` returns at once, and until the tokenizer and a target answer
    (and the model's description was read from them) `not_ready_reason` names what is missing, `card`
    raises UNAVAILABLE with that reason, and the HTTP layer answers 503. A dependency that goes away
    later makes it unready again until it returns; nothing here ever exits the process.
    """

    def __init__(self, tokenizer_address: str, target_address: str, target_kind: str = "router",
                 served_model_name: str | None = None, watch: WatchConfig | None = None,
                 detokenize: str = "local", target: Upstream | None = None, transport: str = "lane",
                 tokenize: str = "local", tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> None:
        """`target`: a target built elsewhere (the router in this process) instead of `target_address`'s;
        `transport`: how Generate reaches the targets (lane | grpc, see `radixmesh.common.lane`); `tokenize` /
        `detokenize`: "local" (a copy of the service's tokenizer, `tokenizer_workers` threads encoding prompts) or
        "service"."""
        for param, value, modes in (("detokenize", detokenize, DETOKENIZE_MODES),
                                    ("tokenize", tokenize, TOKENIZE_MODES)):
            if value not in modes:
                raise invalid_argument(f"{param} must be one of {', '.join(modes)} (got {value!r})", param)
        self.generation = GenerateUpstream(target_address, target_kind, self.not_ready_reason, target, transport)
        self.tokenizer = TokenizerUpstream(tokenizer_address, tokenize_locally=tokenize == "local",
                                           detokenize_locally=detokenize == "local",
                                           tokenizer_workers=tokenizer_workers)
        self.readiness = Readiness("gateway")
        self.model = ModelCardReader(self.tokenizer, self.generation, self.readiness, served_model_name)
        self.watcher = UpstreamWatcher([self.tokenizer.group, self.generation.group], self.readiness,
                                       watch or WatchConfig(), on_change=self.model.on_upstream_change)
        self.tokenizer.watcher = self.generation.watcher = self.watcher

    @classmethod
    async def start(cls, tokenizer_address: str, target_address: str, target_kind: str = "router",
                    served_model_name: str | None = None, watch: WatchConfig | None = None,
                    detokenize: str = "local", target: Upstream | None = None,
                    transport: str = "lane", tokenize: str = "local",
                    tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS) -> ClusterBackend:
        """Start watching the dependencies; returns at once, ready or not (see `not_ready_reason`)."""
        backend = cls(tokenizer_address, target_address, target_kind, served_model_name, watch, detokenize, target,
                      transport, tokenize, tokenizer_workers)
        backend.watcher.start()
        return backend

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until ready (tests and tools); False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.is_healthy:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # ---- what it talks to -------------------------------------------------------------------------
    @property
    def targets(self) -> UpstreamGroup:
        """The Generate targets (routers, or the one worker)."""
        return self.generation.group

    @property
    def tokenizer_address(self) -> str:
        return self.tokenizer.address

    @property
    def target_kind(self) -> str:
        return self.generation.target_kind

    @property
    def target_address(self) -> str:
        return self.generation.target_address

    # ---- readiness --------------------------------------------------------------------------------
    def when_card_known(self, callback: Callable[[ModelCard], None]) -> None:
        self.model.when_known(callback)

    def not_ready_reason(self) -> str:
        if self.model.closed:
            return "the gateway is shutting down"
        if self.readiness.ready and self.model.card is not None:
            return ""
        return self.readiness.reason or "reading the model's description"

    def readiness_details(self) -> dict[str, Any]:
        groups = [self.tokenizer.group, self.generation.group]
        deps: dict[str, Any] = {u.address if len(g.upstreams) > 1 else g.name: {"kind": u.kind, "address": u.address,
                                "up": u.up, "detail": u.detail} for g in groups for u in g.upstreams}
        return {"ready": not self.not_ready_reason(), "reason": self.not_ready_reason(), "dependencies": deps,
                "tokenize": "local" if self.tokenizer.pool is not None else "service",
                "detokenize": "local" if self.tokenizer.local_tokenizer is not None else "service"}

    def metric_views(self) -> list[tuple[Any, str]]:
        return [view for u in self.generation.group.upstreams for view in getattr(u, "metric_views", ())]

    @property
    def card(self) -> ModelCard:
        if self.model.card is None:
            raise not_ready_error(self.not_ready_reason())
        return self.model.card

    @property
    def is_healthy(self) -> bool:
        return not self.not_ready_reason()

    # ---- text <-> tokens (blocking calls: the gateway backend contract is synchronous) -----------
    async def encode(self, text: str) -> list[int]:
        return await self.tokenizer.encode(text)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        return list((await self.tokenizer.chat(messages, True, tools)).token_ids)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return str((await self.tokenizer.chat(messages, add_generation_prompt)).prompt_text)

    async def tokenize_multimodal(self, prompt: PromptWithImages) -> MultimodalPrompt:
        return await self.tokenizer.tokenize_multimodal(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        return self.tokenizer.token_texts(token_ids)

    def prompt_hashes(self, ids: list[int]) -> common_pb2.BlockHashes:
        return self.tokenizer.prompt_hashes(ids)

    # ---- generation -------------------------------------------------------------------------------
    def validate(self, input_ids: list[int], params: SamplingParams, mm: MultimodalInputs | None = None,
                 lora: str | None = None) -> None:
        """The checks that need no engine; the worker checks everything again and its errors come back exact."""
        card = self.card
        if mm is not None:
            input_ids = masked_text_ids(input_ids)
        validate_params(params, card.vocab_size)
        if not input_ids:
            raise invalid_argument("the prompt is empty", "prompt")
        if len(input_ids) >= card.context_len:
            raise invalid_argument(f"the prompt has {len(input_ids)} tokens, but the context length is "
                                   f"{card.context_len}", "prompt")
        if min(input_ids) < 0 or max(input_ids) >= card.vocab_size:
            raise invalid_argument(f"input_ids must be in [0, {card.vocab_size})", "input_ids")

    def _request(self, input_ids: list[int], params: SamplingParams, rid: str, prefill_only: bool = False,
                 mm: MultimodalInputs | None = None, lora: str | None = None) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(request_id=rid, token_ids=input_ids,
                                          block_hashes=self.tokenizer.prompt_hashes(input_ids, lora),
                                          sampling_params=sampling_to_proto(params), prefill_only=prefill_only,
                                          images=images_to_proto(mm), lora_name=lora or "")

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                       mm: MultimodalInputs | None = None,
                       lora: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        rid = rid or uuid.uuid4().hex
        request = self._request(list(input_ids), params, rid, mm=mm, lora=lora)
        detok = self.tokenizer.stream_text(rid, params)
        messages = self.generation.stream(request)
        try:
            async for msg in messages:
                yield proto_to_chunk(msg, await detok.text(msg))
            await detok.finish()
        finally:
            await messages.aclose()  # an unfinished call is cancelled: the target aborts and frees the KV
            detok.close()

    async def cache_prefix(self, input_ids: list[int], mm: MultimodalInputs | None = None,
                           lora: str | None = None) -> None:
        request = self._request(list(input_ids), SamplingParams(), uuid.uuid4().hex, True, mm, lora)
        async for _ in self.generation.stream(request):
            pass

    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        if params.n == 1:
            return [params]
        return [msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                for i in range(params.n)]

    async def abort(self, rid: str) -> None:
        await self.generation.abort(rid)

    # ---- control ----------------------------------------------------------------------------------
    async def flush_cache(self) -> bool:
        return await self.generation.flush_cache()

    async def server_info(self) -> dict[str, Any]:
        return await self.generation.server_info()

    # ---- LoRA adapters (a router spreads these over its workers: radixmesh.router.lora_control) ---------------
    async def list_lora_adapters(self) -> list[dict[str, Any]]:
        reply = await self.generation.lora_call("ListLoraAdapters", common_pb2.ListLoraAdaptersRequest())
        return [adapter_info_from_proto(a) for a in reply.adapters]

    async def load_lora_adapter(self, name: str, path: str, worker_id: str = "") -> dict[str, Any]:
        request = common_pb2.LoadLoraAdapterRequest(name=name, path=path, worker_id=worker_id)
        return load_result_from_proto(await self.generation.lora_call("LoadLoraAdapter", request))

    async def unload_lora_adapter(self, name: str, worker_id: str = "") -> dict[str, Any]:
        request = common_pb2.UnloadLoraAdapterRequest(name=name, worker_id=worker_id)
        reply = await self.generation.lora_call("UnloadLoraAdapter", request)
        return {"worker_ids": list(reply.worker_ids)} if reply.worker_ids else {}

    async def close(self) -> None:
        if self.model.closed:
            return
        await self.model.close()
        await self.watcher.close()
        self.tokenizer.close()
