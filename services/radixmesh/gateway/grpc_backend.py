"""`grpc` backend: the gateway in a cluster. Tokenizes through the tokenizer service, generates
through a router (or straight through one worker), and detokenizes the stream with a copy of the
service's tokenizer (or, with `--detokenize service`, through the service).

Tokenize once: `encode`/`apply_chat_template` get token ids and the prompt's block hashes from
the tokenizer service; the hashes travel with the ids in GenerateRequest, so neither the router
nor the worker tokenizes. Ids that a client sent itself are hashed here with the same function.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
import grpc.aio
import msgspec

from radixmesh.common import aio, tls, tracing
from radixmesh.common.convert import images_to_proto, load_from_proto, proto_to_chunk, sampling_to_proto
from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.common.gc_tuning import freeze_startup_objects
from radixmesh.common.grpc_errors import ERROR_METADATA_KEY, from_rpc_error
from radixmesh.common.lane import LaneBroken, LaneStream
from radixmesh.common.readiness import Readiness
from radixmesh.engine import tokenizer as hf_text
from radixmesh.engine.mm.inputs import MultimodalInputs, masked_text_ids
from radixmesh.engine.mm.prompt import MultimodalPrompt, PromptWithImages
from radixmesh.gateway.backend import Backend, GenerationChunk, ModelCard, SamplingParams
from radixmesh.gateway.config import DETOKENIZE_MODES
from radixmesh.gateway.detokenizers import LocalText, ServiceText, StreamText, fetch_tokenizer
from radixmesh.gateway.images import tokenize_request, tokenized_prompt
from radixmesh.gateway.upstreams import (
    CHANNEL_OPTIONS,
    Upstream,
    UpstreamGroup,
    UpstreamWatcher,
    WatchConfig,
    not_ready_error,
    parse_addresses,
)
from radixmesh.index.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from radixmesh.protocol import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

logger = logging.getLogger(__name__)
HASH_CACHE_SIZE = 1024
"""Prompts whose block hashes (from Tokenize) are kept until their Generate call."""
TOKENIZE_TIMEOUT_S = 10.0
"""Bound on the blocking tokenizer calls (they hold the event loop, as local tokenization does)."""
IMAGE_TOKENIZE_TIMEOUT_S = 60.0
"""Bound on a Tokenize call with images (the tokenizer service may fetch and resize them)."""
CONTROL_TIMEOUT_S = 30.0


class GrpcBackend(Backend):
    """Talks to a tokenizer service and to routers (target_kind "router", one or more replicas) or one worker.

    It connects in the background: `start` returns at once, and until the tokenizer and a target answer
    (and the model's description was read from them) `not_ready_reason` names what is missing, `card`
    raises UNAVAILABLE with that reason, and the HTTP layer answers 503. A dependency that goes away
    later makes it unready again until it returns; nothing here ever exits the process.
    """

    def __init__(self, tokenizer_address: str, target_address: str, target_kind: str = "router",
                 served_model_name: str | None = None, watch: WatchConfig | None = None,
                 detokenize: str = "local", target: Upstream | None = None, transport: str = "lane") -> None:
        """`target`: a target built elsewhere (the router in this process) instead of `target_address`'s;
        `transport`: how Generate reaches the targets (lane | grpc, see `radixmesh.common.lane`)."""
        assert target_kind in ("router", "worker"), f"target_kind {target_kind!r} is not router or worker"
        if detokenize not in DETOKENIZE_MODES:
            raise invalid_argument(f"detokenize must be one of {', '.join(DETOKENIZE_MODES)} (got {detokenize!r})",
                                   "detokenize")
        self.detokenize = detokenize
        self._local_tokenizer: Any = None
        """The tokenizer service's tokenizer, copied here ("local" detokenization), once loaded."""
        targets = [target.address] if target is not None else parse_addresses(target_address, target_kind)
        if target_kind == "worker" and len(targets) > 1:
            raise invalid_argument("--worker takes one worker; put a router in front of several", "worker")
        self.tokenizer_address, self.target_kind = tokenizer_address, target_kind
        self.target_address = ",".join(targets)
        self.served_model_name = served_model_name
        self._tok_sync_channel = tls.sync_channel(tokenizer_address, options=CHANNEL_OPTIONS)
        self._tok_sync = tokenizer_pb2_grpc.TokenizerServiceStub(tracing.instrument_channel(self._tok_sync_channel))
        self.tokenizer = UpstreamGroup("tokenizer", [Upstream("tokenizer", tokenizer_address,
                                                              tokenizer_pb2_grpc.TokenizerServiceStub)])
        stub_class = router_pb2_grpc.RouterServiceStub if target_kind == "router" else worker_pb2_grpc.WorkerServiceStub
        self._service_name = (router_pb2.DESCRIPTOR.services_by_name["RouterService"] if target_kind == "router"
                              else worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]).full_name
        """The target's gRPC service (names the lane's spans as gRPC's interceptor names the calls')."""
        self.targets = UpstreamGroup(target_kind, [target] if target is not None else
                                     [Upstream(target_kind, a, stub_class, transport == "lane") for a in targets])
        self.readiness = Readiness("gateway")
        self.watcher = UpstreamWatcher([self.tokenizer, self.targets], self.readiness, watch or WatchConfig(),
                                       on_change=self._on_upstream_change)
        self._hashes: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        self._card: ModelCard | None = None
        self._card_task: asyncio.Task[None] | None = None
        self._card_callbacks: list[Callable[[ModelCard], None]] = []
        self._inflight: dict[str, Upstream] = {}
        """Request id -> the target replica running it (where an abort goes)."""
        self.block_size = DEFAULT_BLOCK_SIZE
        self._closed = False

    @classmethod
    async def start(cls, tokenizer_address: str, target_address: str, target_kind: str = "router",
                    served_model_name: str | None = None, watch: WatchConfig | None = None,
                    detokenize: str = "local", target: Upstream | None = None,
                    transport: str = "lane") -> GrpcBackend:
        """Start watching the dependencies; returns at once, ready or not (see `not_ready_reason`)."""
        backend = cls(tokenizer_address, target_address, target_kind, served_model_name, watch, detokenize, target,
                      transport)
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

    # ---- readiness -------------------------------------------------------------------------------
    def _on_upstream_change(self) -> None:
        fetching = self._card_task is not None and not self._card_task.done()
        if self._card is None and self.tokenizer.up and self.targets.up and not self._closed and not fetching:
            self._card_task = asyncio.get_running_loop().create_task(self._fetch_card())

    async def _fetch_card(self) -> None:
        """Read the model's facts once both sides answer; a failure is retried on the next change or check."""
        if "model" not in self.readiness:
            self.readiness.add("model", f"the model's description from the {self.target_kind}",
                               detail="being read")
        for target in self.targets.ready():
            try:
                info = await self._call(target.stub.GetModelInfo, worker_pb2.GetModelInfoRequest(), target.address)
                tok = await self._call(self.tokenizer.upstreams[0].stub.GetTokenizerInfo,
                                       tokenizer_pb2.GetTokenizerInfoRequest(), self.tokenizer_address)
            except RadixMeshError as exc:
                self.readiness.set("model", False, exc.message)
                continue
            self.block_size = tok.block_size or DEFAULT_BLOCK_SIZE
            if self.detokenize == "local" and self._local_tokenizer is None:
                # Before ready: loading it holds the GIL for seconds (a large vocabulary), which would
                # stall the first requests' streams if they were already being served.
                self.readiness.set("model", False, "copying the tokenizer service's tokenizer")
                await self._fetch_local_tokenizer()
                freeze_startup_objects()  # the copy's vocabulary lives as long as the process
            self._card = _make_card(info, tok, self.served_model_name, self)
            self.readiness.set("model", True)
            for callback in self._card_callbacks:
                callback(self._card)
            logger.warning("gateway: ready: serving %s through %s and %s", self._card.name,
                           self.targets.description, self.tokenizer.description)
            return
        await asyncio.sleep(1.0)  # nothing answered: look again (the watcher calls back on the next change)
        self._card_task = None
        self._on_upstream_change()

    def when_card_known(self, callback: Callable[[ModelCard], None]) -> None:
        if self._card is not None:
            callback(self._card)
        else:
            self._card_callbacks.append(callback)

    def not_ready_reason(self) -> str:
        if self._closed:
            return "the gateway is shutting down"
        if self.readiness.ready and self._card is not None:
            return ""
        return self.readiness.reason or "reading the model's description"

    def readiness_details(self) -> dict[str, Any]:
        groups = [self.tokenizer, self.targets]
        deps: dict[str, Any] = {u.address if len(g.upstreams) > 1 else g.name: {"kind": u.kind, "address": u.address,
                                "up": u.up, "detail": u.detail} for g in groups for u in g.upstreams}
        return {"ready": not self.not_ready_reason(), "reason": self.not_ready_reason(), "dependencies": deps,
                "detokenize": "local" if self._local_tokenizer is not None else "service"}

    def metric_views(self) -> list[tuple[Any, str]]:
        return [view for u in self.targets.upstreams for view in getattr(u, "metric_views", ())]

    async def _call(self, method: Callable[..., Any], request: Any, peer: str, **kwargs: Any) -> Any:
        try:
            return await method(request, timeout=CONTROL_TIMEOUT_S, **kwargs)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, peer) from None

    @property
    def card(self) -> ModelCard:
        if self._card is None:
            raise not_ready_error(self.not_ready_reason())
        return self._card

    @property
    def is_healthy(self) -> bool:
        return not self.not_ready_reason()

    # ---- text <-> tokens (blocking calls: the Backend contract is synchronous) ------------------
    def _tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        try:
            response = self._tok_sync.Tokenize(request, timeout=TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._tokenizer_error(exc) from None
        self._remember_hashes(list(response.token_ids), list(response.block_hashes.hashes))
        return response

    def encode(self, text: str) -> list[int]:
        return list(self._tokenize(tokenizer_pb2.TokenizeRequest(text=text, block_size=self.block_size)).token_ids)

    def _chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> tokenizer_pb2.TokenizeResponse:
        try:
            chat = [tokenizer_pb2.ChatMessage(role=str(m["role"]), content=str(m["content"])) for m in messages]
        except KeyError as exc:
            raise invalid_argument(f"every message needs a {exc.args[0]!r}", "messages") from None
        conversation = tokenizer_pb2.ChatConversation(messages=chat, add_generation_prompt=add_generation_prompt)
        return self._tokenize(tokenizer_pb2.TokenizeRequest(chat=conversation, block_size=self.block_size))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self._chat(messages, True).token_ids)

    async def tokenize_multimodal(self, prompt: PromptWithImages) -> MultimodalPrompt:
        """The tokenizer service reads, preprocesses and places the images (its limits apply)."""
        stub = self.tokenizer.upstreams[0].stub
        try:
            response = await stub.Tokenize(tokenize_request(prompt, self.block_size), timeout=IMAGE_TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._tokenizer_error(exc) from None
        self._remember_hashes(list(response.token_ids), list(response.block_hashes.hashes))
        return tokenized_prompt(response)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(self._chat(messages, add_generation_prompt).prompt_text)

    def _decode(self, token_ids: list[int], per_token: bool) -> tokenizer_pb2.DecodeResponse:
        try:
            return self._tok_sync.Decode(tokenizer_pb2.DecodeRequest(token_ids=token_ids, per_token=per_token),
                                         timeout=TOKENIZE_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._tokenizer_error(exc) from None

    def _tokenizer_error(self, exc: grpc.RpcError) -> RadixMeshError:
        error = from_rpc_error(exc, f"tokenizer at {self.tokenizer_address}")
        if _unreachable(exc):
            self.watcher.mark_down(self.tokenizer, self.tokenizer.upstreams[0], error.message)
        return error

    def decode(self, token_ids: list[int]) -> str:
        if self._local_tokenizer is not None:
            return hf_text.decode_text(self._local_tokenizer, token_ids)
        return self._decode(token_ids, per_token=False).text

    def token_texts(self, token_ids: list[int]) -> list[str]:
        if self._local_tokenizer is not None:
            return hf_text.token_texts(self._local_tokenizer, token_ids)
        return list(self._decode(token_ids, per_token=True).token_texts)

    def _remember_hashes(self, ids: list[int], hashes: list[int]) -> None:
        self._hashes[tuple(ids)] = hashes
        while len(self._hashes) > HASH_CACHE_SIZE:
            self._hashes.popitem(last=False)

    def prompt_hashes(self, ids: list[int]) -> common_pb2.BlockHashes:
        """The prompt's block chain: as the tokenizer service computed it, or (ids sent by the client) here."""
        hashes = self._hashes.get(tuple(ids))
        if hashes is None:
            hashes = block_hashes(ids, self.block_size)
        return common_pb2.BlockHashes(block_size=self.block_size, hashes=hashes)

    # ---- generation -----------------------------------------------------------------------------
    def validate(self, input_ids: list[int], params: SamplingParams, mm: MultimodalInputs | None = None) -> None:
        """The checks that need no engine; the worker checks everything again and its errors come back exact."""
        card = self.card
        if mm is not None:
            input_ids = masked_text_ids(input_ids)
        params.validate(card.vocab_size)
        if not input_ids:
            raise invalid_argument("the prompt is empty", "prompt")
        if len(input_ids) >= card.context_len:
            raise invalid_argument(f"the prompt has {len(input_ids)} tokens, but the context length is "
                                   f"{card.context_len}", "prompt")
        if min(input_ids) < 0 or max(input_ids) >= card.vocab_size:
            raise invalid_argument(f"input_ids must be in [0, {card.vocab_size})", "input_ids")

    def _request(self, input_ids: list[int], params: SamplingParams, rid: str, prefill_only: bool = False,
                 mm: MultimodalInputs | None = None) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(request_id=rid, token_ids=input_ids,
                                          block_hashes=self.prompt_hashes(input_ids),
                                          sampling_params=sampling_to_proto(params), prefill_only=prefill_only,
                                          images=images_to_proto(mm))

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                       mm: MultimodalInputs | None = None) -> AsyncGenerator[GenerationChunk, None]:
        rid = rid or uuid.uuid4().hex
        request = self._request(list(input_ids), params, rid, mm=mm)
        detok = self._stream_text(rid, params)
        call = None
        try:
            target, call, first = await self._open_stream(request)
            self._inflight[rid] = target
            msg = first
            while msg is not grpc.aio.EOF:
                yield proto_to_chunk(msg, await detok.text(msg))
                msg = await self._read(target, call)
            await detok.finish()
        finally:
            self._inflight.pop(rid, None)
            if call is not None:
                call.cancel()  # no-op once finished; otherwise the target aborts and frees the KV
            detok.close()

    def _stream_text(self, rid: str, params: SamplingParams) -> StreamText:
        if self._local_tokenizer is not None:
            return LocalText(self._local_tokenizer, rid, params)
        return ServiceText(self.tokenizer.upstreams[0].stub, rid, params, self._tokenizer_error)

    async def _fetch_local_tokenizer(self) -> None:
        """Detokenize in this process from now on, with a copy of the tokenizer service's tokenizer; if it cannot
        be loaded, streams go through the service's Detokenize."""
        try:
            tokenizer = await fetch_tokenizer(self.tokenizer.upstreams[0].stub, self.tokenizer_address)
        except RadixMeshError as exc:
            logger.warning("gateway: detokenizing through the tokenizer service: its tokenizer could not be "
                           "copied here (%s)", exc.message)
            return
        self._local_tokenizer = tokenizer
        logger.warning("gateway: detokenizing in this process (a copy of the tokenizer at %s, fingerprint "
                       "checked)", self.tokenizer_address)

    async def _open_stream(self, request: worker_pb2.GenerateRequest) -> tuple[Upstream, Any, Any]:
        """Start Generate on a ready target and wait for its first message. A replica that is unavailable
        before that is skipped for the next one (nothing was streamed yet); other errors are the request's."""
        tried: list[str] = []
        last_error: RadixMeshError | None = None
        while True:
            targets = [t for t in self.targets.ready() if t.address not in tried]
            if not targets:
                reason = self.not_ready_reason()
                raise last_error if last_error is not None and not reason else not_ready_error(reason)
            target = targets[0]
            call = await self._start_call(target, request)
            try:
                return target, call, await call.read()  # EOF: ended OK without a message
            except (grpc.RpcError, RadixMeshError) as exc:
                call.cancel()
                error, unreachable, _ = self._failure(target, exc)
                if unreachable:  # gone: the next ready replica, or 503 naming what is missing
                    self.watcher.mark_down(self.targets, target, error.message)
                elif error.code is not ErrorCode.UNAVAILABLE or len(self.targets.upstreams) == 1:
                    raise error from None
                logger.info("gateway: %s failed before streaming (%s); trying another", target.description, error)
                tried.append(target.address)
                last_error = error

    async def _start_call(self, target: Upstream, request: worker_pb2.GenerateRequest) -> Any:
        """Generate on the target's lane when it has one that answers, else over gRPC."""
        stream = None if target.lane is None else await target.lane.open(
            "Generate", request, worker_pb2.GenerateResponse, f"/{self._service_name}/Generate")
        return LaneCall(stream) if stream is not None else target.stub.Generate(request)

    def _failure(self, target: Upstream, exc: Exception) -> tuple[RadixMeshError, bool, bool]:
        """(the error, the target is unreachable, the error is the target's own) of a failed Generate."""
        if isinstance(exc, grpc.RpcError):
            return from_rpc_error(exc, f"{self.target_kind} at {target.address}"), _unreachable(exc), \
                _carries_error(exc)
        assert isinstance(exc, RadixMeshError)
        return exc, isinstance(exc, LaneBroken), not isinstance(exc, LaneBroken)

    async def _read(self, target: Upstream, call: Any) -> Any:
        try:
            return await call.read()
        except (grpc.RpcError, RadixMeshError) as exc:
            error, unreachable, carried = self._failure(target, exc)
            if carried:  # the target's own error (the worker failed the request): as it is
                raise error from None
            if unreachable:
                self.watcher.mark_down(self.targets, target, error.message)
            raise RadixMeshError(ErrorCode.UNAVAILABLE, f"the stream from {target.description} broke after it "
                                                        f"started: {error.message}") from None

    async def cache_prefix(self, input_ids: list[int], mm: MultimodalInputs | None = None) -> None:
        rid = uuid.uuid4().hex
        target, call, msg = await self._open_stream(self._request(list(input_ids), SamplingParams(), rid, True, mm))
        try:
            while msg is not grpc.aio.EOF:
                msg = await self._read(target, call)
        finally:
            call.cancel()

    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        if params.n == 1:
            return [params]
        return [msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                for i in range(params.n)]

    async def abort(self, rid: str) -> None:
        target = self._inflight.get(rid)
        targets = [target] if target is not None else self.targets.ready()
        for t in targets:  # an abort of an unknown or finished request is not an error
            with contextlib.suppress(Exception):
                await t.stub.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=CONTROL_TIMEOUT_S)

    # ---- control ---------------------------------------------------------------------------------
    def _control_target(self) -> Upstream:
        ready = self.targets.ready()
        if not ready:
            raise not_ready_error(self.not_ready_reason())
        return ready[0]

    async def flush_cache(self) -> bool:
        target = self._control_target()
        response = await self._call(target.stub.FlushCache, worker_pb2.FlushCacheRequest(), target.address)
        return bool(response.flushed)

    async def server_info(self) -> dict[str, Any]:
        target = self._control_target()
        response = await self._call(target.stub.GetLoad, worker_pb2.GetLoadRequest(), target.address)
        return load_from_proto(response.load)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await aio.cancel_and_wait(self._card_task)
        await self.watcher.close()
        self._tok_sync_channel.close()


