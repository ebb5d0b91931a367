"""`multi-turn`: chat sessions whose every turn resends the whole history.

Each of the --num-prompts sessions has --multi-turn-num-turns user messages of random text
(about --multi-turn-input-len tokens each); the runner appends the server's replies to the
history, so turn k's prompt is every earlier message plus the new one. A server with prefix
caching should hit the cache on all but the newest message.
"""

from __future__ import annotations

import argparse
import random

from loadtests.workloads.base import (
    Session,
    Tokenizer,
    Turn,
    Workload,
    check_positive,
    count_tokens,
    random_text,
    sample_lens,
    usable_token_ids,
)


class MultiTurnWorkload:
    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("multi-turn workload")
        group.add_argument("--multi-turn-num-turns", type=int, default=4, help="user messages per session")
        group.add_argument("--multi-turn-input-len", type=int, default=128, help="most tokens of a user message")
        group.add_argument("--multi-turn-output-len", type=int, default=64, help="most tokens of a reply")
        group.add_argument("--multi-turn-range-ratio", type=float, default=1.0,
                           help="lengths uniform in [ratio * len, len]; 1.0 (default) makes them fixed")

    def build(self, args: argparse.Namespace, tokenizer: Tokenizer, num_prompts: int, seed: int) -> Workload:
        num_turns = args.multi_turn_num_turns
        check_positive(multi_turn_num_turns=num_turns, multi_turn_input_len=args.multi_turn_input_len,
                       multi_turn_output_len=args.multi_turn_output_len)
        rng = random.Random(seed)
        vocab = usable_token_ids(tokenizer)
        num_messages = num_prompts * num_turns
        input_lens = sample_lens(rng, args.multi_turn_input_len, args.multi_turn_range_ratio, num_messages)
        output_lens = sample_lens(rng, args.multi_turn_output_len, args.multi_turn_range_ratio, num_messages)
        sessions = []
        for i in range(num_prompts):
            turns = []
            for k in range(i * num_turns, (i + 1) * num_turns):
                text = random_text(rng, tokenizer, vocab, input_lens[k])
                turns.append(Turn(prompt=text, prompt_len=count_tokens(tokenizer, text), output_len=output_lens[k]))
            sessions.append(Session(session_id=i, turns=tuple(turns)))
        params = {"multi_turn_num_turns": num_turns, "multi_turn_input_len": args.multi_turn_input_len,
                  "multi_turn_output_len": args.multi_turn_output_len,
                  "multi_turn_range_ratio": args.multi_turn_range_ratio}
        return Workload(name="multi-turn", sessions=tuple(sessions), params=params)


MULTI_TURN = MultiTurnWorkload()
