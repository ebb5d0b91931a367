"""The served model's description, read by the cluster gateway once the tokenizer service and a Generate target
answer (readiness item "model"); a failure is retried on the next change of the upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from radixmesh.common import aio
from radixmesh.common.errors import RadixMeshError
from radixmesh.common.gc_tuning import freeze_startup_objects
from radixmesh.common.readiness import Readiness
from radixmesh.gateway.backend import ModelCard
from radixmesh.gateway.generate_upstream import GenerateUpstream, call_control
from radixmesh.gateway.tokenizer_upstream import TokenizerUpstream
from radixmesh.protocol import tokenizer_pb2, worker_pb2
from radixmesh.wire.block_hash import DEFAULT_BLOCK_SIZE

logger = logging.getLogger(__name__)
RETRY_S = 1.0
"""Nothing answered: how long until the card is looked for again."""


class ModelCardReader:
    """Reads the `ModelCard` once both sides are up (and, tokenizing or detokenizing locally, copies the tokenizer
    first)."""

    def __init__(self, tokenizer: TokenizerUpstream, generation: GenerateUpstream, readiness: Readiness,
                 served_model_name: str | None) -> None:
        self.tokenizer = tokenizer
        self.generation = generation
        self.readiness = readiness
        self.served_model_name = served_model_name
        self.card: ModelCard | None = None
        self._task: asyncio.Task[None] | None = None
        self._callbacks: list[Callable[[ModelCard], None]] = []
        self.closed = False

    def on_upstream_change(self) -> None:
        """An upstream went up or down: start reading the card if both sides are up and it is not known yet."""
        fetching = self._task is not None and not self._task.done()
        if self.card is None and self.tokenizer.group.up and self.generation.group.up and not self.closed \
                and not fetching:
            self._task = asyncio.get_running_loop().create_task(self._fetch())

    def when_known(self, callback: Callable[[ModelCard], None]) -> None:
        if self.card is not None:
            callback(self.card)
        else:
            self._callbacks.append(callback)

    async def _fetch(self) -> None:
        if "model" not in self.readiness:
            self.readiness.add("model", f"the model's description from the {self.generation.target_kind}",
                               detail="being read")
        for target in self.generation.group.ready():
            try:
                info = await call_control(target.stub.GetModelInfo, worker_pb2.GetModelInfoRequest(), target.address)
                tok = await call_control(self.tokenizer.stub.GetTokenizerInfo, tokenizer_pb2.GetTokenizerInfoRequest(),
                                         self.tokenizer.address)
            except RadixMeshError as exc:
                self.readiness.set("model", False, exc.message)
                continue
            self.tokenizer.block_size = tok.block_size or DEFAULT_BLOCK_SIZE
            if self.tokenizer.wants_copy and self.tokenizer.local_tokenizer is None and self.tokenizer.pool is None:
                # Before ready: loading it holds the GIL for seconds (a large vocabulary), which would
                # stall the first requests' streams if they were already being served.
                self.readiness.set("model", False, "copying the tokenizer service's tokenizer")
                await self.tokenizer.fetch_local_tokenizer()
                freeze_startup_objects()  # the copy's vocabulary lives as long as the process
            self.card = make_card(info, tok, self.served_model_name, self.generation, self.tokenizer.address)
            self.readiness.set("model", True)
            for callback in self._callbacks:
                callback(self.card)
            logger.warning("gateway: ready: serving %s through %s and %s", self.card.name,
                           self.generation.group.description, self.tokenizer.group.description)
            return
        await asyncio.sleep(RETRY_S)  # nothing answered: look again (the watcher calls back on the next change)
        self._task = None
        self.on_upstream_change()

    async def close(self) -> None:
        self.closed = True
        await aio.cancel_and_wait(self._task)


def make_card(info: worker_pb2.GetModelInfoResponse, tok: tokenizer_pb2.GetTokenizerInfoResponse,
              served_model_name: str | None, generation: GenerateUpstream, tokenizer_address: str) -> ModelCard:
    """The served model as `radixmesh serve` describes it: the workers' engine flags, the worker's
    model path and the tokenizer service's tokenizer path (what clients load to count tokens)."""
    name = served_model_name or info.model_name
    aliases = {info.model_name, *info.aliases} - {name}
    extra: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        extra.update(json.loads(info.engine_config_json or "{}"))
    extra.update({"backend": "grpc", generation.target_kind: generation.target_address,
                  "tokenizer_address": tokenizer_address, "tokenizer_fingerprint": tok.fingerprint})
    return ModelCard(name=name, aliases=frozenset(aliases), model_path=info.model_path,
                     tokenizer_path=tok.tokenizer_path, context_len=info.context_len, vocab_size=info.vocab_size,
                     max_running_requests=info.max_running_requests, created=int(time.time()), extra=extra,
                     has_image_understanding=info.has_image_understanding and tok.accepts_images,
                     chat_template_takes_tools=tok.chat_template_takes_tools,
                     chat_template_tool_syntax=tok.chat_template_tool_syntax,
                     serves_lora=bool(extra.get("enable_lora") or extra.get("lora_paths")))
