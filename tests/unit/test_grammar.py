"""Grammar pieces without a model: specs and their checks, the mask launcher, the compile pool,
jump-forward re-tokenization (on the default model's tokenizer)."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.grammar.compile_pool import GrammarCompilePool
from radixmesh.engine.grammar.jump_forward import advance_matcher, retokenize_jump
from radixmesh.engine.grammar.registry import check_grammar_syntax
from radixmesh.engine.grammar.spec import ANY_JSON, GrammarSpec, grammar_spec, json_depth
from radixmesh.engine.grammar.vocab_mask import VocabMask, apply_vocab_mask, apply_vocab_mask_reference, unpack_mask
from radixmesh.engine.grammar.xgrammar_backend import XGrammarBackend
from radixmesh.engine.sampling.validation import validate_params
from radixmesh.wire.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TAG = json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
    {"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"}]}},
    indent=1)
"""Free text in which `<f>` opens an object of SCHEMA closed by `</f>`."""


# ---- specs -----------------------------------------------------------------------------------------
def test_spec_from_params_compacts_json_and_keeps_property_order():
    spec = grammar_spec(SamplingParams(json_schema=json.dumps(SCHEMA, indent=2)))
    assert spec == GrammarSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    assert list(json.loads(spec.source)["properties"]) == ["name", "age"]
    assert grammar_spec(SamplingParams(json_schema=ANY_JSON)) == GrammarSpec("json", "")
    assert grammar_spec(SamplingParams(regex="[a-z]+")) == GrammarSpec("regex", "[a-z]+")
    assert grammar_spec(SamplingParams()) is None


def test_content_key_depends_on_spec_tokenizer_version_and_vocab():
    spec = GrammarSpec("regex", "a+")
    key = spec.content_key("tok1", "v1", 100, [2])
    assert len(key) == 64 and key == GrammarSpec.parse("regex", "a+").content_key("tok1", "v1", 100, [2])
    others = {GrammarSpec("regex", "a*").content_key("tok1", "v1", 100, [2]),
              spec.content_key("tok2", "v1", 100, [2]), spec.content_key("tok1", "v2", 100, [2]),
              GrammarSpec("ebnf", "a+").content_key("tok1", "v1", 100, [2]),
              spec.content_key("tok1", "v1", 128, [2]), spec.content_key("tok1", "v1", 100, [2, 3])}
    assert key not in others and len(others) == 6
    assert key == hashlib.sha256(b"".join(len(p).to_bytes(8, "little") + p for p in (
        b"radixmesh-grammar-key/1", b"regex", b"a+", b"tok1", b"v1", b"100", b"2"))).hexdigest()


@pytest.mark.parametrize("params, param, words", [
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema", "JSON object"),
    ({"json_schema": '{"type": "frobnicate"}'}, "json_schema", "frobnicate"),
    ({"regex": "a[b"}, "regex", "regex"),
    ({"ebnf": 'root ::= "a" missing'}, "ebnf", "missing"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one"),
    ({"regex": "  "}, "regex", "must not be empty"),
    ({"structural_tag": "[]"}, "structural_tag", "JSON object"),
    ({"structural_tag": "{"}, "structural_tag", "not valid JSON"),
    ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag", "format"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                                                        "content": {"type": "json_schema",
                                                                                    "json_schema": {"type": 5}}}})},
     "structural_tag", "type"),
    ({"regex": "a", "structural_tag": TAG}, "structural_tag", "at most one"),
])
def test_invalid_specs_are_invalid_argument_naming_the_field(params, param, words):
    with pytest.raises(RadixMeshError) as info:
        validate_params(SamplingParams(**params), vocab_size=100)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.param == param
    assert words.lower() in info.value.message.lower(), info.value.message
    assert ".cc:" not in info.value.message  # no C++ log prefix


def test_valid_specs_pass_the_check():
    for spec in (GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("regex", r"\d{3}-[a-z]+"),
                 GrammarSpec("ebnf", 'root ::= "yes" | "no"'), GrammarSpec("json", ""),
                 GrammarSpec.parse("structural_tag", TAG)):
        check_grammar_syntax(spec)


def test_structural_tag_spec_is_compact_and_keyed_apart():
    spec = grammar_spec(SamplingParams(structural_tag=TAG))
    assert spec == GrammarSpec("structural_tag", json.dumps(json.loads(TAG), separators=(",", ":")))
    assert spec.local_key() != GrammarSpec("json_schema", spec.source).local_key()


def test_every_kind_has_a_proto_value():
    from radixmesh.engine.grammar.remote import PROTO_KINDS
    from radixmesh.engine.grammar.spec import KINDS
    from radixmesh.protocol import grammar_pb2

    assert set(PROTO_KINDS) == set(KINDS)
    assert set(PROTO_KINDS.values()) == set(grammar_pb2.GrammarKind.keys()) - {"GRAMMAR_KIND_UNSPECIFIED"}


# ---- the mask launcher -----------------------------------------------------------------------------
@pytest.mark.parametrize("batch, vocab, rows", [(1, 32, [0]), (4, 100, [1, 3]), (5, 49152, [0, 2, 3, 4])])
def test_apply_vocab_mask_matches_reference(batch, vocab, rows):
    gen = torch.Generator().manual_seed(batch * vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(batch, vocab, generator=gen)
    expected = logits.clone()
    apply_vocab_mask_reference(expected, VocabMask(mask, rows))
    apply_vocab_mask(logits, VocabMask(mask, rows))
    assert torch.equal(logits, expected)
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.isfinite(logits[untouched]).all()
    allowed = unpack_mask(mask, vocab)
    assert torch.equal(torch.isfinite(logits[rows]), allowed[rows])


def test_apply_vocab_mask_checks_its_inputs():
    logits = torch.zeros(2, 64)
    with pytest.raises(AssertionError, match="int32"):
        apply_vocab_mask(logits, VocabMask(torch.zeros(2, 2, dtype=torch.int64), [0]))
    with pytest.raises(AssertionError, match="does not pack"):
        apply_vocab_mask(logits, VocabMask(torch.zeros(2, 3, dtype=torch.int32), [0]))
    with pytest.raises(AssertionError, match="rows must be"):
        apply_vocab_mask(logits, VocabMask(torch.zeros(2, 2, dtype=torch.int32), [1, 0]))


# ---- the compile pool ------------------------------------------------------------------------------
class _CountingBackend:
    """Stands in for a backend: compiles slowly, counts compilations, refuses 'bad' specs."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = threading.Event()

    def compile(self, spec: GrammarSpec) -> object:
        self.gate.wait(5)
        self.calls.append(spec.source)
        if spec.source == "bad":
            raise RadixMeshError(ErrorCode.INVALID_ARGUMENT, "bad grammar")
        return ("compiled", spec.source)


