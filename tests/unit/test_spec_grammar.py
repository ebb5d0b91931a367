"""Speculative decoding with the real tokenizer (a tiny random model): structured outputs, stop strings,
and a draft whose tokenizer differs.

Drafts the grammar refuses are cut before verification and every verified row is masked, so greedy
output equals the non-speculative output and sampled output stays inside the grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import msgspec
import pytest

from radixmesh.engine.request import Req

from .scheduler_factory import assert_no_leak, clone, make_scheduler, run_until_idle, tiny_model_config
from .spec_factory import OracleProposer, oracle
from .test_grammar_scheduler import EBNF, EOS, REGEX, SCHEMA, VOCAB, expr_parses, req, text_of, tokenizer

__all__ = ["oracle", "tokenizer"]  # fixtures


def _scheduler(tok: Any, **overrides: Any) -> Any:
    return make_scheduler(tiny_model_config(vocab_size=VOCAB, eos_token_ids=(EOS,)), tokenizer=tok, **overrides)


def _requests(temperature: float) -> list[Req]:
    reqs = [req(i, json_schema=json.dumps(SCHEMA)) for i in range(3)]
    reqs += [req(10, regex=REGEX), req(20, ebnf=EBNF), req(30, max_new_tokens=12)]  # the last one is free text
    for r in reqs:
        r.params = msgspec.structs.replace(r.params, temperature=temperature)
    return reqs


def _run(sched: Any, col: Any, reqs: list[Req]) -> dict[str, list[int]]:
    for r in reqs:
        sched.add_request(clone(r))
    run_until_idle(sched)
    assert not col.errors, col.errors
    assert_no_leak(sched)
    return {r.rid: col.tokens[r.rid] for r in reqs}


@pytest.mark.parametrize("overrides", [{}, {"enable_jump_forward": True}, {"overlap_schedule": "on"}],
                         ids=["plain", "jump-forward", "overlap"])
def test_greedy_structured_output_is_unchanged_by_drafts(tokenizer: Any, oracle: type[OracleProposer],
                                                         overrides: dict[str, Any]) -> None:
    reqs = _requests(temperature=0.0)
    expected = _run(*_scheduler(tokenizer, **overrides), reqs)
    oracle.reference = expected  # the right continuation with one token spoiled: often outside the grammar
    sched, col = _scheduler(tokenizer, speculative_algorithm="oracle", disable_speculative_backoff=True,
                            **overrides)
    assert _run(sched, col, reqs) == expected
    assert sched.stats()["spec_num_accepted_tokens"] > 0


def test_sampled_structured_output_stays_valid_with_ngram_drafts(tokenizer: Any) -> None:
    sched, col = _scheduler(tokenizer, speculative_algorithm="ngram", speculative_ngram_min_match=1,
                            disable_speculative_backoff=True)
    reqs = _requests(temperature=1.0)
    out = _run(sched, col, reqs)
    for r in reqs[:3]:
        assert col.finish[r.rid] == "stop" and out[r.rid][-1] == EOS
        jsonschema.validate(json.loads(text_of(tokenizer, out[r.rid])), SCHEMA)
    assert re.fullmatch(REGEX, text_of(tokenizer, out[reqs[3].rid]))
    assert expr_parses(text_of(tokenizer, out[reqs[4].rid]))
    assert sched.stats()["spec_num_draft_tokens"] > 0


def test_draft_with_another_tokenizer_of_the_same_size_fails_at_start(tokenizer: Any, default_model_dir: Any,
                                                                       tmp_path: Any) -> None:
    """Same vocabulary size, two token ids swapped: the draft would propose other tokens than it means."""
    import shutil

    from radixmesh.common.errors import RadixMeshError

    from .spec_factory import draft_scheduler, write_model_dir

    draft = write_model_dir(tmp_path / "draft", vocab_size=VOCAB)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, draft / name)
    spec = json.loads((default_model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(RadixMeshError, match=r"tokenizer .* differs from the target's: 2 of its 49152 tokens"):
        draft_scheduler(draft, model_config=tiny_model_config(vocab_size=VOCAB, eos_token_ids=(EOS,)),
                        tokenizer=tokenizer)


def test_stop_strings_cut_accepted_drafts_as_plain_decoding_does(tokenizer: Any,
                                                                 oracle: type[OracleProposer]) -> None:
    free = [req(40 + i, max_new_tokens=24) for i in range(4)]
    for r in free:
        r.params = msgspec.structs.replace(r.params, temperature=0.0)
    free_out = _run(*_scheduler(tokenizer), free)
    stopped = []
    for r in free:  # stop at a piece of text the free run produced mid-way
        text = text_of(tokenizer, free_out[r.rid])
        stop = text[len(text) // 2:len(text) // 2 + 3]
        stopped.append(Req(rid=r.rid, origin_input_ids=r.origin_input_ids,
                           params=msgspec.structs.replace(r.params, stop=[stop] if stop.strip() else [])))
    plain_sched, plain_col = _scheduler(tokenizer)
    expected = _run(plain_sched, plain_col, stopped)
    oracle.reference = free_out  # drafts run past the stop strings
    sched, col = _scheduler(tokenizer, speculative_algorithm="oracle", speculative_num_draft_tokens=6,
                            disable_speculative_backoff=True)
    assert _run(sched, col, stopped) == expected
    assert col.finish == plain_col.finish and "stop" in col.finish.values()
