"""`radixmesh bench hicache`: a multi-turn workload larger than the KV pool, with and without the host tier.

Sessions send turns whose prompt is the whole history (earlier prompts and replies) plus a new
message. Sessions take turns round-robin: a session that got its reply waits until every other
session had a turn, so between two turns of one session all the others' histories pass through
the cache. With `--working-set-ratio R` the sessions' final histories add up to R times the device
KV pool: an LRU device cache then holds no session's history when it comes back, the host tier
(sized by the engine flags) does. The scheduler runs in-process (no HTTP or IPC), on random weights
of `--model-shape` by default; one model serves both runs (the second gets a fresh scheduler and cache).

Prints the device, the settings, one row per run (cache hit rate, throughput, TTFT) and the
with/without ratios, and ends with one JSON line (also appended to --result-file).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.bench.throughput import DEFAULT_SHAPE, _sync_fn, device_info

HICACHE_KEYS = ("hicache_host_hit_tokens", "hicache_num_loads", "hicache_load_bytes", "hicache_write_bytes",
                "hicache_load_s_total", "hicache_offloaded_tokens", "hicache_host_capacity_tokens")


@dataclass
class Session:
    turns: list[tuple[list[int], int]]
    """(new message ids, reply length) per turn."""
    history: list[int] = field(default_factory=list)
    next_turn: int = 0


@dataclass
class RunResult:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    cpu_s: float = 0.0
    """CPU time of this process over the run (all threads): on a shared CPU, the work done, whatever the
    other processes took."""


def make_sessions(args: argparse.Namespace, vocab: int, pool_tokens: int) -> list[Session]:
    """Sessions sized so that their final histories add up to `working_set_ratio` x the pool."""
    per_session = args.num_turns * (args.turn_input_len + args.output_len)
    num = args.num_sessions or max(args.max_concurrency + 1, round(args.working_set_ratio * pool_tokens / per_session))
    rng = random.Random(args.seed)
    low = min(100, vocab // 4)  # skip the special tokens at the start of real vocabularies
    return [Session([([rng.randrange(low, vocab - 1) for _ in range(args.turn_input_len)], args.output_len)
                     for _ in range(args.num_turns)]) for _ in range(num)]


class MultiTurnDriver:
    """Feeds sessions' turns to an in-process scheduler, round-robin, at most `max_concurrency` in flight."""

    def __init__(self, sched: Any, sessions: list[Session], max_concurrency: int) -> None:
        self.sched = sched
        self.queue = list(sessions)
        self.inflight: dict[str, tuple[Session, float, list[int]]] = {}
        self.max_concurrency = max_concurrency
        self.result = RunResult()
        self._counter = 0

    def __call__(self, outputs: list[Any]) -> None:
        now = time.perf_counter()
        for out in outputs:
            entry = self.inflight.get(out.rid)
            if entry is None:
                continue
            session, sent_at, reply = entry
            if out.token_ids and not reply:
                self.result.ttft_s.append(now - sent_at)
            reply.extend(out.token_ids)
            if out.error:
                raise RuntimeError(f"request {out.rid} failed: {out.error}")
            if out.finish_reason is not None:
                self.result.cached_tokens += out.cached_tokens
                self.result.output_tokens += len(reply)
                session.history += reply
                del self.inflight[out.rid]
                if session.next_turn < len(session.turns):
                    self.queue.append(session)  # behind every other session: its turn comes round again

    def run(self) -> RunResult:
        from radixmesh.engine.request import Req
        from radixmesh.wire.sampling import SamplingParams

        sync = _sync_fn(self.sched)
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        while self.queue or self.inflight or self.sched.has_work:
            while self.queue and len(self.inflight) < self.max_concurrency:
                session = self.queue.pop(0)
                message, reply_len = session.turns[session.next_turn]
                session.next_turn += 1
                session.history += message
                self._counter += 1
                rid = f"t{self._counter}"
                self.inflight[rid] = (session, time.perf_counter(), [])
                self.result.prompt_tokens += len(session.history)
                params = SamplingParams(max_new_tokens=reply_len, temperature=0, ignore_eos=True)
                self.sched.add_request(Req(rid=rid, origin_input_ids=list(session.history), params=params))
            self.sched.step()
        sync()
        self.result.duration_s = time.perf_counter() - start
        self.result.cpu_s = time.process_time() - cpu_start
        return self.result


def build(args: argparse.Namespace, hierarchical: bool, runner: Any = None) -> Any:
    """A scheduler for one run (the model runner of an earlier run is reused, its pools emptied)."""
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler.core import Scheduler

    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_shape or args.model or DEFAULT_SHAPE
    kwargs["enable_hierarchical_cache"] = hierarchical
    config = EngineConfig(**kwargs).resolve()
    if runner is None:
        runner = ModelRunner(config, prepare_model(config.model, config.load_format, lend_tokenizer=False))
    return Scheduler(config, runner, None, lambda outputs: None)


