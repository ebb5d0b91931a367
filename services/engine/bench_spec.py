"""`radixmesh bench speculative`: decode throughput with and without speculative decoding.

For each batch size, the same greedy requests (all prompts, that many at a time) run on a plain
engine and on one with the `--speculative-*` flags given; prints tokens per second, the speedup, the mean acceptance
length and whether the outputs were identical, and ends with one JSON line per batch size.
Workloads: `copy` (rewrite or extend a passage, edit code; the model's tokenizer and chat
template) or `random` (random token ids; any shape, e.g. `--model-shape llama-3.1-8b`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from typing import Any

from radixmesh.engine.bench import DEFAULT_SHAPE, Timeline, _report, device_info, run_all, settings

SPEC_STATS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_passes",
              "spec_num_verified_requests", "spec_num_backoff_steps")


def _build(args: argparse.Namespace, speculative: bool, timeline: Timeline) -> Any:
    from radixmesh.cli import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler import Scheduler
    from radixmesh.engine.tokenizer import load_tokenizer

    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_shape or args.model or (DEFAULT_SHAPE if args.workload == "random" else None)
    if args.model_shape:
        kwargs["load_format"] = "dummy"
    config = EngineConfig(**kwargs)
    if not speculative:
        config = dataclasses.replace(config, speculative_algorithm=None, speculative_draft_model=None)
    config = config.resolve()
    prepared = prepare_model(config.model, config.load_format, lend_tokenizer=args.workload == "copy")
    tokenizer = load_tokenizer(prepared.tokenizer_path) if prepared.tokenizer_path else None
    return Scheduler(config, ModelRunner(config, prepared), tokenizer, timeline)


def _prompts(args: argparse.Namespace, sched: Any) -> list[list[int]]:
    import random

    if args.workload == "copy":
        from radixmesh.engine.bench_spec_workload import copy_heavy_messages
        from radixmesh.engine.tokenizer import encode_chat

        if sched.tokenizer is None:
            raise SystemExit("radixmesh: error: --workload copy needs a model with a tokenizer and chat template")
        return [encode_chat(sched.tokenizer, messages) for messages in copy_heavy_messages()]
    rng = random.Random(args.seed)
    vocab = sched.runner.model_config.vocab_size
    return [[rng.randrange(100, vocab - 1) for _ in range(args.input_len)] for _ in range(max(args.batch_sizes))]



def _run_batch(sched: Any, timeline: Timeline, prompts: list[list[int]], output_len: int,
               tag: str) -> dict[str, Any]:
    """All `prompts` at once (greedy, exactly `output_len` tokens each); times, outputs, speculation counters."""
    from radixmesh.engine.request import Req
    from radixmesh.engine.sampling.params import SamplingParams

    reqs = [Req(rid=f"{tag}{i}", origin_input_ids=list(ids),
                params=SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True))
            for i, ids in enumerate(prompts)]
    outputs: dict[str, list[int]] = {}
    timeline.reset()
    before = {k: sched.stats().get(k, 0) for k in SPEC_STATS}

    def collect(outs: list[Any]) -> None:
        timeline(outs)
        for out in outs:
            outputs.setdefault(out.rid, []).extend(out.token_ids)

    sched.emit = collect
    start = run_all(sched, reqs)
    sched.emit = timeline
    first, done = max(timeline.first_token_s.values()), max(timeline.done_s.values())
    after = sched.stats()
    return {"e2e_s": done - start, "decode_s": done - first,
            "decoded": sum(timeline.num_tokens.values()) - len(reqs), "outputs": [outputs[r.rid] for r in reqs],
            **{k: after.get(k, 0) - before[k] for k in SPEC_STATS}}


def _run_size(sched: Any, timeline: Timeline, prompts: list[list[int]], batch_size: int,
              output_len: int) -> dict[str, Any]:
    """Every prompt once, `batch_size` at a time; sums over the rounds."""
    total: dict[str, Any] = {"e2e_s": 0.0, "decode_s": 0.0, "decoded": 0, "outputs": [],
                             **dict.fromkeys(SPEC_STATS, 0)}
    for start in range(0, len(prompts), batch_size):
        one = _run_batch(sched, timeline, prompts[start:start + batch_size], output_len, f"b{batch_size}-{start}-")
        for key, value in one.items():
            total[key] += value
    total["decode_tok_s"] = total["decoded"] / max(total["decode_s"], 1e-9)
    return total


def _measure(args: argparse.Namespace, speculative: bool) -> tuple[Any, dict[int, dict[str, Any]]]:
    timeline = Timeline()
    sched = _build(args, speculative, timeline)
    prompts = _prompts(args, sched)
    _run_batch(sched, timeline, prompts[:2], 8, "warm")  # kernels compile, graphs warm
    results = {}
    for b in args.batch_sizes:
        num = args.num_prompts or (len(prompts) if args.workload == "copy" else b)
        results[b] = _run_size(sched, timeline, [prompts[i % len(prompts)] for i in range(num)], b, args.output_len)
    return sched, results


def _release(sched: Any) -> None:
    import torch

    del sched
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cmd_speculative(args: argparse.Namespace) -> int:
    if args.speculative_algorithm is None:
        print("radixmesh: error: bench speculative needs --speculative-algorithm", file=sys.stderr)
        return 2
    sched, plain = _measure(args, speculative=False)
    _release(sched)
    started = time.perf_counter()
    sched, spec = _measure(args, speculative=True)
    cfg = sched.config
    common = {"bench": "speculative", **device_info(sched), **settings(sched, args), "workload": args.workload,
              "speculative_algorithm": cfg.speculative_algorithm,
              "speculative_draft_model": cfg.speculative_draft_model,
              "speculative_num_draft_tokens": cfg.speculative_num_draft_tokens,
              "backoff": not cfg.disable_speculative_backoff, "output_len": args.output_len,
              "spec_setup_and_run_s": round(time.perf_counter() - started, 1)}
    for b in args.batch_sizes:
        p, s = plain[b], spec[b]
        verified = s["spec_num_draft_tokens"]
        same = sum(a == c for a, c in zip(p["outputs"], s["outputs"]))
        num = len(p["outputs"])
        _report({**common, "batch_size": b,
                 "plain_decode_tok_s": round(p["decode_tok_s"], 2), "spec_decode_tok_s": round(s["decode_tok_s"], 2),
                 "speedup": round(s["decode_tok_s"] / p["decode_tok_s"], 3),
                 "plain_e2e_s": round(p["e2e_s"], 3), "spec_e2e_s": round(s["e2e_s"], 3),
                 "draft_tokens": verified, "accepted_tokens": s["spec_num_accepted_tokens"],
                 "accept_rate": round(s["spec_num_accepted_tokens"] / verified, 4) if verified else 0.0,
                 "verify_passes": s["spec_num_verify_passes"], "backoff_steps": s["spec_num_backoff_steps"],
                 "mean_accept_length": _accept_length(s),
                 "num_requests": num, "identical_outputs": f"{same}/{num}"}, args)
    return 0


def _accept_length(result: dict[str, Any]) -> float:
    """Tokens per request and verification that had drafts: accepted drafts + 1 (the target's token)."""
    verified = result["spec_num_verified_requests"]
    return round((result["spec_num_accepted_tokens"] + verified) / verified, 3) if verified else 0.0


def register_speculative(bench: argparse._SubParsersAction) -> None:
    from radixmesh.cli import add_engine_args

    parser = bench.add_parser("speculative", help="decode throughput with and without speculative decoding")
    add_engine_args(parser)
    parser.add_argument("--model-shape", default=None, help="named shape for random weights (with --load-format dummy)")
    parser.add_argument("--workload", choices=("copy", "random"), default="copy",
                        help="copy: rewrite/extend passages and edit code (chat template); random: random token ids")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                        help="comma-separated batch sizes, e.g. 1,8,32")
    parser.add_argument("--input-len", type=int, default=512, help="random workload: prompt length")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="requests per batch size, run batch-size at a time (default: every copy prompt once; "
                             "random: one batch)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--result-file", default=None, help="append the JSON results to this file")
    parser.set_defaults(func=cmd_speculative)
