"""`random` and `random-ids`: prompts of random tokens, lengths uniform up to a maximum.

`random` sends the decoded text (its re-tokenized length is close to, not exactly, the
sampled one); `random-ids` sends the token ids themselves, so prompt lengths are exact.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from loadtests.workloads.base import (
    Session,
    Tokenizer,
    Turn,
    Workload,
    check_positive,
    count_tokens,
    random_token_ids,
    sample_lens,
    usable_token_ids,
)


@dataclass(frozen=True)
class RandomWorkload:
    """Random prompts; `send_ids` picks `random-ids` (token ids) over `random` (text)."""

    name: str
    send_ids: bool

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("random / random-ids workloads")
        group.add_argument("--random-input-len", type=int, default=1024, help="most prompt tokens")
        group.add_argument("--random-output-len", type=int, default=1024, help="most output tokens")
        group.add_argument("--random-range-ratio", type=float, default=0.0,
                           help="lengths are uniform in [ratio * max, max]; 1.0 makes them fixed")

    def build(self, args: argparse.Namespace, tokenizer: Tokenizer, num_prompts: int, seed: int) -> Workload:
        check_positive(random_input_len=args.random_input_len, random_output_len=args.random_output_len)
        rng = random.Random(seed)
        input_lens = sample_lens(rng, args.random_input_len, args.random_range_ratio, num_prompts)
        output_lens = sample_lens(rng, args.random_output_len, args.random_range_ratio, num_prompts)
        vocab = usable_token_ids(tokenizer)
        sessions = []
        for i, (input_len, output_len) in enumerate(zip(input_lens, output_lens)):
            ids = random_token_ids(rng, vocab, input_len)
            turn = self._turn(tokenizer, ids, output_len)
            sessions.append(Session(session_id=i, turns=(turn,)))
        params = {"random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
                  "random_range_ratio": args.random_range_ratio}
        return Workload(name=self.name, sessions=tuple(sessions), params=params)

    def _turn(self, tokenizer: Tokenizer, ids: list[int], output_len: int) -> Turn:
        if self.send_ids:
            return Turn(prompt=ids, prompt_len=len(ids), output_len=output_len)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return Turn(prompt=text, prompt_len=count_tokens(tokenizer, text), output_len=output_len)


RANDOM = RandomWorkload(name="random", send_ids=False)
RANDOM_IDS = RandomWorkload(name="random-ids", send_ids=True)