def test_pool_compiles_identical_specs_once_and_caches_lru():
    backend = _CountingBackend()
    pool = GrammarCompilePool(lambda: backend, num_threads=2, cache_size=2)
    first, second = pool.get(GrammarSpec("regex", "a")), pool.get(GrammarSpec("regex", "a"))
    assert first is second and not first.done()  # the second joined the compilation in flight
    backend.gate.set()
    assert first.result(5) == ("compiled", "a")
    # a result seen means the key is settled: the next get is a cache hit (no sleep needed, none relied on)
    again = pool.get(GrammarSpec("regex", "a"))
    assert again is not first and again.result(0) == ("compiled", "a")
    assert backend.calls == ["a"] and pool.num_compiled == 1
    for source in ("b", "c"):  # the LRU holds 2: "a" is evicted
        pool.get(GrammarSpec("regex", source)).result(5)
    pool.get(GrammarSpec("regex", "a")).result(5)
    assert backend.calls == ["a", "b", "c", "a"]
    pool.shutdown()


def test_pool_does_not_cache_failures():
    backend = _CountingBackend()
    backend.gate.set()
    pool = GrammarCompilePool(lambda: backend, num_threads=1, cache_size=4)
    for _ in range(2):
        with pytest.raises(RadixMeshError, match="bad grammar"):
            pool.get(GrammarSpec("regex", "bad")).result(5)
    assert backend.calls == ["bad", "bad"]
    pool.shutdown()


# ---- xgrammar and jump-forward on the real tokenizer -------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from radixmesh.engine.hf_tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XGrammarBackend(tokenizer, 49152, [2])


def test_serialized_grammar_round_trips(backend):
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    again = backend.deserialize(backend.serialize(compiled))
    matcher = backend.new_matcher(again)
    assert matcher.find_jump_forward_string() == '{"name": "'
    with pytest.raises(ValueError, match="cannot load"):
        backend.deserialize(b"{}")


def test_structural_tag_compiles_and_matches(tokenizer, backend):
    compiled = backend.deserialize(backend.serialize(backend.compile(GrammarSpec.parse("structural_tag", TAG))))
    good = backend.new_matcher(compiled)
    assert good.accept_string('Sure. <f>{"name": "Ada", "age": 36}</f> done')  # type: ignore[attr-defined]
    assert good.accept_token(2) and good.is_terminated()
    bad = backend.new_matcher(compiled)
    assert not bad.accept_string('<f>{"name": 3}')  # type: ignore[attr-defined]


