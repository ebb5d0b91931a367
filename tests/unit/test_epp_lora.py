"""The endpoint picker and LoRA adapters: the adapter a body names, its block hashes (the adapter's extra key), and
picks narrowed to the workers holding it, as the router's own Generate calls are."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.router.adapters import AdapterAffinity
from radixmesh.router.config import AdapterConfig
from radixmesh.router.epp.config import EppConfig
from radixmesh.router.epp.picker import EndpointPicker
from radixmesh.router.epp.prompt import PromptInput, prompt_of
from radixmesh.router.epp.tokens import PromptTokenizer
from radixmesh.router.policies import create_policy
from radixmesh.router.policies.base import RouteRequest
from radixmesh.wire.block_hash import block_hashes
from radixmesh.wire.lora import adapter_extra_key

from .router_factory import BLOCK, make_config, make_registry, set_load


@pytest.mark.parametrize(("data", "model"), [
    ({"model": "base:sql", "prompt": "x"}, "base:sql"),
    ({"model": "sql", "messages": [{"role": "user", "content": "x"}]}, "sql"),
    ({"text": "x", "lora_path": "chat"}, "chat"),
    ({"text": ["x", "y"], "lora_path": ["chat", None]}, "chat"),
    ({"model": "base", "lora_path": None, "input_ids": [1]}, "base"),
    ({"prompt": "x"}, ""),
    ({"model": 3, "prompt": "x"}, ""),
    ({"model": "sql", "messages": [{"role": "tool", "content": "x"}]}, "sql"),  # no prompt, still a model
])
def test_the_model_a_body_names(data: dict[str, object], model: str) -> None:
    assert prompt_of(json.dumps(data).encode()).model == model


def test_an_adapters_block_hashes_take_its_extra_key() -> None:
    tokenizer = PromptTokenizer(None, BLOCK, 1.0)
    ids = list(range(3 * BLOCK))
    prompt = PromptInput("ids", token_ids=tuple(ids))
    base = asyncio.run(tokenizer.tokens(prompt))
    sql = asyncio.run(tokenizer.tokens(prompt, "sql"))
    assert base.block_hashes == tuple(block_hashes(ids, BLOCK))
    assert sql.block_hashes == tuple(block_hashes(ids, BLOCK, adapter_extra_key("sql")))
    assert sql.block_hashes != base.block_hashes and sql.num_tokens == base.num_tokens == len(ids)


def _picker() -> EndpointPicker:
    config = make_config()
    registry = make_registry(3)
    for i, worker in enumerate(sorted(registry.all(), key=lambda w: w.worker_id)):
        worker.http_port = 8000 + i
        held = {0: ("sql",), 1: ("chat",), 2: ()}[i]
        set_load(worker, lora_adapters=tuple((n, 0, 0) for n in held), max_loras_per_batch=2)
    return EndpointPicker(EppConfig(port=0), registry, create_policy("round-robin", config),
                          AdapterAffinity(AdapterConfig()))


def test_picks_for_an_adapter_go_to_a_worker_holding_it() -> None:
    picker = _picker()
    assert picker.adapter_of("base:sql") == "sql" and picker.adapter_of("chat") == "chat"
    assert picker.adapter_of("base") == "" and picker.adapter_of("") == ""

    async def picks(adapter: str) -> set[str]:
        endpoints = set()
        for i in range(6):
            pick = await picker.pick(dataclasses.replace(RouteRequest(f"r{i}", 4, (), BLOCK), lora_name=adapter))
            endpoints.add(pick.endpoints[0])
            picker.release(pick)
        return endpoints

    assert asyncio.run(picks("sql")) == {"127.0.0.1:8000"}
    assert asyncio.run(picks("chat")) == {"127.0.0.1:8001"}
    assert len(asyncio.run(picks(""))) == 3  # the base model: every worker
    with pytest.raises(RadixMeshError) as err:
        asyncio.run(picks("ghost"))
    assert err.value.code is ErrorCode.NOT_FOUND and "'ghost'" in err.value.message
