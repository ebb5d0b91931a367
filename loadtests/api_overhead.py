"""`radixmesh bench grpc-vs-http`: what the public gRPC API adds over the HTTP API on one server.

The same requests go to both APIs of one server (`radixmesh serve --grpc-port`, or a gateway), one at a
time, interleaved in pairs whose order alternates, so drift in the machine's speed falls on both alike.
Every request has its own prompt (a distinct first token, so nothing is served from the prefix cache)
of the same length, asks for exactly `--output-len` tokens (ignore_eos, greedy) and is streamed
(HTTP: SSE of /v1/completions or /v1/chat/completions; gRPC: StreamComplete or StreamChat).

Per request: time to first token (TTFT), mean inter-token latency (ITL) and end-to-end latency.
Reported: each API's medians, and the median over pairs of (gRPC - HTTP): added latency per request
(TTFT) and per token (ITL). Negative means gRPC was faster. JSON with every request goes to --output-file.

    radixmesh serve --grpc-port 50050 &
    radixmesh bench grpc-vs-http --port 8000 --grpc-target 127.0.0.1:50050 --num-pairs 40
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORDS = ("river", "stone", "lantern", "garden", "orbit", "violet", "engine", "harbor", "meadow", "signal")


@dataclass(frozen=True)
class Sample:
    """One streamed request's timings, in milliseconds."""

    api: str
    pair: int
    ok: bool
    ttft_ms: float
    itl_ms: float
    e2e_ms: float
    num_chunks: int
    cached_tokens: int = 0
    error: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("grpc-vs-http", help="latency the gRPC API adds over the HTTP API on one server",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the server")
    parser.add_argument("--base-url", default=None, help="HTTP URL of the server (default http://HOST:PORT)")
    parser.add_argument("--grpc-target", required=True, metavar="HOST:PORT", help="the server's gRPC API")
    parser.add_argument("--grpc-ca", default=None, help="CA bundle when the gRPC API serves TLS")
    parser.add_argument("--api-key", default=None, help="sent as Authorization (HTTP) and authorization (gRPC)")
    parser.add_argument("--chat", action="store_true", help="chat endpoints (default: completions)")
    parser.add_argument("--num-pairs", type=int, default=40, help="requests per API")
    parser.add_argument("--prompt-words", type=int, default=64, help="words of each prompt")
    parser.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--output-file", default=None, help="JSON with every request (default: none)")
    parser.set_defaults(func=cmd_grpc_vs_http)


def cmd_grpc_vs_http(args: argparse.Namespace) -> int:
    if args.num_pairs < 2 or args.output_len < 2:
        print("bench grpc-vs-http: error: --num-pairs and --output-len must be >= 2", file=sys.stderr)
        return 2
    result = asyncio.run(run(args))
    print(format_result(result))
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output_file}")
    return 0 if all(s["ok"] for s in result["samples"]) else 1


def _prompt(index: int, num_words: int) -> str:
    # The request's number, last digit first, opens the prompt: consecutive requests differ from their first
    # token on, so next to nothing is served from the prefix cache (`cached_tokens` of each sample says how much).
    body = " ".join(WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(num_words - 1))
    return f"{str(index)[::-1]}: {body}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    from loadtests.client import RequestInput, make_backend
    from loadtests.server_info import served_model
    from loadtests.workloads.base import Turn

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = served_model(base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    names = ("openai-chat", "grpc-chat") if args.chat else ("openai", "grpc")
    backends = {api: make_backend(name, base_url, model=model, headers=headers, grpc_target=args.grpc_target,
                                  grpc_ca=args.grpc_ca) for api, name in zip(("http", "grpc"), names)}
    samples: list[Sample] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        for api, backend in backends.items():  # warm-up: connections, first-request costs
            await backend.send(http, RequestInput(Turn(_prompt(99_999 - len(api), args.prompt_words), 0, 4)))
        for pair in range(args.num_pairs):
            order = ("http", "grpc") if pair % 2 == 0 else ("grpc", "http")
            for k, api in enumerate(order):
                turn = Turn(prompt=_prompt(2 * pair + k, args.prompt_words), prompt_len=0, output_len=args.output_len)
                outcome = await backends[api].send(http, RequestInput(turn))
                samples.append(_sample(api, pair, outcome))
    for backend in backends.values():
        await backend.aclose()
    return {"command": " ".join(["radixmesh", "bench", "grpc-vs-http", *sys.argv[3:]]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": _device(),
            "endpoints": {"http": base_url, "grpc": args.grpc_target, "model": model, "chat": args.chat},
            "params": {"num_pairs": args.num_pairs, "prompt_words": args.prompt_words,
                       "output_len": args.output_len},
            "summary": summarize(samples), "samples": [asdict(s) for s in samples]}


def _sample(api: str, pair: int, outcome: Any) -> Sample:
    times = outcome.chunk_times
    if not outcome.success or not times:
        return Sample(api, pair, False, 0.0, 0.0, 0.0, len(times), error=outcome.error or "no output")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    itl = statistics.fmean(gaps) if gaps else 0.0
    return Sample(api, pair, True, (times[0] - outcome.start) * 1e3, itl * 1e3, (outcome.end - outcome.start) * 1e3,
                  len(times), outcome.usage.cached_tokens or 0)


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """Each API's medians and the paired (gRPC - HTTP) medians, in milliseconds."""
    by = {(s.api, s.pair): s for s in samples if s.ok}
    pairs = sorted({p for (_, p) in by if ("http", p) in by and ("grpc", p) in by})
    out: dict[str, Any] = {"num_pairs": len(pairs), "num_failed": sum(1 for s in samples if not s.ok),
                           "mean_cached_tokens": statistics.fmean([s.cached_tokens for s in samples if s.ok] or [0])}
    for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
        for api in ("http", "grpc"):
            values = [getattr(by[(api, p)], metric) for p in pairs]
            out[f"{api}_median_{metric}"] = statistics.median(values) if values else None
        diffs = sorted(getattr(by[("grpc", p)], metric) - getattr(by[("http", p)], metric) for p in pairs)
        if diffs:
            quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
            out[f"added_median_{metric}"] = statistics.median(diffs)
            out[f"added_iqr_{metric}"] = [quartiles[0], quartiles[2]]
    return out


def format_result(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = ["============ gRPC vs HTTP, same server ============",
             f"{'device':<28}{result['device']['cpu']} ({result['device']['cores']} cores)",
             f"{'pairs (failed requests)':<28}{s['num_pairs']} ({s['num_failed']})",
             f"{'':<28}{'HTTP':>10}{'gRPC':>10}{'added':>10}  added IQR"]
    rows = (("ttft_ms", "median TTFT (ms)"), ("itl_ms", "median ITL (ms)"), ("e2e_ms", "median E2E (ms)"))
    for metric, label in rows:
        if s.get(f"added_median_{metric}") is None:
            continue
        low, high = s[f"added_iqr_{metric}"]
        lines.append(f"{label:<28}{s[f'http_median_{metric}']:>10.2f}{s[f'grpc_median_{metric}']:>10.2f}"
                     f"{s[f'added_median_{metric}']:>+10.3f}  [{low:+.3f}, {high:+.3f}]")
    lines.append("=" * 51)
    return "\n".join(lines)


def _device() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg_1m": load, "python": platform.python_version()}
