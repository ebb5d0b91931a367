"""Small factories for scheduler tests: a tiny random Llama run in-process on CPU."""

from __future__ import annotations

import random
import uuid
from typing import Any

import torch

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import PreparedModel
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams

VOCAB = 101


def tiny_model_config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=32,
                                  intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                  max_position_embeddings=256, eos_token_ids=())
    fields.update(overrides)
    return ModelConfig(**fields)


class Collector:
    """Gathers the scheduler's outputs per request id."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.cached: dict[str, int] = {}
        self.errors: dict[str, str] = {}

    def __call__(self, outputs: list[TokenOut]) -> None:
        for out in outputs:
            self.tokens.setdefault(out.rid, []).extend(out.token_ids)
            self.cached[out.rid] = out.cached_tokens
            if out.finish_reason:
                assert out.rid not in self.finish, f"{out.rid} finished twice"
                self.finish[out.rid] = out.finish_reason
            if out.error:
                self.errors[out.rid] = out.error


def make_scheduler(model_config: ModelConfig | None = None, tokenizer: Any = None,
                   **overrides: Any) -> tuple[Scheduler, Collector]:
    settings: dict[str, Any] = dict(device="cpu", dtype="float32", max_total_tokens=4096,
                                    max_running_requests=32, load_format="dummy")
    settings.update(overrides)
    config = EngineConfig(**settings).resolve()
    mc = model_config or tiny_model_config()
    prepared = PreparedModel(model_path=None, config=mc, load_format="dummy", name="tiny", tokenizer_path=None)
    runner = ModelRunner(config, prepared)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        # Wide random weights give well-separated logits, so greedy paths are stable across batchings.
        for name, param in runner.model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    collector = Collector()
    return Scheduler(config, runner, tokenizer, collector), collector


def make_requests(num: int, seed: int = 0, shared_prefix_len: int = 0, max_new_tokens: int = 12,
                  prompt_len: tuple[int, int] = (3, 20), **params: Any) -> list[Req]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix_len)]
    reqs = []
    for _ in range(num):
        ids = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(*prompt_len))]
        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params)
        reqs.append(Req(rid=uuid.uuid4().hex[:8], origin_input_ids=ids, params=sp))
    return reqs


def clone(req: Req) -> Req:
    return Req(rid=req.rid, origin_input_ids=list(req.origin_input_ids), params=req.params,
               prefill_only=req.prefill_only)


def run_until_idle(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_work:
        assert steps < max_steps, "scheduler did not finish"
        sched.step()
        steps += 1
    return steps


def assert_no_leak(sched: Scheduler) -> None:
    kv = sched.kv
    tree = kv.tree
    assert tree.protected_size() == 0, "a finished request left its prefix locked"
    assert kv.allocator.available_size() + tree.total_size() == kv.capacity, "KV slots leaked"
    assert kv.req_pool.available_size() == kv.req_pool.size, "request rows leaked"
    assert kv.used_tokens() == 0


def single_run_outputs(reqs: list[Req], model_config: ModelConfig | None = None) -> dict[str, list[int]]:
    """Each request alone (no chunking, no cache): the outputs every batching must reproduce."""
    out: dict[str, list[int]] = {}
    for req in reqs:
        sched, col = make_scheduler(model_config, chunked_prefill_size=-1, disable_radix_cache=True)
        sched.add_request(clone(req))
        run_until_idle(sched)
        out[req.rid] = col.tokens[req.rid]
    return out
