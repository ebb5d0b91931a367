"""Engine benchmarks: `radixmesh bench one-batch` and `radixmesh bench offline`.

Both drive the scheduler in-process (model, KV pools, scheduling, sampling; no HTTP
or IPC front end), print the device and settings, and end with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SHAPE = "llama-3.2-1b"


@dataclass
class Timeline:
    """When each request produced tokens (host time after the device finished them)."""

    first_token_s: dict[str, float] = field(default_factory=dict)
    done_s: dict[str, float] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.first_token_s.clear()
        self.done_s.clear()
        self.num_tokens.clear()

    def __call__(self, outputs: list[Any]) -> None:
        now = time.perf_counter()
        for out in outputs:
            if out.token_ids:
                self.first_token_s.setdefault(out.rid, now)
                self.num_tokens[out.rid] = out.completion_tokens
            if out.finish_reason:
                self.done_s[out.rid] = now
                if out.error:
                    raise RuntimeError(f"request {out.rid} failed: {out.error}")


def build_scheduler(args: argparse.Namespace, emit: Timeline) -> Any:
    from radixmesh.cli import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler import Scheduler

    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_shape or args.model or DEFAULT_SHAPE
    config = EngineConfig(**kwargs).resolve()
    prepared = prepare_model(config.model, config.load_format, lend_tokenizer=False)
    runner = ModelRunner(config, prepared)
    return Scheduler(config, runner, None, emit)


def make_reqs(lengths: list[tuple[int, int]], vocab: int, seed: int, tag: str) -> list[Any]:
    from radixmesh.engine.request import Req
    from radixmesh.engine.sampling.params import SamplingParams

    rng = random.Random(seed)
    return [Req(rid=f"{tag}{i}", origin_input_ids=[rng.randrange(100, vocab - 1) for _ in range(in_len)],
                params=SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True))
            for i, (in_len, out_len) in enumerate(lengths)]


def run_all(sched: Any, reqs: list[Any]) -> float:
    sync = _sync_fn(sched)
    sync()
    start = time.perf_counter()
    for req in reqs:
        sched.add_request(req)
    while sched.has_work:
        sched.step()
    sync()
    return start


def _sync_fn(sched: Any) -> Any:
    import torch

    if sched.runner.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def device_info(sched: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": str(sched.runner.device), "host": platform.node()}
    if sched.runner.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    info["torch"] = torch.__version__
    return info


def settings(sched: Any, args: argparse.Namespace) -> dict[str, Any]:
    cfg = sched.config
    return {"model": cfg.model, "load_format": cfg.load_format, "dtype": cfg.dtype,
            "attention_backend": cfg.attention_backend, "overlap_schedule": cfg.overlap_schedule,
            "cuda_graph": sched.runner.graph_runner is not None, "max_total_tokens": sched.kv.capacity,
            "max_running_requests": sched.runner.plan.max_running_requests,
            "chunked_prefill_size": cfg.chunked_prefill_size, "command": " ".join(sys.argv)}


def cmd_one_batch(args: argparse.Namespace) -> int:
    timeline = Timeline()
    sched = build_scheduler(args, timeline)
    vocab = sched.runner.model_config.vocab_size
    run_all(sched, make_reqs([(args.input_len, min(args.output_len, 4))] * args.batch_size, vocab, 1, "warm"))
    timeline.reset()
    reqs = make_reqs([(args.input_len, args.output_len)] * args.batch_size, vocab, 2, "r")
    start = run_all(sched, reqs)
    prefill_s = max(timeline.first_token_s.values()) - start
    decode_s = max(timeline.done_s.values()) - max(timeline.first_token_s.values())
    steps = max(args.output_len - 1, 1)
    result = {
        "bench": "one-batch", **device_info(sched), **settings(sched, args),
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "prefill_latency_s": round(prefill_s, 5),
        "prefill_throughput_tok_s": round(args.batch_size * args.input_len / prefill_s, 1),
        "decode_step_latency_ms": round(1000 * decode_s / steps, 4),
        "decode_throughput_tok_s": round(args.batch_size * steps / decode_s, 1),
        "per_request_decode_tok_s": round(steps / decode_s, 1),
    }
    _report(result, args)
    return 0


def random_lengths(num: int, max_in: int, max_out: int, ratio: float, seed: int) -> list[tuple[int, int]]:
    """Input and output lengths uniform in [max(1, ratio * max), max], like SGLang's random dataset."""
    rng = random.Random(seed)
    return [(rng.randint(max(1, int(max_in * ratio)), max_in), rng.randint(max(1, int(max_out * ratio)), max_out))
            for _ in range(num)]


def cmd_offline(args: argparse.Namespace) -> int:
    if args.dataset != "random":
        print(f"radixmesh: error: dataset {args.dataset!r} is not supported here (random)", file=sys.stderr)
        return 2
    timeline = Timeline()
    sched = build_scheduler(args, timeline)
    vocab = sched.runner.model_config.vocab_size
    run_all(sched, make_reqs([(64, 8)] * 4, vocab, 1, "warm"))
    timeline.reset()
    lengths = random_lengths(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, args.seed)
    start = run_all(sched, make_reqs(lengths, vocab, args.seed, "r"))
    duration = max(timeline.done_s.values()) - start
    out_tokens = sum(timeline.num_tokens.values())
    in_tokens = sum(i for i, _ in lengths)
    ttfts = [timeline.first_token_s[r] - start for r in timeline.first_token_s]
    result = {
        "bench": "offline", **device_info(sched), **settings(sched, args),
        "num_prompts": args.num_prompts, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens, "duration_s": round(duration, 3),
        "request_throughput_req_s": round(args.num_prompts / duration, 3),
        "input_throughput_tok_s": round(in_tokens / duration, 1),
        "output_throughput_tok_s": round(out_tokens / duration, 1),
        "median_time_to_first_token_s": round(statistics.median(ttfts), 3),
        "num_retractions": sched.num_retractions,
    }
    _report(result, args)
    return 0


def _report(result: dict[str, Any], args: argparse.Namespace) -> None:
    width = max(len(k) for k in result)
    for key, value in result.items():
        if key != "command":
            print(f"{key:<{width}}  {value}")
    line = json.dumps(result)
    print(line)
    if args.result_file:
        with open(args.result_file, "a") as fh:
            fh.write(line + "\n")


def _common(parser: argparse.ArgumentParser) -> None:
    from radixmesh.cli import add_engine_args

    add_engine_args(parser)
    parser.set_defaults(load_format="dummy")
    parser.add_argument("--model-shape", default=None,
                        help=f"named shape for random weights (default {DEFAULT_SHAPE})")
    parser.add_argument("--result-file", default=None, help="append the JSON result to this file")


def register_one_batch(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("one-batch", help="prefill and decode latency of one batch")
    _common(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.set_defaults(func=cmd_one_batch)


def register_offline(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("offline", help="offline throughput over many random requests")
    _common(parser)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--dataset", default="random")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=1024)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.set_defaults(func=cmd_offline)
