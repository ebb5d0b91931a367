"""Workloads: deterministic from the seed, with the lengths and structure their flags ask for."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from loadtests.fakes import WordTokenizer
from loadtests.serving import add_serving_args
from loadtests.workloads import WORKLOADS, get_workload
from loadtests.workloads.base import Workload, sample_lens
from loadtests.workloads.shared_prefix import group_assignment, zipf_probs

TOKENIZER = WordTokenizer()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    return parser.parse_args(list(argv))


def build(name: str, *argv: str, num_prompts: int = 8, seed: int = 1) -> Workload:
    return get_workload(name).build(parse("--workload", name, *argv), TOKENIZER, num_prompts, seed)


def make_sharegpt_file(tmp_path: Path) -> Path:
    def conv(i: int) -> dict[str, object]:
        return {"id": str(i), "conversations": [
            {"from": "human", "value": " ".join(f"w{10 + i + k}" for k in range(5 + i))},
            {"from": "gpt", "value": " ".join(f"w{50 + k}" for k in range(3 + i))},
            {"from": "human", "value": "w7 w8"}]}

    data = [conv(i) for i in range(6)]
    data.append({"id": "short", "conversations": [{"from": "human", "value": "w3"}, {"from": "gpt", "value": "w4"}]})
    data.append({"id": "gpt-first", "conversations": [{"from": "gpt", "value": "w3 w4"},
                                                      {"from": "human", "value": "w4 w5"}]})
    data.append({"id": "roles", "messages": [{"role": "user", "content": "w20 w21 w22"},
                                             {"role": "assistant", "content": "w30 w31"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("name", ["random", "random-ids", "random-text-ids", "generated-shared-prefix", "multi-turn",
                                  "json-schema"])
def test_same_seed_same_workload(name: str) -> None:
    small = ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "20",
             "--gsp-question-len", "5", "--random-input-len", "30", "--multi-turn-input-len", "10"]
    assert build(name, *small) == build(name, *small)
    assert build(name, *small, seed=1) != build(name, *small, seed=2)


def test_random_lengths_in_range() -> None:
    w = build("random-ids", "--random-input-len", "40", "--random-output-len", "10", "--random-range-ratio", "0.5",
              num_prompts=50)
    prompt_lens = [s.turns[0].prompt_len for s in w.sessions]
    output_lens = [s.turns[0].output_len for s in w.sessions]
    assert all(20 <= n <= 40 for n in prompt_lens) and len(set(prompt_lens)) > 5
    assert all(5 <= n <= 10 for n in output_lens)
    for s in w.sessions:
        ids = s.turns[0].prompt
        assert isinstance(ids, list) and len(ids) == s.turns[0].prompt_len
        assert not set(ids) & set(TOKENIZER.all_special_ids)


def test_random_text_and_fixed_lengths() -> None:
    w = build("random", "--random-input-len", "12", "--random-output-len", "3", "--random-range-ratio", "1",
              num_prompts=5)
    assert [(s.turns[0].prompt_len, s.turns[0].output_len) for s in w.sessions] == [(12, 3)] * 5
    assert all(isinstance(s.turns[0].prompt, str) and s.turns[0].ignore_eos for s in w.sessions)


def test_sample_lens_bounds() -> None:
    import random

    assert sample_lens(random.Random(0), 10, 0.0, 100).count(0) == 0
    with pytest.raises(ValueError):
        sample_lens(random.Random(0), 10, 1.5, 1)


def test_shared_prefix_groups_share_their_system_prompt() -> None:
    w = build("generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4",
              "--gsp-system-prompt-len", "30", "--gsp-question-len", "6", "--gsp-output-len", "5", num_prompts=999)
    assert len(w.sessions) == 12  # groups x prompts per group; --num-prompts is ignored
    assert Counter(s.group_id for s in w.sessions) == {0: 4, 1: 4, 2: 4}
    assert [s.session_id for s in w.sessions] == list(range(12))
    by_group: dict[int | None, set[str]] = {}
    for s in w.sessions:
        turn = s.turns[0]
        assert isinstance(turn.prompt, str) and turn.output_len == 5 and turn.prompt_len == 36
        system, question = turn.prompt.split("\n\n")
        by_group.setdefault(s.group_id, set()).add(system)
        assert len(question.split()) == 6
    assert all(len(systems) == 1 for systems in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 3
    assert len({s.turns[0].prompt for s in w.sessions}) == 12  # every question is unique
    assert [s.group_id for s in w.sessions] != sorted(s.group_id or 0 for s in w.sessions)  # shuffled


def test_shared_prefix_multi_turn() -> None:
    w = build("generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
              "--gsp-system-prompt-len", "10", "--gsp-question-len", "4", "--gsp-num-turns", "3")
    assert w.num_requests == 12
    for s in w.sessions:
        first, *later = s.turns
        assert "\n\n" in str(first.prompt) and all("\n\n" not in str(t.prompt) for t in later)
        assert all(t.prompt_len == 4 for t in later)


def test_zipf_popularity() -> None:
    probs = zipf_probs(4, 1.0)
    assert probs == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])
    counts = Counter(group_assignment(8, 500, "zipf", 1.2, seed=3))
    assert sum(counts.values()) == 4000
    assert counts[0] > counts[1] > counts[3] > counts[7]
    assert group_assignment(2, 2, "uniform", 1.0, seed=0) == [0, 0, 1, 1]
    w = build("generated-shared-prefix", "--gsp-num-groups", "4", "--gsp-prompts-per-group", "8",
              "--gsp-system-prompt-len", "10", "--gsp-question-len", "4", "--gsp-group-distribution", "zipf",
              "--gsp-zipf-alpha", "2")
    assert Counter(s.group_id for s in w.sessions).most_common(1)[0][0] == 0


def test_multi_turn_sessions() -> None:
    w = build("multi-turn", "--multi-turn-num-turns", "3", "--multi-turn-input-len", "7", "--multi-turn-output-len",
              "4", num_prompts=5)
    assert len(w.sessions) == 5 and w.num_requests == 15
    assert all(t.prompt_len == 7 and t.output_len == 4 for s in w.sessions for t in s.turns)


def test_json_schema_requests_are_valid_schemas() -> None:
    w = build("json-schema", "--json-schema-output-len", "32", num_prompts=20)
    kinds = set()
    for s in w.sessions:
        turn = s.turns[0]
        assert turn.response_format is not None and not turn.ignore_eos and turn.output_len == 32
        spec = turn.response_format["json_schema"]
        schema = spec["schema"]
        kinds.add(spec["name"])
        assert schema["type"] == "object" and schema["required"] == sorted(schema["properties"])
        assert len(schema["properties"]) >= 2
        assert all("type" in p for p in schema["properties"].values())
        json.dumps(turn.response_format)
    assert len(kinds) > 1


def test_sharegpt_first_turns(tmp_path: Path) -> None:
    path = make_sharegpt_file(tmp_path)
    w = build("sharegpt", "--dataset-path", str(path), num_prompts=7)
    prompts = {str(s.turns[0].prompt) for s in w.sessions}
    assert "w20 w21 w22" in prompts  # role/content spelling
    assert not prompts & {"w3", "w3 w4", "w7 w8"}  # too short, reply-first, later turns
    by_prompt_len = {s.turns[0].prompt_len: s.turns[0].output_len for s in w.sessions}
    assert by_prompt_len[5] == 3 and by_prompt_len[10] == 8  # reply length
    fixed = build("sharegpt", "--dataset-path", str(path), "--sharegpt-output-len", "9", num_prompts=3)
    assert {s.turns[0].output_len for s in fixed.sessions} == {9}
    with pytest.raises(ValueError, match="usable"):
        build("sharegpt", "--dataset-path", str(path), num_prompts=50)
    with pytest.raises(ValueError, match="dataset-path"):
        build("sharegpt", num_prompts=1)


def test_registry_ids_are_kebab_case() -> None:
    assert all(name == name.lower() and "_" not in name for name in WORKLOADS)
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("nope")
