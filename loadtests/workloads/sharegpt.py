"""`sharegpt`: the first human turn of each ShareGPT conversation, answered at the reply's length.

The file is a JSON list of {"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]} (the "role"/"content" spelling is accepted too).
Conversations are shuffled with the seed; too short or too long pairs are skipped as in
SGLang (prompt or reply under 2 tokens, prompt over 1024, both over 2048).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from loadtests.workloads.base import Session, Tokenizer, Turn, Workload, count_tokens

MIN_LEN = 2
"""Shortest prompt or reply kept (tokens)."""
MAX_PROMPT_LEN = 1024
"""Longest prompt kept (tokens)."""
MAX_TOTAL_LEN = 2048
"""Longest prompt plus reply kept (tokens)."""


class ShareGptWorkload:
    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sharegpt workload")
        group.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
        group.add_argument("--sharegpt-output-len", type=int, default=None,
                           help="output tokens of every request (default: the length of the recorded reply)")

    def build(self, args: argparse.Namespace, tokenizer: Tokenizer, num_prompts: int, seed: int) -> Workload:
        if not args.dataset_path:
            raise ValueError("the sharegpt workload needs --dataset-path FILE")
        pairs = first_turns(load_conversations(Path(args.dataset_path)))
        random.Random(seed).shuffle(pairs)
        sessions: list[Session] = []
        for prompt, reply in pairs:
            if len(sessions) == num_prompts:
                break
            prompt_len = count_tokens(tokenizer, prompt)
            output_len = args.sharegpt_output_len or count_tokens(tokenizer, reply)
            if not is_kept(prompt_len, output_len, fixed_output=args.sharegpt_output_len is not None):
                continue
            turn = Turn(prompt=prompt, prompt_len=prompt_len, output_len=output_len)
            sessions.append(Session(session_id=len(sessions), turns=(turn,)))
        if len(sessions) < num_prompts:
            raise ValueError(f"{args.dataset_path} has only {len(sessions)} usable conversations, "
                             f"{num_prompts} asked for")
        params = {"dataset_path": str(args.dataset_path), "sharegpt_output_len": args.sharegpt_output_len}
        return Workload(name="sharegpt", sessions=tuple(sessions), params=params)


def load_conversations(path: Path) -> list[list[dict[str, Any]]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    conversations = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or item.get("messages") \
            if isinstance(item, dict) else None
        if isinstance(turns, list):
            conversations.append(turns)
    return conversations


def first_turns(conversations: list[list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """(human text, reply text) of every conversation that starts with a human turn and has a reply."""
    pairs = []
    for turns in conversations:
        if len(turns) < 2:
            continue
        first, second = (_speaker_and_text(t) for t in turns[:2])
        if first[0] in ("human", "user") and second[0] in ("gpt", "assistant") and first[1] and second[1]:
            pairs.append((first[1], second[1]))
    return pairs


def is_kept(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    if prompt_len < MIN_LEN or (output_len < MIN_LEN and not fixed_output):
        return False
    return prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def _speaker_and_text(turn: dict[str, Any]) -> tuple[str, str]:
    speaker = str(turn.get("from", turn.get("role", "")))
    text = turn.get("value", turn.get("content", ""))
    return speaker, text if isinstance(text, str) else ""


SHAREGPT = ShareGptWorkload()
