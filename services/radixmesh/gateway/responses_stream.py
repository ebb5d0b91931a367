"""The Responses API's output items, and its stream of events for one run.

    response.created, response.in_progress
    per item: response.output_item.added, then
        reasoning:     response.reasoning_text.delta ... .done
        message:       response.content_part.added, response.output_text.delta ... .done, response.content_part.done
        function_call: response.function_call_arguments.delta ... .done
    response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut the answer)

Every event is an SSE frame `event: <type>` with `{"type", "sequence_number", ...}` as data.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from radixmesh.common.errors import RadixMeshError
from radixmesh.gateway.errors import to_http
from radixmesh.gateway.openai_convert import usage as chat_usage
from radixmesh.gateway.responses_protocol import IncompleteDetails, InputTokensDetails, ResponseObject, ResponsesUsage
from radixmesh.gateway.tools.output import OutputDelta

if TYPE_CHECKING:
    from radixmesh.gateway.openai_api import ChatRun


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "role": "assistant", "status": status,
            "content": [output_text(text)] if status == "completed" else []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def finished(base: ResponseObject, items: list[dict[str, Any]], finish_reason: str | None,
             run: ChatRun) -> ResponseObject:
    """The response once the answer is complete."""
    usage = chat_usage(run.states, 1)
    incomplete = finish_reason == "length"
    return base.model_copy(update={
        "status": "incomplete" if incomplete else "completed", "output": items,
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        "usage": ResponsesUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                total_tokens=usage.total_tokens,
                                input_tokens_details=InputTokensDetails(
                                    cached_tokens=usage.prompt_tokens_details.cached_tokens))})


class ResponseEvents:
    """Turns one run's growing answer into the event stream; `frames()` is the SSE body."""

    def __init__(self, run: ChatRun, base: ResponseObject) -> None:
        self.run, self.base = run, base
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        """The item receiving deltas (its text so far under "_text")."""
        self.calls: dict[int, dict[str, Any]] = {}
        """Call index -> its function_call item."""

    def _frame(self, kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, ensure_ascii=False)
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def _response(self, response: ResponseObject) -> dict[str, Any]:
        return json.loads(response.model_dump_json())

    async def frames(self) -> AsyncGenerator[str, None]:
        yield self._frame("response.created", response=self._response(self.base))
        yield self._frame("response.in_progress", response=self._response(self.base))
        finish_reason = None
        try:
            async for _, chunk in self.run.generation.stream():
                self.run.states[0].add(chunk)
                for frame in self._deltas(self.run.outputs[0].feed(chunk.text, final=chunk.finished)):
                    yield frame
                if chunk.finished:
                    finish_reason = chunk.finish_reason
        except RadixMeshError as exc:
            error = to_http(exc)[1]["error"]
            yield self._frame("error", code=error["code"], message=error["message"], param=error["param"])
            return
        if not self.items:  # an empty answer is one empty message, as the whole response shows it
            for frame in self._text_delta("message", ""):
                yield frame
        for frame in self._close():
            yield frame
        done = finished(self.base, self.items, finish_reason, self.run)
        kind = "response.incomplete" if done.status == "incomplete" else "response.completed"
        yield self._frame(kind, response=self._response(done))

    def _deltas(self, delta: OutputDelta) -> list[str]:
        frames: list[str] = []
        if delta.reasoning:
            frames += self._text_delta("reasoning", delta.reasoning)
        if delta.content:
            frames += self._text_delta("message", delta.content)
        for call in delta.calls:
            if call.id is not None:
                frames += self._close()
                item = function_call_item(call.id, call.name or "", "", "in_progress")
                frames.append(self._added(item))
                self.calls[call.index] = self.open = item
            item = self.calls[call.index]
            if call.arguments:
                item["arguments"] += call.arguments
                frames.append(self._frame("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self._index(item), delta=call.arguments))
        return frames

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _added(self, item: dict[str, Any]) -> str:
        self.items.append(item)
        return self._frame("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _text_delta(self, kind: str, text: str) -> list[str]:
        frames: list[str] = []
        if self.open is None or self.open["type"] != kind:
            frames += self._close()
            item = reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            frames.append(self._added(item))
            item["_text"] = ""
            self.open = item
            if kind == "message":
                frames.append(self._frame("response.content_part.added", item_id=item["id"],
                                          output_index=self._index(item), content_index=0, part=output_text("")))
        item = self.open
        item["_text"] += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        frames.append(self._frame(event, item_id=item["id"], output_index=self._index(item), content_index=0,
                                  delta=text, **extra))
        return frames

    def _close(self) -> list[str]:
        """End the open item: its done events, and the item in its final shape."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, frames = self._index(item), []
        if item["type"] == "function_call":
            frames.append(self._frame("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      arguments=item["arguments"], name=item["name"]))
            item["status"] = "completed"
        else:
            text = item.pop("_text")
            final = reasoning_item(text, item_id=item["id"]) if item["type"] == "reasoning" \
                else message_item(text, item_id=item["id"])
            if item["type"] == "reasoning":
                frames.append(self._frame("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=text))
            else:
                frames.append(self._frame("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=text, logprobs=[]))
                frames.append(self._frame("response.content_part.done", item_id=item["id"], output_index=index,
                                          content_index=0, part=output_text(text)))
            item.clear()
            item.update(final)
        frames.append(self._frame("response.output_item.done", output_index=index, item=dict(item)))
        return frames
