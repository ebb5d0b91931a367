"""The contract between the HTTP layer and whatever runs the model.

The HTTP layer (OpenAI and native APIs) only ever calls a `GatewayBackend` (the gateway's backend, not an
attention or grammar backend of the engine). `LocalEngineBackend` (`radixmesh serve`) drives a scheduler
process on this machine; `ClusterBackend` (`radixmesh gateway`) sends the same calls to the tokenizer service
and the routers. Requests cross this boundary as token ids plus `SamplingParams`; results come back as
`GenerationChunk`s (text deltas already detokenized and stop-trimmed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from radixmesh.common.errors import unsupported
from radixmesh.engine.mm.prompt import MultimodalPrompt, PromptWithImages
from radixmesh.wire.images import MultimodalInputs
from radixmesh.wire.outputs import GenerationChunk
from radixmesh.wire.sampling import SamplingParams

__all__ = ["GatewayBackend", "GenerationChunk", "ModelCard", "SamplingParams"]


@dataclass(frozen=True)
class ModelCard:
    """What the gateway knows about the one model it serves."""

    name: str
    """Served name: what `/v1/models` lists and clients pass as `model`."""
    aliases: frozenset[str]
    """Other names accepted as `model` (the model's own name, its directory, the --model value)."""
    model_path: str
    """Local directory of the weights ("" for random weights of a named shape)."""
    tokenizer_path: str
    """Local directory of the tokenizer ("" when there is none)."""
    context_len: int
    """Most prompt + output tokens per sequence."""
    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    max_running_requests: int
    """Sequences the engine decodes at once; more wait in its queue."""
    created: int
    """Unix time the backend started (OpenAI's `created` of the model)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Facts of the backend shown by /server_info (engine flags, device)."""
    has_image_understanding: bool = False
    """The model takes images (chat `image_url` parts, native `image_data`)."""
    chat_template_takes_tools: bool = False
    """The chat template renders `tools`, tool calls and tool turns itself (else the gateway writes them as text)."""
    chat_template_tool_syntax: str = ""
    """The tool-call syntax the template teaches ("hermes", "mistral", "llama3-json"; "" when none is known)."""
    serves_lora: bool = False
    """LoRA adapters may be named (`model: "base:adapter"`, `lora_path`); which ones the engine decides."""

    def accepts(self, name: str) -> bool:
        return name == self.name or name in self.aliases


class GatewayBackend(ABC):
    """Runs generation for the gateway; every method may be called concurrently from one event loop.

    Errors are `RadixMeshError`s: INVALID_ARGUMENT naming the bad parameter, UNAVAILABLE when
    the model runtime is gone. `generate` must abort the request (and free its KV) when the
    caller stops iterating early, whether by `aclose()` or by task cancellation.
    """

    @property
    @abstractmethod
    def card(self) -> ModelCard:
        """The served model."""

    @property
    @abstractmethod
    def is_healthy(self) -> bool:
        """False once the model runtime died or was shut down."""

    def not_ready_reason(self) -> str:
        """"" while requests can be served; otherwise what is missing, as a 503 names it
        ("waiting for the router at host:port (not reachable: ...)")."""
        return "" if self.is_healthy else "the engine is not running"

    def when_card_known(self, callback: Callable[[ModelCard], None]) -> None:
        """Call `callback(card)` once the served model is known (now, for a backend that starts ready)."""
        callback(self.card)

    def readiness_details(self) -> dict[str, Any]:
        """What /ready shows beside the status: the dependencies and their states."""
        reason = self.not_ready_reason()
        return {"ready": not reason, "reason": reason, "dependencies": {}}

    @property
    def has_tokenizer(self) -> bool:
        return True

    # ---- text <-> tokens ------------------------------------------------------------------------
    # Prompt tokenization never blocks the event loop (a worker thread, or the tokenizer service over an
    # awaited call), and runs once per prompt: what these return is what the engine runs.
    @abstractmethod
    async def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt, with the special tokens the model expects at its start."""

    @abstractmethod
    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a conversation in the model's chat template, ready for the assistant's turn.

        Messages are {role, content} with, on assistant turns, `tool_calls` [{id, name, arguments}] and,
        on tool turns, `tool_call_id` and `name`; `tools` (OpenAI's shape) only for a template that takes
        them (`card.chat_template_takes_tools`)."""

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """A conversation as text in the model's chat template (for clients that build prompts)."""
        raise unsupported("this backend cannot render chat templates as text", "messages")

    async def tokenize_multimodal(self, prompt: PromptWithImages) -> MultimodalPrompt:
        """Token ids of a prompt with images, each image's placeholder expanded to its tokens, and the
        preprocessed images (`mm`, passed on to `validate`, `generate` and `cache_prefix`). A text-only
        model's error names the first image's request part."""
        part = prompt.images[0].part if prompt.images else "messages"
        raise unsupported(f"{part}: this backend does not take images", part)

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids (special tokens skipped)."""

    @abstractmethod
    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (special tokens kept), for logprobs."""

    # ---- generation -----------------------------------------------------------------------------
    # A prompt with images passes its `mm` (from `tokenize_multimodal`), one with a LoRA adapter its `lora`
    # (the adapter's name), as keyword arguments to the three methods below; callers pass none otherwise.
    @abstractmethod
    def validate(self, input_ids: list[int], params: SamplingParams, mm: MultimodalInputs | None = None,
                 lora: str | None = None) -> None:
        """Raise INVALID_ARGUMENT, naming the parameter, for a request the backend would refuse."""

    @abstractmethod
    def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                 mm: MultimodalInputs | None = None, lora: str | None = None) -> AsyncGenerator[GenerationChunk, None]:
        """Stream one sequence (params.n == 1); its last chunk carries the finish reason. An adapter no engine
        holds is NOT_FOUND, naming it."""

    @abstractmethod
    async def cache_prefix(self, input_ids: list[int], mm: MultimodalInputs | None = None,
                           lora: str | None = None) -> None:
        """Compute and cache a prompt's KV without generating, so n > 1 branches share it."""

    @abstractmethod
    def branch_params(self, params: SamplingParams) -> list[SamplingParams]:
        """Split params with n > 1 into n single-sequence params (derived seeds)."""

    @abstractmethod
    async def abort(self, rid: str) -> None:
        """Stop one sequence by id; its stream ends with finish_reason 'abort'. Unknown ids are ignored."""

    # ---- control ---------------------------------------------------------------------------------
    @abstractmethod
    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False when requests are running and nothing was flushed."""

    @abstractmethod
    async def server_info(self) -> dict[str, Any]:
        """Live load statistics: num_running_reqs, num_waiting_reqs, kv_used_tokens, kv_usage,
        max_total_num_tokens, cache_hit_rate, ... (names as in SGLang's /get_server_info)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop the model runtime; idempotent."""

    # ---- LoRA adapters ---------------------------------------------------------------------------
    async def list_lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters (name, path, rank, targets; in a cluster worker_ids); none by default."""
        return []

    async def load_lora_adapter(self, name: str, path: str, worker_id: str = "") -> dict[str, Any]:
        """Load the PEFT adapter at `path` as `name`: INVALID_ARGUMENT naming what is wrong with a bad one. In a
        cluster it goes to every worker serving adapters, or to `worker_id` (the answer names them: worker_ids)."""
        raise unsupported("this server does not load LoRA adapters", "lora_name")

    async def unload_lora_adapter(self, name: str, worker_id: str = "") -> dict[str, Any]:
        """Unload adapter `name` (NOT_FOUND if it is not loaded); in a cluster from every worker holding it, or
        from `worker_id` (the answer names them: worker_ids)."""
        raise unsupported("this server does not load LoRA adapters", "lora_name")

    def metric_views(self) -> list[tuple[Any, str]]:
        """Metrics of other parts running in this process, (a collector, its service label), that the gateway's
        /metrics renders too: the router's, when it routes in this process."""
        return []

    def bind_queue_time(self, histogram: Any) -> None:
        """Observe each sequence's queue wait (seconds) into `histogram`, where the backend sees the engine's
        admission (the local one); a remote backend leaves it to the workers' own metric."""
        return None
