"""The Python Engine on the real default model: sampling parameters, streaming, abort, errors."""

from __future__ import annotations

import time

import pytest

from radixmesh import Engine
from radixmesh.common.errors import ErrorCode, RadixMeshError

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


def _greedy(engine, prompt=PROMPT, **params):
    return engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24, **params})


def test_stop_string_trims_text(engine):
    full = _greedy(engine)["text"]
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = _greedy(engine, stop=[stop])
    assert cut["text"] == full[: full.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_token_id_ends_request(engine):
    full = _greedy(engine)
    stop_id = full["output_ids"][3]
    cut = _greedy(engine, stop_token_ids=[stop_id])
    assert cut["output_ids"] == full["output_ids"][: full["output_ids"].index(stop_id) + 1]
    assert cut["meta_info"]["finish_reason"]["matched"] == stop_id


def test_same_seed_same_output_even_when_batched(engine):
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 20, "seed": 7}
    alone = engine.generate(PROMPT, params)
    batched = engine.generate(["Tell me a story.", PROMPT, "Hello"], params)
    assert batched[1]["output_ids"] == alone["output_ids"]
    others = {tuple(engine.generate(PROMPT, {**params, "seed": s})["output_ids"]) for s in (8, 9, 10)}
    assert len(others | {tuple(alone["output_ids"])}) > 1


def test_penalties_reduce_repetition(engine):
    prompt = "one one one one one one one one"
    plain = _greedy(engine, prompt, ignore_eos=True)["output_ids"]
    for name in ("presence_penalty", "frequency_penalty"):
        penalized = _greedy(engine, prompt, ignore_eos=True, **{name: 2.0})["output_ids"]
        assert len(set(penalized)) > len(set(plain)), name
    repeated = _greedy(engine, prompt, ignore_eos=True, repetition_penalty=1.8)["output_ids"]
    assert len(set(repeated)) > len(set(plain))


def test_logit_bias_forces_and_bans(engine):
    plain = _greedy(engine, max_new_tokens=6)["output_ids"]
    forced = _greedy(engine, max_new_tokens=6, logit_bias={"1234": 100})["output_ids"]
    assert forced == [1234] * 6
    banned = _greedy(engine, max_new_tokens=6, logit_bias={str(plain[0]): -100})["output_ids"]
    assert banned[0] != plain[0]


def test_logprobs_and_top_logprobs(engine):
    out = _greedy(engine, max_new_tokens=8, logprobs=True, top_logprobs=3)
    meta = out["meta_info"]
    pairs = meta["output_token_logprobs"]
    tops = meta["output_top_logprobs"]
    assert len(pairs) == len(tops) == len(out["output_ids"])
    for (logprob, token), top in zip(pairs, tops):
        assert len(top) == 3
        assert top[0][0] == token  # greedy picks the most likely token
        assert top[0][1] == pytest.approx(logprob, abs=1e-5)
        assert top[0][1] >= top[1][1] >= top[2][1]
        assert logprob <= 0


def test_min_new_tokens_and_ignore_eos(engine):
    out = _greedy(engine, "Say hi.", max_new_tokens=30, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 30
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    short = _greedy(engine, "Say hi.", max_new_tokens=30)
    longer = _greedy(engine, "Say hi.", max_new_tokens=30, min_new_tokens=short["meta_info"]["completion_tokens"] + 2)
    assert longer["meta_info"]["completion_tokens"] >= short["meta_info"]["completion_tokens"] + 2


def test_n_branches_share_the_prompt_kv(engine):
    prompt = "Write one sentence about the sea, please, in a calm voice:"
    results = engine.generate(prompt, {"temperature": 0.9, "max_new_tokens": 8, "n": 3, "seed": 1})
    assert len(results) == 3
    prompt_len = results[0]["meta_info"]["prompt_tokens"]
    assert all(r["meta_info"]["cached_tokens"] == prompt_len - 1 for r in results)
    assert len({tuple(r["output_ids"]) for r in results}) > 1


def test_stream_concatenates_to_full_text(engine):
    full = _greedy(engine, "Name three colors.")
    chunks = list(engine.generate_stream("Name three colors.", {"temperature": 0, "max_new_tokens": 24}))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert chunks[-1]["finish_reason"] == full["meta_info"]["finish_reason"]["type"]


def test_closing_a_stream_aborts_and_frees_kv(engine):
    stream = engine.generate_stream("Count from one to a thousand:", {"max_new_tokens": 500, "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        info = engine.get_server_info()
        if info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0:
            break
        time.sleep(0.1)
    assert info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0


@pytest.mark.parametrize(("params", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"bogus": 1}, "bogus"),
])
def test_invalid_parameters_are_rejected(engine, params, param):
    with pytest.raises(RadixMeshError) as err:
        engine.generate(PROMPT, params)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert err.value.param == param


def test_prompt_longer_than_context_is_rejected(engine):
    with pytest.raises(RadixMeshError, match="context length"):
        engine.generate([1] * 9000, {"max_new_tokens": 4})