class LaneCall:
    """A lane stream read as the gRPC call it replaces: `read` gives grpc.aio.EOF at the end."""

    def __init__(self, stream: LaneStream[worker_pb2.GenerateResponse]) -> None:
        self.stream = stream

    async def read(self) -> Any:
        msg = await self.stream.read()
        return grpc.aio.EOF if msg is None else msg

    def cancel(self) -> None:
        self.stream.cancel()


def _unreachable(exc: grpc.RpcError) -> bool:
    """The call failed in transport (the peer is gone or not listening), not with a service's own error."""
    code = exc.code() if hasattr(exc, "code") else None
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not _carries_error(exc)


def _carries_error(exc: grpc.RpcError) -> bool:
    """The status came from a radixmesh service's own error (with its detail trailer), not from the transport."""
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(key == ERROR_METADATA_KEY for key, _ in (metadata or ()))


def _make_card(info: worker_pb2.GetModelInfoResponse, tok: tokenizer_pb2.GetTokenizerInfoResponse,
               served_model_name: str | None, backend: GrpcBackend) -> ModelCard:
    """The served model as `radixmesh serve` describes it: the workers' engine flags, the worker's
    model path and the tokenizer service's tokenizer path (what clients load to count tokens)."""
    name = served_model_name or info.model_name
    aliases = {info.model_name, *info.aliases} - {name}
    extra: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        extra.update(json.loads(info.engine_config_json or "{}"))
    extra.update({"backend": "grpc", backend.target_kind: backend.target_address,
                  "tokenizer_address": backend.tokenizer_address, "tokenizer_fingerprint": tok.fingerprint})
    return ModelCard(name=name, aliases=frozenset(aliases), model_path=info.model_path,
                     tokenizer_path=tok.tokenizer_path, context_len=info.context_len, vocab_size=info.vocab_size,
                     max_running_requests=info.max_running_requests, created=int(time.time()), extra=extra,
                     has_image_understanding=info.has_image_understanding and tok.accepts_images)