def test_retokenized_jump_joins_the_boundary_token(tokenizer, backend):
    matcher = backend.new_matcher(backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))))
    brace = tokenizer.encode("{", add_special_tokens=False)
    assert len(brace) == 1 and matcher.accept_token(brace[0])
    forced = matcher.find_jump_forward_string()
    assert forced == '"name": "'
    new_ids = retokenize_jump(tokenizer, brace[0], forced)
    assert new_ids is not None and tokenizer.decode(new_ids) == '{"name": "'
    assert new_ids[0] != brace[0], "the boundary was not re-tokenized"  # `{"` is one token in this vocab
    assert advance_matcher(matcher, brace[0], new_ids)
    assert matcher.find_jump_forward_string() == ""  # inside the free string now
    assert matcher.accept_token(tokenizer.encode("Bo", add_special_tokens=False)[0])


def test_advance_matcher_refusal_keeps_the_state(tokenizer, backend):
    matcher = backend.new_matcher(backend.compile(GrammarSpec("regex", "ab(c|d)")))
    a_id = tokenizer.encode("a", add_special_tokens=False)[0]
    assert matcher.accept_token(a_id)
    wrong = tokenizer.encode("ax", add_special_tokens=False)
    assert not advance_matcher(matcher, a_id, wrong)
    assert matcher.find_jump_forward_string() == "b"  # still right after "a"


def test_masks_are_the_same_from_one_thread_and_from_the_pool(tokenizer, monkeypatch):
    from radixmesh.engine.grammar import xgrammar_backend

    # rows cost microseconds; a threshold of 1 s per call keeps a loaded machine's stall from looking like cost
    monkeypatch.setattr(xgrammar_backend, "THREADED_FILL_MIN_S", 1.0)

    backend = XGrammarBackend(tokenizer, 49152, [2], num_threads=2)
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    matchers = [backend.new_matcher(compiled) for _ in range(12)]
    for matcher in matchers[::2]:
        assert matcher.accept_token(brace)  # two different states in the batch
    rows = list(range(1, 13))
    single = backend.allocate_mask(13)
    backend.fill_masks(matchers, single, rows)  # cheap rows: one thread, and the cost is measured
    assert 0 < backend._row_fill_s < xgrammar_backend.THREADED_FILL_MIN_S
    assert backend._threaded_calls == 0
    backend._row_fill_s = 1.0  # as if each row were slow: the pool takes over
    pooled = backend.allocate_mask(13)
    backend.fill_masks(matchers, pooled, rows)
    assert backend._threaded_calls == 1
    assert torch.equal(single, pooled) and torch.all(pooled[0] == -1)  # row 0 untouched
    assert not torch.equal(single[1], single[2])
    for _ in range(xgrammar_backend.RECHECK_EVERY - 2):
        backend.fill_masks(matchers, pooled, rows)
    assert backend._threaded_calls == xgrammar_backend.RECHECK_EVERY - 1
    backend.fill_masks(matchers, pooled, rows)  # the re-measuring call: one thread, cheap again
    assert backend._threaded_calls == 0 and backend._row_fill_s < xgrammar_backend.THREADED_FILL_MIN_S


# ---- the grammar service's store (memory only) ---------------------------------------------------
def test_store_memory_lru_is_bounded_in_bytes():
    import asyncio

    from radixmesh.grammar_service.store import GrammarStore, StoreConfig

    async def scenario() -> None:
        store = GrammarStore(StoreConfig(memory_bytes=10))
        await store.put("a", b"12345")
        await store.put("b", b"12345")
        assert await store.get("a") == (b"12345", "memory")  # "a" is now the most recent
        await store.put("c", b"123")  # over 10 bytes: "b" goes
        assert await store.get("b") is None and store.memory_bytes == 8
        await store.put("huge", b"x" * 11)  # larger than the whole budget: not kept
        assert await store.get("huge") is None and await store.get("c") == (b"123", "memory")
        await store.close()

    asyncio.run(scenario())


def test_json_depth_counts_levels_of_flat_and_nested_values() -> None:
    assert json_depth(7) == 0 and json_depth("text") == 0
    assert json_depth(list(range(5000))) == 1  # a prompt's token ids
    assert json_depth([1, "a", None, True, 2.5]) == 1
    assert json_depth([1, 2, [3, [4]]]) == 3
    assert json_depth([[1, 2], [3]]) == 2
    assert json_depth({"a": [1, {"b": [2]}]}) == 4
    assert json_depth([{}]) == 2
