"""`radixmesh bench front-end`: `serve`'s front-end time per prompt, from the request to the scheduler.

Starts `serve`'s front end over a stub scheduler (`radixmesh.gateway.stub_scheduler`: the real HTTP app,
tokenizer pool, engine client and ZMQ channel; the stub notes when each request's token ids arrive) and sends
it prompts one at a time: random token ids decoded to text (the `random` workload's prompts) as
/v1/completions text, the same kind of text as a chat message, and random token ids as they are
(`random-ids`), at each `--lengths`, interleaved round by round so drift in the machine's speed falls on
all alike, each after a pause (`--gap-ms`) that leaves the server idle. Each request asks for one token.

Per request, the front-end time is the stub's arrival time of the token ids minus the time the client
started sending (`time.monotonic_ns()`, one clock for every process on the machine): HTTP, JSON and request
validation, the chat template, tokenization, admission and the message to the scheduler. Reported per kind
and length: its median (and p10 / p90), the server's own tokenization time (`Server-Timing: tokenize`), and
the cost per 1,000 prompt tokens between the shortest and the longest length. The response time (to the whole
response, or with `--stream` to its first event) shows what the way back adds.

    radixmesh bench front-end --lengths 1024 4096 --num-prompts 30 --output-file front-end.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

KINDS = ("text", "chat", "ids")
"""Prompt kinds: completion text, one chat message, token ids."""
_TOKENIZE = re.compile(r"tokenize;dur=([0-9.]+)")


@dataclass(frozen=True)
class Sample:
    """One request's timings (milliseconds) and its prompt's length in token ids at the scheduler."""

    kind: str
    length: int
    front_end_ms: float
    response_ms: float
    """To the whole response (a streamed one: to its first event)."""
    tokenize_ms: float | None
    num_input_ids: int


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("front-end", help="serve's front-end time per prompt (stub scheduler, one at a time)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="whose tokenizer and config to use (default: the default model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt lengths in tokens")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--num-prompts", type=int, default=30, help="requests per kind and length")
    parser.add_argument("--warmup-requests", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=30.0,
                        help="pause between requests, so each finds the server idle (as at 1 req/s)")
    parser.add_argument("--tokenizer-workers", type=int, default=None, help="serve's --tokenizer-workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true",
                        help="streamed requests (SSE): the response time is then the time to the first event")
    parser.add_argument("--output-file", default=None, help="JSON with the summary and every request")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loadtests.workloads.base import random_token_ids, usable_token_ids
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.loader import prepare_model

    prepared = prepare_model(args.model, "dummy")  # its config and tokenizer: no weights are read
    assert prepared.tokenizer_path is not None, "the model has no tokenizer"
    tokenizer = load_tokenizer(prepared.tokenizer_path)
    rng = random.Random(args.seed)
    vocab = usable_token_ids(tokenizer)
    cells = [(kind, length) for length in args.lengths for kind in args.kinds]
    bodies: dict[tuple[str, int], list[tuple[str, bytes]]] = {}
    for kind, length in cells:
        bodies[(kind, length)] = [_request(kind, random_token_ids(rng, vocab, length), tokenizer, args.stream)
                                  for _ in range(args.num_prompts + args.warmup_requests)]
    with tempfile.TemporaryDirectory(prefix="radixmesh-front-end-") as tmp:
        record = Path(tmp) / "arrivals"
        record.touch()
        port = free_port()
        server = start_stub_server(args, port, record)
        try:
            samples = _measure(port, cells, bodies, record, args.warmup_requests, args.gap_ms / 1e3)
        finally:
            server.terminate()
            server.wait(30)
    summary = summarize(samples, args.lengths)
    _print(summary)
    if args.output_file:
        out = {"bench": "front-end", "command": " ".join(sys.argv), "machine": machine(), "summary": summary,
               "samples": [asdict(s) for s in samples]}
        Path(args.output_file).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _request(kind: str, ids: list[int], tokenizer: Any, stream: bool = False) -> tuple[str, bytes]:
    params = {"max_tokens": 1, "temperature": 0, "stream": stream}
    if kind == "ids":
        return "/v1/completions", json.dumps({"prompt": ids, **params}).encode()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if kind == "chat":
        return "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}], **params}).encode()
    return "/v1/completions", json.dumps({"prompt": text, **params}).encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_stub_server(args: argparse.Namespace, port: int, record: Path,
                      extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """`serve`'s front end over the stub scheduler (`args.model`, `args.tokenizer_workers`; `extra`: more of the
    stub's flags), once it answers /health."""
    command = [sys.executable, "-m", "radixmesh.gateway.stub_scheduler", "--port", str(port), "--record", str(record),
               *extra]
    if args.model:
        command += ["--model", args.model]
    if args.tokenizer_workers is not None:
        command += ["--tokenizer-workers", str(args.tokenizer_workers)]
    server = subprocess.Popen(command, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the front end exited with code {server.returncode} while starting")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return server
        except OSError:
            pass
        time.sleep(0.2)
    server.terminate()
    raise SystemExit("the front end did not start in 120 s")


def _measure(port: int, cells: list[tuple[str, int]], bodies: dict[tuple[str, int], list[tuple[str, bytes]]],
             record: Path, num_warmup: int, gap_s: float = 0.0) -> list[Sample]:
    """Send every cell's i-th request in turn (one open request at a time) and match the stub's records."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent: list[tuple[str, int, int, float, float | None]] = []
    num_rounds = len(next(iter(bodies.values())))
    for i in range(num_rounds):
        for cell in cells:
            path, body = bodies[cell][i]
            time.sleep(gap_s)
            start_ns = time.monotonic_ns()
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status == 200 and response.getheader("Content-Type", "").startswith("text/event-stream"):
                _read_first_event(response)
            response_ms = (time.monotonic_ns() - start_ns) / 1e6
            payload = response.read()
            if response.status != 200:
                raise SystemExit(f"{path} answered {response.status}: {payload[:300]!r}")
            timing = _TOKENIZE.search(response.getheader("Server-Timing") or "")
            sent.append((cell[0], cell[1], start_ns, response_ms, float(timing.group(1)) if timing else None))
    conn.close()
    arrivals = [line.split() for line in record.read_text().splitlines()]
    assert len(arrivals) == len(sent), f"{len(sent)} requests sent, {len(arrivals)} reached the stub"
    samples = []
    for index, ((kind, length, start_ns, response_ms, tokenize_ms), arrival) in enumerate(zip(sent, arrivals)):
        if index >= num_warmup * len(cells):
            samples.append(Sample(kind, length, (int(arrival[1]) - start_ns) / 1e6, response_ms, tokenize_ms,
                                  int(arrival[2])))
    return samples


def _read_first_event(response: http.client.HTTPResponse) -> None:
    while True:
        line = response.readline()
        if not line or line.startswith(b"data:"):
            return


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(samples: list[Sample], lengths: list[int]) -> dict[str, Any]:
    """Medians per kind and length; per 1,000 prompt tokens between the shortest and longest length."""
    cells: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(s.kind for s in samples):
        for length in lengths:
            rows = [s for s in samples if s.kind == kind and s.length == length]
            if not rows:
                continue
            front = [s.front_end_ms for s in rows]
            tokenize = [s.tokenize_ms for s in rows if s.tokenize_ms is not None]
            cells[f"{kind}@{length}"] = {
                "kind": kind, "length": length, "requests": len(rows),
                "input_ids_median": statistics.median(s.num_input_ids for s in rows),
                "front_end_ms_median": round(statistics.median(front), 3),
                "front_end_ms_p10": round(_quantile(front, 0.1), 3),
                "front_end_ms_p90": round(_quantile(front, 0.9), 3),
                "tokenize_ms_median": round(statistics.median(tokenize), 3) if tokenize else None,
                "response_ms_median": round(statistics.median(s.response_ms for s in rows), 3)}
    per_1k: dict[str, float] = {}
    low, high = min(lengths), max(lengths)
    for kind in dict.fromkeys(s.kind for s in samples):
        a, b = cells.get(f"{kind}@{low}"), cells.get(f"{kind}@{high}")
        if a and b and b["input_ids_median"] != a["input_ids_median"]:
            slope = (b["front_end_ms_median"] - a["front_end_ms_median"]) / (
                b["input_ids_median"] - a["input_ids_median"]) * 1e3
            per_1k[kind] = round(slope, 3)
    return {"cells": cells, "front_end_ms_per_1k_tokens": per_1k}


def _print(summary: dict[str, Any]) -> None:
    print(f"{'kind':6} {'length':>7} {'ids':>6} {'front end ms (p10-p90)':>24} {'tokenize ms':>12} {'response ms':>12}")
    for cell in summary["cells"].values():
        tokenize = "-" if cell["tokenize_ms_median"] is None else f"{cell['tokenize_ms_median']:.2f}"
        spread = f"{cell['front_end_ms_median']:.2f} ({cell['front_end_ms_p10']:.2f}-{cell['front_end_ms_p90']:.2f})"
        print(f"{cell['kind']:6} {cell['length']:>7} {cell['input_ids_median']:>6.0f} {spread:>24} "
              f"{tokenize:>12} {cell['response_ms_median']:>12.2f}")
    for kind, slope in summary["front_end_ms_per_1k_tokens"].items():
        print(f"{kind}: {slope:.2f} ms per 1,000 prompt tokens")


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": os.getloadavg()}
