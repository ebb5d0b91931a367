"""`radixmesh grammar` processes over one real Redis: compile once, share through Redis, and
workers that fetch from the service (or compile themselves when it is down)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import grpc
import jsonschema
import pytest
import redis

from radixmesh.common.errors import ErrorCode
from radixmesh.common.grpc_errors import from_rpc_error
from radixmesh.engine.grammar.spec import GrammarSpec
from radixmesh.engine.grammar.xgrammar_backend import XGrammarBackend
from radixmesh.engine.request import Req
from radixmesh.gateway.tools.base import ToolSpec
from radixmesh.gateway.tools.constraint import tool_call_tag
from radixmesh.gateway.tools.registry import tool_parser
from radixmesh.gateway.tools.stream import ToolCallStream
from radixmesh.index.redis_server import LocalRedis
from radixmesh.protocol import grammar_pb2, grammar_pb2_grpc
from radixmesh.wire.fingerprint import tokenizer_fingerprint
from radixmesh.wire.sampling import SamplingParams
from tests.integration.service_procs import ServiceProc, start_service, stop_all, wait_all_ready
from tests.ports import free_port
from tests.redis_helpers import local_redis  # noqa: F401  (fixture)
from tests.unit.scheduler_factory import assert_no_leak, make_scheduler, run_until_idle, tiny_model_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VOCAB, EOS = 49152, 2
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                           "population_millions": {"type": "integer", "minimum": 1, "maximum": 40}},
          "required": ["city", "population_millions"]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from radixmesh.engine.hf_tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def services(local_redis: LocalRedis) -> Iterator[tuple[ServiceProc, ServiceProc]]:  # noqa: F811
    """Two grammar service replicas sharing one Redis, started together."""
    replicas = [start_service("grammar", ["--redis-url", local_redis.url, "--metrics-port", "-1"], wait_ready=False)
                for _ in range(2)]
    wait_all_ready(replicas)
    yield replicas[0], replicas[1]
    assert stop_all(replicas) == [0, 0]


def compile_call(address: str, request: grammar_pb2.CompileRequest) -> grammar_pb2.CompileResponse:
    with grpc.insecure_channel(address) as channel:
        response: grammar_pb2.CompileResponse = grammar_pb2_grpc.GrammarServiceStub(channel).Compile(request,
                                                                                                     timeout=60)
        return response


def schema_request(tokenizer, schema: dict) -> grammar_pb2.CompileRequest:
    return grammar_pb2.CompileRequest(kind=grammar_pb2.GRAMMAR_KIND_JSON_SCHEMA, spec=json.dumps(schema, indent=2),
                                      tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), vocab_size=VOCAB,
                                      stop_token_ids=[EOS])


def test_compiled_once_then_shared_through_redis(services, local_redis, tokenizer):  # noqa: F811
    first, second = services
    schema = {**SCHEMA, "title": uuid.uuid4().hex}  # new content for this test run
    compiled = compile_call(first.address, schema_request(tokenizer, schema))
    assert compiled.source == grammar_pb2.GRAMMAR_SOURCE_COMPILED and compiled.compile_ms > 0
    again = compile_call(first.address, schema_request(tokenizer, schema))
    assert again.source == grammar_pb2.GRAMMAR_SOURCE_MEMORY and again.compile_ms == 0
    shared = compile_call(second.address, schema_request(tokenizer, schema))
    assert shared.source == grammar_pb2.GRAMMAR_SOURCE_REDIS
    assert shared.content_key == compiled.content_key and shared.compiled_grammar == compiled.compiled_grammar

    backend = XGrammarBackend(tokenizer, VOCAB, [EOS])
    spec = GrammarSpec.parse("json_schema", json.dumps(schema))
    assert compiled.content_key == spec.content_key(tokenizer_fingerprint(tokenizer), backend.serialization_version,
                                                    VOCAB, [EOS])
    client = redis.Redis.from_url(local_redis.url)
    assert client.get(f"radixmesh:grammar:{compiled.content_key}") == compiled.compiled_grammar
    assert 0 < client.ttl(f"radixmesh:grammar:{compiled.content_key}") <= 7 * 24 * 3600
    matcher = backend.new_matcher(backend.deserialize(compiled.compiled_grammar))
    assert matcher.find_jump_forward_string() == '{"city": "'  # the fetched grammar is the schema's


@pytest.mark.parametrize("field, value, words", [
    ("spec", "a[", "regex"),
    ("tokenizer_fingerprint", "0" * 64, "tokenizer_fingerprint"),
])
def test_bad_requests_are_invalid_argument(services, tokenizer, field, value, words):
    request = grammar_pb2.CompileRequest(kind=grammar_pb2.GRAMMAR_KIND_REGEX, spec="a+",
                                         tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    setattr(request, field, value)
    with pytest.raises(grpc.RpcError) as info:
        compile_call(services[0].address, request)
    error = from_rpc_error(info.value)
    assert error.code is ErrorCode.INVALID_ARGUMENT and words in error.message, error.message


def _run_one(tokenizer, grammar_service: str, **grammar: str) -> tuple[dict, str]:
    sched, col = make_scheduler(tiny_model_config(vocab_size=VOCAB, eos_token_ids=(EOS,)), tokenizer=tokenizer,
                                grammar_service=grammar_service, grammar_compile_timeout=60.0)
    req = Req(rid="r", origin_input_ids=[1, 2, 3], params=SamplingParams(
        max_new_tokens=96, temperature=1.0, seed=3, **(grammar or {"json_schema": json.dumps(SCHEMA)})))
    sched.add_request(req)
    run_until_idle(sched)
    assert col.finish["r"] == "stop"
    assert_no_leak(sched)
    return sched.stats(), tokenizer.decode(col.tokens["r"], skip_special_tokens=True)


def test_worker_fetches_from_the_service(services, tokenizer):
    stats, text = _run_one(tokenizer, services[1].address)
    assert stats["num_grammars_fetched"] == 1 and stats["num_grammars_compiled"] == 0
    assert stats["num_grammar_service_failures"] == 0
    jsonschema.validate(json.loads(text), SCHEMA)


def test_worker_fetches_a_tool_call_tag_from_the_service(services, tokenizer):
    """tool_choice required as the gateway sends it: a structural tag, compiled by the service; the random-weight
    model's answer is still one call of the tool with valid arguments."""
    tag = tool_call_tag(tool_parser("hermes").syntax, [ToolSpec("get_population", "", SCHEMA)], "required", False)
    stats, text = _run_one(tokenizer, services[0].address, structural_tag=tag)
    assert stats["num_grammars_fetched"] == 1 and stats["num_grammars_compiled"] == 0
    calls = ToolCallStream(tool_parser("hermes"))
    calls.update(text, final=True)
    assert [call.name for call in calls.calls] == ["get_population"] and not calls.content
    jsonschema.validate(json.loads(calls.calls[0].arguments), SCHEMA)


def test_worker_compiles_locally_when_the_service_is_down(tokenizer):
    stats, text = _run_one(tokenizer, f"127.0.0.1:{free_port()}")  # nothing listens there
    assert stats["num_grammars_fetched"] == 0 and stats["num_grammars_compiled"] == 1
    assert stats["num_grammar_service_failures"] == 1
    jsonschema.validate(json.loads(text), SCHEMA)