def summarize(name: str, result: RunResult, stats: dict[str, Any]) -> dict[str, Any]:
    row = {"run": name, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
           "cache_hit_rate": round(result.cached_tokens / max(result.prompt_tokens, 1), 4),
           "output_tokens": result.output_tokens, "duration_s": round(result.duration_s, 3),
           "output_throughput_tok_s": round(result.output_tokens / result.duration_s, 1),
           "total_throughput_tok_s": round((result.prompt_tokens + result.output_tokens) / result.duration_s, 1),
           "median_ttft_s": round(statistics.median(result.ttft_s), 4) if result.ttft_s else None,
           "cpu_s": round(result.cpu_s, 3),
           "total_tok_per_cpu_s": round((result.prompt_tokens + result.output_tokens) / max(result.cpu_s, 1e-9), 1),
           "num_forward_passes": stats.get("num_forward_passes", 0),
           "num_retractions": stats.get("num_retractions", 0)}
    row.update({key: stats[key] for key in HICACHE_KEYS if key in stats})
    if stats.get("hicache_num_loads"):
        row["hicache_mean_load_ms"] = round(1000 * stats["hicache_load_s_total"] / stats["hicache_num_loads"], 3)
    return row


def cmd_hicache(args: argparse.Namespace) -> int:
    """Runs without and with the host tier (alternating, `--repeats` times each), then the report."""
    runner, rows, sched = None, [], None
    sessions_spec: list[Session] | None = None
    for repeat in range(args.repeats):
        order = [("without", False), ("with", True)]
        for name, hierarchical in order if repeat % 2 == 0 else order[::-1]:
            sched = build(args, hierarchical, runner)
            runner = sched.runner
            if sessions_spec is None:
                sessions_spec = make_sessions(args, runner.model_config.vocab_size, sched.kv.capacity)
            driver = MultiTurnDriver(sched, [Session(list(s.turns)) for s in sessions_spec], args.max_concurrency)
            sched.emit = driver
            rows.append(summarize(name, driver.run(), sched.stats()))
            print(_row_line(rows[-1]), flush=True)
            assert sched.flush_cache(), "the cache could not be emptied after a run"
    assert sched is not None and sessions_spec is not None
    report = {"bench": "hicache", **device_info(sched), "command": " ".join(sys.argv),
              "model": sched.config.model, "max_total_tokens": sched.kv.capacity,
              "num_sessions": len(sessions_spec), "num_turns": args.num_turns,
              "turn_input_len": args.turn_input_len, "output_len": args.output_len,
              "max_concurrency": args.max_concurrency, "working_set_ratio": args.working_set_ratio,
              "hicache_write_policy": sched.config.hicache_write_policy, "repeats": args.repeats, "runs": rows,
              **_ratios(rows)}
    print(f"hit rate x{report['hit_rate_ratio']}  throughput x{report['throughput_ratio']}  CPU time "
          f"/{report['cpu_time_ratio']} (with / without the host tier; medians over {args.repeats} run(s) each)")
    line = json.dumps(report)
    print(line)
    if args.result_file:
        with open(args.result_file, "a") as fh:
            fh.write(line + "\n")
    return 0


def _ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """With / without the host tier, from the medians of each mode's runs."""
    def median(run: str, key: str) -> float:
        return float(statistics.median(r[key] for r in rows if r["run"] == run))

    hit_without = median("without", "cache_hit_rate")
    return {"hit_rate_ratio": round(median("with", "cache_hit_rate") / hit_without, 3) if hit_without else None,
            "throughput_ratio": round(median("with", "total_throughput_tok_s")
                                      / median("without", "total_throughput_tok_s"), 3),
            "cpu_time_ratio": round(median("without", "cpu_s") / max(median("with", "cpu_s"), 1e-9), 3)}


def _row_line(row: dict[str, Any]) -> str:
    return (f"{row['run']:>8} host tier: hit rate {100 * row['cache_hit_rate']:5.1f}%  "
            f"{row['total_throughput_tok_s']:9.1f} tok/s (prompt + output)  {row['output_throughput_tok_s']:8.1f} "
            f"output tok/s  median TTFT {row['median_ttft_s']} s  {row['duration_s']} s ({row['cpu_s']} s CPU, "
            f"{row['num_forward_passes']} passes)")


def register_hicache(bench: argparse._SubParsersAction) -> None:
    from radixmesh.engine.args import add_engine_args

    parser = bench.add_parser("hicache", help="multi-turn sessions larger than the KV pool, with and without the "
                                              "host tier (hit rate, throughput)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.set_defaults(load_format="dummy")
    parser.add_argument("--model-shape", default=None, help=f"named shape for random weights (default {DEFAULT_SHAPE})")
    parser.add_argument("--num-sessions", type=int, default=0, help="sessions (0: sized by --working-set-ratio)")
    parser.add_argument("--working-set-ratio", type=float, default=3.0,
                        help="the sessions' final histories add up to this many times the device KV pool")
    parser.add_argument("--num-turns", type=int, default=4, help="turns per session")
    parser.add_argument("--turn-input-len", type=int, default=512, help="tokens of each new user message")
    parser.add_argument("--output-len", type=int, default=32, help="tokens of each reply")
    parser.add_argument("--max-concurrency", type=int, default=8, help="turns in flight at most")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each mode, alternating their order (the ratios use medians)")
    parser.add_argument("--result-file", default=None, help="append the JSON result to this file")
    parser.set_defaults(func=cmd_hicache)

