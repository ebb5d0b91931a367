"""Backends that drive radixmesh's public gRPC API (radixmesh.v1.InferenceService): `grpc` streams
StreamComplete, `grpc-chat` streams StreamChat. Requests carry the same fields as the `openai` and
`openai-chat` backends' JSON bodies, so one workload compares the two protocols on one gateway.

The HTTP base URL still serves the model's name and tokenizer (GET /v1/models, /model_info) and
/flush_cache; the gRPC target is `--grpc-target HOST:PORT` (`grpc=HOST:PORT` of an --endpoint), over
TLS with `--grpc-ca`. An `Authorization` header becomes the call's `authorization` metadata.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import grpc.aio

from loadtests.client import BaseBackend, RequestInput, StreamOutcome, Usage, render_history_text
from radixmesh.protocol import inference_pb2 as pb
from radixmesh.protocol import inference_pb2_grpc

ERROR_DETAIL_CHARS = 500


class GrpcBackend(BaseBackend):
    """Common part: the channel (opened in the run's event loop), metadata, error and usage handling."""

    path = ""

    def __init__(self, base_url: str, model: str | None = None, headers: dict[str, str] | None = None,
                 extra_body: dict[str, Any] | None = None, grpc_target: str | None = None,
                 grpc_ca: str | None = None) -> None:
        super().__init__(base_url, model, headers, extra_body)
        if not grpc_target:
            raise ValueError(f"backend {self.name} needs the gRPC API's address: --grpc-target HOST:PORT "
                             "(or grpc=HOST:PORT in --endpoint)")
        if extra_body:
            raise ValueError(f"backend {self.name} sends typed messages; extra JSON fields cannot be added")
        self.grpc_target = grpc_target
        self.grpc_ca = grpc_ca
        auth = {k.lower(): v for k, v in (headers or {}).items()}.get("authorization")
        self.metadata = (("authorization", auth),) if auth else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: inference_pb2_grpc.InferenceServiceStub | None = None

    def build_payload(self, req: RequestInput) -> dict[str, Any]:
        raise NotImplementedError("gRPC backends build messages (see build_request)")

    def parse_event(self, event: dict[str, Any], text_so_far: str, usage: Usage) -> str:
        raise NotImplementedError("gRPC backends read messages")

    def _stub_now(self) -> inference_pb2_grpc.InferenceServiceStub:
        if self._stub is None:
            if self.grpc_ca:
                with open(self.grpc_ca, "rb") as ca:
                    self._channel = grpc.aio.secure_channel(self.grpc_target, grpc.ssl_channel_credentials(ca.read()))
            else:
                self._channel = grpc.aio.insecure_channel(self.grpc_target)
            self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        return self._stub

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel, self._stub = None, None

    def options(self, req: RequestInput) -> pb.GenerationOptions:
        options = pb.GenerationOptions(max_tokens=req.turn.output_len, temperature=0.0)
        if req.turn.ignore_eos:
            options.ignore_eos = True
        if req.turn.response_format is not None:
            options.json_schema = json.dumps(req.turn.response_format.get("json_schema", {}).get("schema", {}))
        return options

    def call(self, stub: inference_pb2_grpc.InferenceServiceStub, req: RequestInput, timeout_s: float | None) -> Any:
        raise NotImplementedError

    async def send(self, http: Any, req: RequestInput) -> StreamOutcome:
        timeout = getattr(getattr(http, "timeout", None), "total", None)
        start = time.perf_counter()
        outcome = StreamOutcome(success=False, start=start, end=start)
        try:
            async for message in self.call(self._stub_now(), req, timeout):
                new_text = "".join(self.texts(message))
                if new_text:
                    outcome.chunk_times.append(time.perf_counter())
                    outcome.text += new_text
                if message.HasField("usage"):
                    u = message.usage
                    outcome.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
            outcome.success = True
        except grpc.aio.AioRpcError as exc:
            outcome.error = f"gRPC {exc.code().name}: {(exc.details() or '')[:ERROR_DETAIL_CHARS]}"
        outcome.end = time.perf_counter()
        return outcome

    def texts(self, message: Any) -> list[str]:
        raise NotImplementedError


class GrpcCompletionsBackend(GrpcBackend):
    name = "grpc"

    def call(self, stub: inference_pb2_grpc.InferenceServiceStub, req: RequestInput, timeout_s: float | None) -> Any:
        request = pb.CompleteRequest(model=self.model if self.model != "default" else "", options=self.options(req))
        if isinstance(req.turn.prompt, list):
            assert not req.history, "token-id prompts cannot carry a history"
            request.token_ids.ids.extend(req.turn.prompt)
        else:
            request.text = render_history_text(req)
        return stub.StreamComplete(request, metadata=self.metadata, timeout=timeout_s)

    def texts(self, message: pb.CompleteResponse) -> list[str]:
        return [c.text for c in message.choices[:1]]


class GrpcChatBackend(GrpcBackend):
    name = "grpc-chat"
    supports_token_ids = False

    def call(self, stub: inference_pb2_grpc.InferenceServiceStub, req: RequestInput, timeout_s: float | None) -> Any:
        assert isinstance(req.turn.prompt, str), "the chat backend sends text only"
        turns = []
        for user, reply in req.history:
            turns += [pb.ChatTurn(role="user", content=user), pb.ChatTurn(role="assistant", content=reply)]
        turns.append(pb.ChatTurn(role="user", content=req.turn.prompt))
        request = pb.ChatRequest(model=self.model if self.model != "default" else "", messages=turns,
                                 options=self.options(req))
        return stub.StreamChat(request, metadata=self.metadata, timeout=timeout_s)

    def texts(self, message: pb.ChatResponse) -> list[str]:
        return [c.content for c in message.choices[:1]]


GRPC_BACKENDS: dict[str, type[GrpcBackend]] = {b.name: b for b in (GrpcCompletionsBackend, GrpcChatBackend)}
