"""`radixmesh bench front-end-load`: what streaming tokens costs `serve`'s front end, per token, under load.

Starts `serve`'s front end over the stub scheduler in its streaming mode (`--itl-ms`: every running request gets
one token per step, a step every ITL ms, all in one message, as the scheduler sends them) and keeps `--streams`
streamed /v1/completions requests of `--output-tokens` tokens open for `--duration-s` seconds, each stream
starting a new request when its last one ends. Reports the tokens streamed per second, the front end's CPU time
per 1,000 streamed tokens (its process's user + system time, from /proc: Linux only) and its share of one core,
and the client's time to first token and inter-token gaps (the client, an asyncio loop in this process, shares
the machine with the server: compare runs on one machine).

    radixmesh bench front-end-load --streams 16 --output-tokens 200 --itl-ms 5 --duration-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.client import CompletionsBackend, RequestInput
from loadtests.front_end import free_port, machine, start_stub_server
from loadtests.workloads.base import Turn
from radixmesh.common.env import event_loop, http_parser


@dataclass
class StreamStats:
    """What the client saw: per request its TTFT, per token gap its ITL (seconds), tokens in all."""

    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("front-end-load", help="serve's front-end CPU per streamed token (stub scheduler)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="whose tokenizer and config to use (default: the default model)")
    parser.add_argument("--streams", type=int, default=16, help="streamed requests open at once")
    parser.add_argument("--output-tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt length in token ids")
    parser.add_argument("--itl-ms", type=float, default=5.0, help="the stub's step time")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--tokenizer-workers", type=int, default=None, help="serve's --tokenizer-workers")
    parser.add_argument("--output-file", default=None, help="JSON with the summary")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.streams < 1 or args.output_tokens < 1 or args.itl_ms <= 0 or args.duration_s <= 0:
        raise SystemExit("--streams and --output-tokens must be >= 1, --itl-ms and --duration-s > 0")
    with tempfile.TemporaryDirectory(prefix="radixmesh-front-end-load-") as tmp:
        record = Path(tmp) / "arrivals"
        record.touch()
        port = free_port()
        server = start_stub_server(args, port, record, ("--itl-ms", str(args.itl_ms)))
        try:
            streams, cpu_s, elapsed_s = asyncio.run(_load(args, port, server.pid))
        finally:
            server.terminate()
            server.wait(30)
    summary = summarize(streams, cpu_s, elapsed_s)
    print(f"{args.streams} streams, {args.output_tokens} tokens each, a step every {args.itl_ms:g} ms, "
          f"{elapsed_s:.1f} s: {summary['tokens_per_s']:.0f} tokens/s over {streams.requests} requests")
    print(f"front end CPU: {summary['cpu_ms_per_1k_tokens']:.1f} ms per 1,000 tokens "
          f"({summary['cpu_share_of_one_core']:.0%} of one core); client TTFT median "
          f"{summary['ttft_ms_median']:.2f} ms, ITL median {summary['itl_ms_median']:.2f} ms, "
          f"p99 {summary['itl_ms_p99']:.2f} ms")
    if args.output_file:
        out = {"bench": "front-end-load", "command": " ".join(sys.argv), "machine": machine(),
               "event_loop": event_loop(), "http_parser": http_parser(), "summary": summary}
        Path(args.output_file).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14 and 15)


async def _load(args: argparse.Namespace, port: int, pid: int) -> tuple[StreamStats, float, float]:
    import aiohttp

    backend = CompletionsBackend(f"http://127.0.0.1:{port}")
    req = RequestInput(Turn([1 + (i * 7919) % 9000 for i in range(args.prompt_len)], args.prompt_len,
                            args.output_tokens))
    streams = StreamStats()
    connector = aiohttp.TCPConnector(limit=args.streams + 4)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), connector=connector) as http:
        await _one(backend, http, req, StreamStats())  # a warm-up request, not counted
        end = time.perf_counter() + args.duration_s

        async def stream() -> None:
            while time.perf_counter() < end:
                await _one(backend, http, req, streams)

        cpu_0, start = process_cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(args.streams)))
        return streams, process_cpu_s(pid) - cpu_0, time.perf_counter() - start


async def _one(backend: CompletionsBackend, http: Any, req: RequestInput, streams: StreamStats) -> None:
    """One streamed request through the benchmarks' client (`loadtests.client`), its times into `streams`."""
    outcome = await backend.send(http, req)
    if not outcome.success:
        raise SystemExit(f"/v1/completions failed: {outcome.error}")
    times = outcome.chunk_times
    if times:
        streams.ttft_s.append(times[0] - outcome.start)
        streams.itl_s += [b - a for a, b in itertools.pairwise(times)]
    streams.tokens += outcome.usage.completion_tokens or len(times)
    streams.requests += 1


def summarize(streams: StreamStats, cpu_s: float, elapsed_s: float) -> dict[str, Any]:
    itl = sorted(streams.itl_s)
    return {"requests": streams.requests, "tokens": streams.tokens, "elapsed_s": round(elapsed_s, 3),
            "tokens_per_s": round(streams.tokens / elapsed_s, 1), "cpu_s": round(cpu_s, 3),
            "cpu_ms_per_1k_tokens": round(cpu_s * 1e6 / max(1, streams.tokens), 2),
            "cpu_share_of_one_core": round(cpu_s / elapsed_s, 3),
            "ttft_ms_median": round(statistics.median(streams.ttft_s) * 1e3, 3) if streams.ttft_s else None,
            "itl_ms_median": round(statistics.median(itl) * 1e3, 3) if itl else None,
            "itl_ms_p99": round(itl[min(len(itl) - 1, int(0.99 * len(itl)))] * 1e3, 3) if itl else None}
