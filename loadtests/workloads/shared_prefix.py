"""`generated-shared-prefix`: groups of prompts that share a long system prompt.

Follows SGLang's `bench_serving` definition so figures compare: `num_groups` random system
prompts of `system_prompt_len` tokens; each of the group's `prompts_per_group` prompts is
"{system prompt}\\n\\n{question}" with a unique random question of `question_len` tokens;
every request asks for `output_len` tokens; the prompts are shuffled. Two options extend it:
group popularity (uniform gives each group exactly `prompts_per_group` prompts; zipf draws
each prompt's group with probability ∝ 1 / rank^alpha, group 0 hottest) and `num_turns`
(each prompt becomes a conversation whose later turns are fresh questions sent with the
history). The total is num_groups * prompts_per_group sessions; --num-prompts is ignored.
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


class SharedPrefixWorkload:
    def add_args(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("generated-shared-prefix workload (SGLang's gsp flags)")
        group.add_argument("--gsp-num-groups", type=int, default=64, help="number of shared system prompts")
        group.add_argument("--gsp-prompts-per-group", type=int, default=16, help="prompts per group")
        group.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="system prompt tokens")
        group.add_argument("--gsp-question-len", type=int, default=128, help="question tokens")
        group.add_argument("--gsp-output-len", type=int, default=256, help="output tokens")
        group.add_argument("--gsp-range-ratio", type=float, default=1.0,
                           help="lengths uniform in [ratio * len, len]; 1.0 (default) makes them fixed")
        group.add_argument("--gsp-num-turns", type=int, default=1, help="turns per conversation")
        group.add_argument("--gsp-group-distribution", choices=["uniform", "zipf"], default="uniform",
                           help="how prompts are spread over groups")
        group.add_argument("--gsp-zipf-alpha", type=float, default=1.0, help="Zipf exponent (zipf only)")

    def build(self, args: argparse.Namespace, tokenizer: Tokenizer, num_prompts: int, seed: int) -> Workload:
        num_groups, per_group, num_turns = args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_num_turns
        check_positive(gsp_num_groups=num_groups, gsp_prompts_per_group=per_group, gsp_num_turns=num_turns,
                       gsp_system_prompt_len=args.gsp_system_prompt_len, gsp_question_len=args.gsp_question_len,
                       gsp_output_len=args.gsp_output_len)
        if args.gsp_zipf_alpha <= 0:
            raise ValueError(f"--gsp-zipf-alpha must be > 0, got {args.gsp_zipf_alpha}")
        rng = random.Random(seed)
        vocab = usable_token_ids(tokenizer)
        ratio = args.gsp_range_ratio
        num_slots = num_groups * per_group
        system_lens = sample_lens(rng, args.gsp_system_prompt_len, ratio, num_groups)
        question_lens = sample_lens(rng, args.gsp_question_len, ratio, num_slots * num_turns)
        output_lens = sample_lens(rng, args.gsp_output_len, ratio, num_slots)
        system_prompts = [random_text(rng, tokenizer, vocab, n) for n in system_lens]
        questions = [random_text(rng, tokenizer, vocab, n) for n in question_lens]
        groups = group_assignment(num_groups, per_group, args.gsp_group_distribution, args.gsp_zipf_alpha, seed)

        sessions = []
        for slot, group_id in enumerate(groups):
            texts = questions[slot * num_turns:(slot + 1) * num_turns]
            texts[0] = f"{system_prompts[group_id]}\n\n{texts[0]}"
            turns = tuple(Turn(prompt=t, prompt_len=count_tokens(tokenizer, t), output_len=output_lens[slot])
                          for t in texts)
            sessions.append(Session(session_id=slot, turns=turns, group_id=group_id))
        rng.shuffle(sessions)
        sessions = [Session(session_id=i, turns=s.turns, group_id=s.group_id) for i, s in enumerate(sessions)]
        params = {k: getattr(args, k) for k in (
            "gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len",
            "gsp_output_len", "gsp_range_ratio", "gsp_num_turns", "gsp_group_distribution", "gsp_zipf_alpha")}
        return Workload(name="generated-shared-prefix", sessions=tuple(sessions), params=params)


def zipf_probs(num_groups: int, alpha: float) -> list[float]:
    """P(group g) ∝ 1 / (g + 1)^alpha: group 0 is the hottest."""
    weights = [1.0 / (rank ** alpha) for rank in range(1, num_groups + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def group_assignment(num_groups: int, per_group: int, distribution: str, alpha: float, seed: int) -> list[int]:
    """The group of each of the num_groups * per_group prompts (before shuffling)."""
    if distribution == "uniform":
        return [g for g in range(num_groups) for _ in range(per_group)]
    if distribution != "zipf":
        raise ValueError(f"unknown group distribution {distribution!r}")
    # An RNG of its own, so the prompt texts are the same as in uniform mode for one seed.
    rng = random.Random(f"zipf-{seed}")
    return rng.choices(range(num_groups), weights=zipf_probs(num_groups, alpha), k=num_groups * per_group)


SHARED_PREFIX = SharedPrefixWorkload()
