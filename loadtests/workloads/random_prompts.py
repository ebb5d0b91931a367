"""`random`, `random-ids` and `random-text-ids`: prompts of random tokens, lengths uniform up to a maximum.

`random` sends the sampled ids decoded to text; the server tokenizes it again, into a few percent more tokens than
were sampled. `random-ids` sends the sampled ids themselves, so its prompt lengths are exact. `random-text-ids` sends
`random`'s text of the same seed and flags as the ids the server makes of it (`completion_ids`: with the special
tokens), so each of its prompts is its `random` twin token for token, without the server's tokenization.
`random` and `random-text-ids` both count a prompt as the server does: `prompt_len` is the same for twins.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Literal

from loadtests.workloads.base import (
    Session,
    Tokenizer,
    Turn,
    Workload,
    check_positive,
    completion_ids,
    random_token_ids,
    sample_lens,
    usable_token_ids,
)

PromptForm = Literal["text", "ids", "text-ids"]
"""What a random prompt is sent as: the decoded text, the sampled ids, or the server's ids of that text."""


@dataclass(frozen=True)
class RandomWorkload:
    """Random prompts sent as `form`: `random` (text), `random-ids` (sampled ids), `random-text-ids` (text's ids)."""

    name: str
    form: PromptForm

    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("random / random-ids / random-text-ids workloads")
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
        if self.form == "ids":
            return Turn(prompt=ids, prompt_len=len(ids), output_len=output_len)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        text_ids = completion_ids(tokenizer, text)
        return Turn(prompt=text_ids if self.form == "text-ids" else text, prompt_len=len(text_ids),
                    output_len=output_len)


RANDOM = RandomWorkload(name="random", form="text")
RANDOM_IDS = RandomWorkload(name="random-ids", form="ids")
RANDOM_TEXT_IDS = RandomWorkload(name="random-text-ids", form="text-ids")
