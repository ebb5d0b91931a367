"""`radixmesh bench soak`: mixed load against a local `cluster up` cluster for a while, memory watched.

The load cycles through streamed chat, plain completions, JSON-schema structured chat, n = 2
completions and streamed chats whose client goes away after two frames. Every --sample-s the
RSS of every service (its whole process group) and each worker's KV usage are sampled. Reported:
each service's RSS growth from the end of the warm-up to the end (medians of the three samples
at either end), the outcomes of the requests, and the KV slots still in use once the load stopped
and the caches were flushed (leaked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from radixmesh.cluster.faults.load import LoadGen, RequestSpec, chat_stream

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def mixed_spec(i: int, max_tokens: int = 24) -> RequestSpec:
    """Request i of the mixed load (five kinds in turn)."""
    kind = i % 5
    if kind == 0:
        return chat_stream(i, max_tokens)
    if kind == 1:
        return RequestSpec("completion", "/v1/completions",
                           {"prompt": f"Fact {i}: the number {i} is", "max_tokens": max_tokens, "temperature": 0.0})
    if kind == 2:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        return RequestSpec("structured", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": f"Invent person number {i} as JSON."}],
                            "max_tokens": 48, "temperature": 0.7, "seed": i, "response_format": fmt})
    if kind == 3:
        return RequestSpec("completion-n2", "/v1/completions",
                           {"prompt": f"Story {i} begins:", "max_tokens": max_tokens, "temperature": 0.8, "n": 2})
    spec = chat_stream(i, 64)
    return RequestSpec("chat-stream-abort", spec.path, spec.body, abort_after_frames=2)


def register_soak(sub: argparse._SubParsersAction) -> None:
    """Add `soak` to `radixmesh bench`."""
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("soak", help="mixed load on a local cluster for a while, RSS and KV usage sampled",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("--duration-s", type=float, default=600.0, help="how long the load runs")
    cmd.add_argument("--warmup-s", type=float, default=120.0, help="growth is measured from the end of this")
    cmd.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    cmd.add_argument("--concurrency", type=int, default=4, help="clients sending at once")
    cmd.add_argument("--timeout-s", type=float, default=120.0, help="a request with no end by then is hung")
    cmd.add_argument("--workers", type=int, default=2)
    cmd.add_argument("--routers", type=int, default=1)
    cmd.add_argument("--no-grammar", action="store_true", help="no grammar service (workers compile grammars)")
    add_model_args(cmd)
    cmd.add_argument("--worker-args", default="--max-total-tokens 8192", help="extra flags for every worker")
    cmd.add_argument("--output-file", type=Path, default=None, help="write the results (and samples) as JSON")
    cmd.add_argument("--markdown-file", type=Path, default=None, help="write the summary as Markdown")
    cmd.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    from radixmesh.cluster.bench_faults import fault_spec
    from radixmesh.cluster.faults.harness import FaultCluster

    args.policy, args.router_args = "cache-aware", ""
    spec = fault_spec(args, Path(tempfile.mkdtemp(prefix="radixmesh-bench-soak-")))
    spec = type(spec)(**{**spec.__dict__, "grammar": not args.no_grammar})
    with FaultCluster(spec) as cluster:
        print(f"bench soak: cluster up in {cluster.startup_s:.0f} s; logs in {cluster.log_dir}", flush=True)
        result = asyncio.run(_soak(args, cluster))
    text = markdown(result)
    print(text)
    if args.output_file:
        args.output_file.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown_file:
        args.markdown_file.write_text(text)
    return 0 if result["leaked_slots"] == 0 and result["requests"]["hung"] == 0 else 1


async def _soak(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    from radixmesh.cluster.bench import _device
    from radixmesh.cluster.faults.load import summarize

    idle_kv = await asyncio.to_thread(cluster.settled_kv)
    load = LoadGen(cluster.gateway_url, mixed_spec, args.concurrency, 10**9, args.timeout_s)
    running = asyncio.create_task(load.run())
    samples = []
    while load.now_s() < args.duration_s:
        samples.append(await asyncio.to_thread(_sample, cluster, load))
        print(f"bench soak: {_sample_line(samples[-1])}", flush=True)
        await asyncio.sleep(max(0.0, args.sample_s * len(samples) - load.now_s()))
    load.stop()
    records = await running
    settled_kv = await asyncio.to_thread(cluster.settled_kv)
    summary = summarize(records)
    by_kind = {kind: summarize([r for r in records if r.kind == kind]) for kind in sorted({r.kind for r in records})}
    return {"benchmark": "soak", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": "radixmesh bench soak " + " ".join(_argv_tail()), "device": _device(),
            "duration_s": args.duration_s, "warmup_s": args.warmup_s, "sample_s": args.sample_s,
            "concurrency": args.concurrency, "workers": args.workers, "routers": args.routers,
            "grammar_service": not args.no_grammar, "requests": summary, "by_kind": by_kind,
            "rss_growth": rss_growth(samples, args.warmup_s), "kv_idle": idle_kv, "kv_settled": settled_kv,
            "leaked_slots": sum(max(0, settled_kv[w] - idle_kv.get(w, 0)) for w in settled_kv), "samples": samples}


def _argv_tail() -> list[str]:
    import sys

    return sys.argv[sys.argv.index("soak") + 1:] if "soak" in sys.argv else []


def _sample(cluster: Any, load: LoadGen) -> dict[str, Any]:
    kv: dict[str, dict[str, Any]] = {}
    for name in cluster.worker_names:
        try:
            reply = cluster.worker_load(name, timeout_s=5).load
            kv[name] = {"kv_used_tokens": int(reply.kv_used_tokens), "running": int(reply.num_running_reqs),
                        "waiting": int(reply.num_waiting_reqs)}
        except Exception as exc:  # a sample that cannot be taken is recorded as such
            kv[name] = {"error": type(exc).__name__}
    return {"t_s": round(load.now_s(), 1), "rss_mb": cluster.rss_mb(), "kv": kv,
            "sent": len(load.records), "completed": load.num_completed}


def _sample_line(s: dict[str, Any]) -> str:
    kv = ", ".join(f"{w} {v.get('kv_used_tokens', '?')}" for w, v in s["kv"].items())
    return (f"t={s['t_s']:.0f} s sent {s['sent']} completed {s['completed']}; RSS MiB "
            + ", ".join(f"{n} {m:.0f}" for n, m in s["rss_mb"].items()) + f"; KV used {kv}")


def rss_growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per service: median RSS of the first three samples after the warm-up and of the last three, and the
    growth between them in percent."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return {}
    growth = {}
    for name in after[0]["rss_mb"]:
        start = statistics.median(s["rss_mb"].get(name, 0.0) for s in after[:3])
        end = statistics.median(s["rss_mb"].get(name, 0.0) for s in after[-3:])
        growth[name] = {"after_warmup_mb": start, "end_mb": end,
                        "growth_pct": round(100.0 * (end - start) / start, 2) if start else 0.0}
    return growth


def markdown(result: dict[str, Any]) -> str:
    device, req = result["device"], result["requests"]
    lines = [
        "# Soak: mixed load on a local cluster",
        "",
        f"Device: {device['kind'].upper()} ({device['name']}, {device.get('cores')} cores, shared with other work; "
        f"1-min load average at the end {device.get('load_avg_1m_at_end', 0):.1f}). Date: {result['created']}.",
        "",
        f"Cluster (`radixmesh cluster up` API): {result['workers']} workers, {result['routers']} router(s), Redis, "
        f"tokenizer, {'grammar service, ' if result['grammar_service'] else ''}gateway. Load: "
        f"{result['concurrency']} clients for {result['duration_s']:.0f} s cycling through streamed chat, "
        "completions, JSON-schema structured chat, n = 2 completions, and streamed chats abandoned after two frames; "
        f"samples every {result['sample_s']:.0f} s, growth measured after a {result['warmup_s']:.0f} s warm-up.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Requests: sent {req['sent']}, completed {req['completed']}, failed {req['failed_clear']}, "
        f"hung {req['hung']}, "
        f"aborted by the client {req['aborted']}. KV slots in use once settled (caches flushed): "
        f"{sum(result['kv_settled'].values())}, idle before: {sum(result['kv_idle'].values())}; "
        f"leaked: {result['leaked_slots']}.",
        "",
        "| kind | sent | completed | failed | hung | aborted | latency p50 s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, s in result["by_kind"].items():
        lines.append(f"| {kind} | {s['sent']} | {s['completed']} | {s['failed_clear']} | {s['hung']} | {s['aborted']} "
                     f"| {s['latency_p50_s'] if s['latency_p50_s'] is not None else 'n/a'} |")
    lines += ["", "| service | RSS MiB after warm-up | RSS MiB at end | growth % |", "| --- | --- | --- | --- |"]
    for name, g in result["rss_growth"].items():
        lines.append(f"| {name} | {g['after_warmup_mb']:.1f} | {g['end_mb']:.1f} | {g['growth_pct']:+.2f} |")
    worst = max((g["growth_pct"] for g in result["rss_growth"].values()), default=float("nan"))
    lines += ["", f"Largest growth after warm-up: {worst:+.2f} % (target <= 5 %).", ""]
    return "\n".join(lines)
