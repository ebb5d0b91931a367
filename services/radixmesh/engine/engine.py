"""`radixmesh.Engine`: the in-process Python API for offline batches and streaming.

The scheduler runs in its own process; this object keeps an asyncio loop on a
background thread that talks to it through `EngineClient`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import msgspec

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.mm.loading import image_sources
from radixmesh.engine.mm.prompt import MultimodalProcessor, text_only_error
from radixmesh.engine.output import GenerationResult
from radixmesh.wire.images import MultimodalInputs
from radixmesh.wire.sampling import SamplingParams

T = TypeVar("T")
Prompt = str | list[int]
ImageData = str | bytes | list[str | bytes]
"""A prompt's images as SGLang's `image_data`: base64 data: URLs or strings, or encoded image bytes."""


class Engine:
    """Offline generation: `Engine(model=None).generate("Hello", {"max_new_tokens": 16})`.

    Keyword arguments are `EngineConfig` fields (max_total_tokens, chunked_prefill_size, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise invalid_argument(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixmesh-engine", daemon=True)
        self._thread.start()
        try:
            self.client: EngineClient = self._run(EngineClient.start(EngineConfig(model=model, **kwargs)))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self.tokenizer = self.client.tokenizer
        prepared = self.client.prepared
        self.images = MultimodalProcessor.for_model(prepared.config, [prepared.model_path, prepared.tokenizer_path],
                                                    self.tokenizer)
        """Loads and places the images of prompts (None: a text-only model)."""

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    # ---- generation -------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise invalid_argument("this model has no tokenizer; pass input_ids", "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat conversation, ready for the assistant's turn."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise invalid_argument("this model has no chat template", "messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prepare_prompt(self, prompt: Prompt, image_data: ImageData | None = None,
                       param: str = "image_data") -> tuple[list[int], MultimodalInputs | None]:
        """Token ids of a prompt with its images' placeholders expanded, and the preprocessed images."""
        ids = self.encode(prompt)
        sources = image_sources(image_data, param)
        if not sources:
            return ids, None
        if self.images is None:
            raise text_only_error(self.client.prepared.name, sources)
        placed = self.images.prepare_ids(ids, sources, "prompt")
        return placed.input_ids, placed.mm

    def generate(self, prompt: Prompt | list[Prompt], sampling_params: dict[str, Any] | SamplingParams
                 | None = None, image_data: ImageData | list[ImageData | None] | None = None,
                 lora_path: str | list[str | None] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """One result dict for one prompt (a list when n > 1); a list for a list of prompts.

        `image_data`: the prompt's images (a list of them per prompt for a list of prompts); the prompt
        holds the model's image placeholder once per image (`<image>`, `<|vision_start|><|image_pad|>...`).
        `lora_path`: the loaded LoRA adapter to run with (one per prompt for a list; None: the base model).
        """
        params = _as_params(sampling_params)
        single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
        prompts: list[Prompt] = [prompt] if single else list(prompt)  # type: ignore[arg-type, list-item]
        per_prompt: list[Any] = [image_data] if single else list(image_data or [None] * len(prompts))
        if len(per_prompt) != len(prompts):
            raise invalid_argument(f"got image_data for {len(per_prompt)} prompts, not {len(prompts)}", "image_data")
        placed = [self.prepare_prompt(p, images, f"image_data[{i}]" if not single else "image_data")
                  for i, (p, images) in enumerate(zip(prompts, per_prompt))]
        loras = _per_prompt_lora(lora_path, len(prompts))
        for (ids, mm), lora in zip(placed, loras):
            self.client.validate(ids, params, mm=mm, lora=lora)
        results = self._run(self._generate_all(placed, params, loras))
        if single and params.n == 1:
            return results[0]
        return results

    async def _generate_all(self, prompts: list[tuple[list[int], MultimodalInputs | None]],
                            params: SamplingParams, loras: list[str | None]) -> list[dict[str, Any]]:
        if params.n > 1:
            await asyncio.gather(*(self.client.cache_prefix(ids, mm, lora)
                                   for (ids, mm), lora in zip(prompts, loras)))
        jobs = [self._collect(ids, branch, mm, lora) for (ids, mm), lora in zip(prompts, loras)
                for branch in self.client.branch_params(params)]
        return list(await asyncio.gather(*jobs))

    async def _collect(self, input_ids: list[int], params: SamplingParams,
                       mm: MultimodalInputs | None = None, lora: str | None = None) -> dict[str, Any]:
        result: GenerationResult | None = None
        async for chunk in self.client.generate(input_ids, params, mm=mm, lora=lora):
            result = result or GenerationResult(chunk.rid, input_ids=input_ids)
            result.add(chunk)
        assert result is not None
        return result.to_dict()

    def generate_stream(self, prompt: Prompt, sampling_params: dict[str, Any] | SamplingParams
                        | None = None, image_data: ImageData | None = None) -> Iterator[dict[str, Any]]:
        """Yield {"text": delta, "token_ids": [...], "finish_reason": ...} as tokens arrive."""
        params = _as_params(sampling_params)
        if params.n != 1:
            raise invalid_argument("streaming supports n=1 only", "n")
        ids, mm = self.prepare_prompt(prompt, image_data)
        agen = self.client.generate(ids, params, mm=mm)
        try:
            while True:
                try:
                    chunk = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield {"text": chunk.text, "token_ids": chunk.token_ids,
                       "finish_reason": chunk.finish_reason, "cached_tokens": chunk.cached_tokens}
        finally:
            self._run(agen.aclose())

    # ---- control ----------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return self._run(self.client.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return self._run(self.client.get_server_info())

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load the PEFT adapter at `lora_path` as `lora_name` (its rank, targets and load time)."""
        return self._run(self.client.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._run(self.client.unload_lora_adapter(lora_name))

    def list_lora_adapters(self) -> list[dict[str, Any]]:
        return self._run(self.client.list_lora_adapters())

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._run(self.client.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt_lora(lora_path: str | list[str | None] | None, num_prompts: int) -> list[str | None]:
    if not isinstance(lora_path, list):
        return [lora_path] * num_prompts
    if len(lora_path) != num_prompts:
        raise invalid_argument(f"got lora_path for {len(lora_path)} prompts, not {num_prompts}", "lora_path")
    return lora_path


def _as_params(params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    fields = set(SamplingParams.__struct_fields__)
    unknown = set(params) - fields
    if unknown:
        raise invalid_argument(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}",
                               sorted(unknown)[0])
    converted = dict(params)
    if isinstance(converted.get("stop"), str):
        converted["stop"] = (converted["stop"],)
    for key in ("stop", "stop_token_ids"):
        if key in converted and converted[key] is not None:
            converted[key] = tuple(converted[key])
    if "logit_bias" in converted:
        converted["logit_bias"] = {int(k): float(v) for k, v in (converted["logit_bias"] or {}).items()}
    if isinstance(converted.get("json_schema"), dict):
        converted["json_schema"] = json.dumps(converted["json_schema"])
    try:
        return msgspec.convert(converted, SamplingParams)
    except msgspec.ValidationError as exc:
        raise invalid_argument(f"invalid sampling parameters: {exc}") from None
