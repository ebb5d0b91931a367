"""`radixmesh bench faults`: one fault at a time against a local `cluster up` cluster under bounded load.

Starts the cluster (2 workers, 2 router replicas, Redis, tokenizer, gateway; the default model
unless --model), then per scenario: reads the workers' KV slots in use once idle (caches
flushed), runs N streaming chat clients through the gateway, injects the fault, ends it (restart
with the same flags and port, SIGCONT, proxy back to pass), and reports sent / completed /
failed with a clear error / hung (no end within --timeout-s) / aborted, failures among requests
that had no token when the fault began, time to detect (the probe of the scenario, or the first
failed request), time to recover (end of fault to every service healthy and a request served),
KV slots in use once settled vs idle (leaked = the difference), and the RSS of every service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def register_faults(sub: argparse._SubParsersAction) -> None:
    """Add `faults` to `radixmesh bench`."""
    from radixmesh.cluster.faults.scenarios import SCENARIOS
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("faults", help="fault injection against a local cluster (kills, stops, proxies, aborts)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated scenario ids, in order")
    cmd.add_argument("--short", action="store_true", help="CI version: fewer clients and shorter faults")
    cmd.add_argument("--workers", type=int, default=2)
    cmd.add_argument("--routers", type=int, default=2, help="router replicas (the gateway is given all)")
    cmd.add_argument("--policy", default="cache-aware",
                     help="routing policy of the routers (worker faults hit the busiest worker)")
    add_model_args(cmd)
    cmd.add_argument("--worker-args", default="--max-total-tokens 8192", help="extra flags for every worker")
    cmd.add_argument("--router-args", default="", help="extra flags for every router")
    cmd.add_argument("--worker-drain-s", type=float, default=1.0,
                     help="the workers' --drain-timeout-s: on SIGTERM (rolling-restart) a worker lets its requests run "
                          "this long, then hands the rest to the others (the router migrates them)")
    cmd.add_argument("--concurrency", type=int, default=None, help="streaming clients (default 6, short 4)")
    cmd.add_argument("--max-requests", type=int, default=400, help="cap on requests per scenario")
    cmd.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 24, short 12)")
    cmd.add_argument("--timeout-s", type=float, default=60.0, help="a request with no end by then is hung")
    cmd.add_argument("--output-file", type=Path, default=None, help="write the results as JSON here")
    cmd.add_argument("--markdown-file", type=Path, default=None, help="write the table as Markdown here")
    cmd.set_defaults(func=cmd_faults)


def cmd_faults(args: argparse.Namespace) -> int:
    result = run_faults(args)
    table = markdown(result)
    print(table)
    if args.output_file:
        args.output_file.parent.mkdir(parents=True, exist_ok=True)
        args.output_file.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown_file:
        args.markdown_file.parent.mkdir(parents=True, exist_ok=True)
        args.markdown_file.write_text(table)
    return 0 if all(r.get("hung") == 0 and r.get("leaked_slots") == 0 for r in result["runs"]) else 1



def fault_spec(args: argparse.Namespace, state_dir: Path) -> Any:
    from radixmesh.cluster.spec import ClusterSpec

    worker_args = f"{args.worker_args} --drain-timeout-s {args.worker_drain_s:g}".strip()
    return ClusterSpec(num_workers=args.workers, num_routers=args.routers, policy=args.policy, model=args.model,
                       load_format=args.load_format, tokenizer=args.tokenizer, dtype=args.dtype,
                       context_length=args.context_length, worker_args=worker_args,
                       router_args=args.router_args, state_dir=state_dir, metrics=True)


def run_faults(args: argparse.Namespace) -> dict[str, Any]:
    from radixmesh.cluster.bench import _device
    from radixmesh.cluster.faults.harness import FaultCluster
    from radixmesh.cluster.faults.integrity import MAX_REFERENCE_REQUESTS, SHORT_REFERENCE_REQUESTS
    from radixmesh.cluster.faults.runner import LoadShape, run_scenario
    from radixmesh.cluster.faults.scenarios import SCENARIOS, Pace

    ids = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in ids if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    shape = LoadShape(concurrency=args.concurrency or (4 if args.short else 6), max_requests=args.max_requests,
                      max_tokens=args.max_tokens or (12 if args.short else 24), timeout_s=args.timeout_s,
                      after_recovery_s=2.0 if args.short else 5.0,
                      reference_requests=SHORT_REFERENCE_REQUESTS if args.short else MAX_REFERENCE_REQUESTS)
    runs = []
    work = Path(tempfile.mkdtemp(prefix="radixmesh-bench-faults-"))
    with FaultCluster(fault_spec(args, work)) as cluster:
        print(f"bench faults: cluster up in {cluster.startup_s:.0f} s; logs in {cluster.log_dir}", flush=True)
        for sid in ids:
            run = asyncio.run(run_scenario(SCENARIOS[sid](cluster, Pace(args.short)), shape))
            print(f"bench faults: {_line(run)}", flush=True)
            runs.append(run)
    return {"benchmark": "faults", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": _command(),
            "device": _device(), "short": args.short, "cluster": {"workers": args.workers, "routers": args.routers,
                                                                   "policy": args.policy,
                                                                   "model": args.model or "smollm2-135m-instruct",
                                                                   "worker_args": args.worker_args,
                                                                   "worker_drain_s": args.worker_drain_s},
            "load": shape.__dict__, "startup_s": round(cluster.startup_s, 1), "runs": runs}


def _command() -> str:
    tail = sys.argv[sys.argv.index("faults") + 1:] if "faults" in sys.argv else []
    return " ".join(["radixmesh", "bench", "faults", *tail])


def _line(r: dict[str, Any]) -> str:
    m = r["migration"]
    return (f"{r['scenario']}: sent {r['sent']}, completed {r['completed']}, failed {r['failed_clear']}, "
            f"hung {r['hung']}, aborted {r['aborted']}, failed-not-started {r['failed_not_started']} "
            f"(no text at fault {r['failed_no_text_at_fault']}), "
            f"detect {_fmt(r['detect_s'])} s, recover {_fmt(r['recover_s'])} s, leaked slots {r['leaked_slots']}; "
            f"tokens lost {r['tokens_lost']}, duplicated {r['tokens_duplicated']}, texts differing "
            f"{r['text_mismatches']} of {r['compared']}; {m['affected_streams']} streams through the fault, "
            f"stall p50 {_fmt(m['stall_p50_ms'], 0)} ms (ITL p50 {_fmt(m['itl_p50_ms'], 0)} ms), "
            f"migrations {sum(m['router_migrations'].values())}")


def _fmt(value: Any, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    device, c, load = result["device"], result["cluster"], result["load"]
    lines = [
        "# Fault injection on a local cluster",
        "",
        f"Device: {device['kind'].upper()} ({device['name']}, {device.get('cores', device.get('count'))} cores, "
        f"shared with other work; 1-min load average at the end {_fmt(device.get('load_avg_1m_at_end'))}). "
        f"Date: {result['created']}.",
        "",
        f"Cluster (`radixmesh cluster up` API): {c['workers']} workers of {c['model']} (`{c['worker_args']}`, "
        f"--drain-timeout-s {c.get('worker_drain_s', 30):g}), "
        f"{c['routers']} router replicas ({c['policy']}), Redis, tokenizer, gateway; up in {result['startup_s']} s.",
        f"Load per scenario: {load['concurrency']} streaming chat clients, {load['max_tokens']} tokens each, "
        f"at most {load['max_requests']} requests, {load['timeout_s']:.0f} s before a request counts as hung; "
        "kept up through the fault and for a few seconds after recovery.",
        "",
        f"Command: `{result['command']}`",
        "",
        "| scenario | fault | hold s | sent | completed | failed (clear) | hung | aborted | failed, not started "
        "(no text at fault) "
        "| detect s | recover s | KV slots settled / idle | leaked | latency p50 s | RSS MiB (sum) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        kv = f"{sum(r['kv_settled'].values())} / {sum(r['kv_idle'].values())}"
        lines.append(f"| {r['scenario']} | {r['fault']} | {r['hold_s']:.0f} | {r['sent']} | {r['completed']} "
                     f"| {r['failed_clear']} | {r['hung']} | {r['aborted']} | {r['failed_not_started']} "
                     f"({r['failed_no_text_at_fault']}) "
                     f"| {_fmt(r['detect_s'])} | {_fmt(r['recover_s'])} | {kv} | {r['leaked_slots']} "
                     f"| {_fmt(r['latency_p50_s'], 2)} | {sum(r['rss_mb'].values()):.0f} |")
    lines += ["", "Streams through the fault: tokens (every request greedy, exactly its max_tokens tokens, each with "
              "its log-prob), answers sent again once healthy, and the pause a moved stream saw.", "",
              "| scenario | streams checked | tokens lost | tokens duplicated | usage mismatches | texts differing "
              "(affected compared) | streams at the fault | router migrations | ITL p50 ms | stall p50 / max ms "
              "| TTFT p50 ms before / after the fault (max after) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        m = r["migration"]
        migrations = ", ".join(f"{k} {v}" for k, v in sorted(m["router_migrations"].items()) if v) or "0"
        lines.append(f"| {r['scenario']} | {r['checked_streams']} | {r['tokens_lost']} | {r['tokens_duplicated']} "
                     f"| {r['usage_mismatches']} | {r['text_mismatches']} of {r['compared']} "
                     f"({r['compared_affected']}) | {m['affected_streams']} | {migrations} "
                     f"| {_fmt(m['itl_p50_ms'], 0)} | {_fmt(m['stall_p50_ms'], 0)} / {_fmt(m['stall_max_ms'], 0)} "
                     f"| {_fmt(m['ttft_p50_ms_before'], 0)} / {_fmt(m['ttft_p50_ms_after_fault'], 0)} "
                     f"({_fmt(m['ttft_max_ms_after_fault'], 0)}) |")
    lines += ["", "Errors seen (the most frequent per scenario):", ""]
    for r in result["runs"]:
        for error, n in r["errors"].items():
            lines.append(f"- {r['scenario']}: {n} x `{error[:160]}`")
    reference = load.get("reference_requests", 24)  # (results written before the field existed: 24)
    lines += ["", _NOTES.replace("{reference_requests}", str(reference)), ""]
    return "\n".join(lines)


_NOTES = (
    "Columns. Failed (clear): the client got an HTTP error, an SSE error frame, a refused or reset connection, or a"
    " stream cut before `[DONE]`. Hung: no end within the timeout. Failed, not started: failures among requests"
    " that had received no text when the fault began and that the router did not report as failed mid-stream "
    "(they could have been re-routed); in brackets every failure with no text at the fault (a started stream's "
    "first tokens can trail the fault on a loaded machine). Detect: "
    "from the fault to the scenario's probe (a router lists the worker unhealthy; the gateway's /health fails) or "
    "the first failed request, whichever is first. Recover: from the end of the fault (restart issued, SIGCONT, "
    "proxy back to pass) to every service healthy, every router seeing every worker, and a request served; for "
    "killed processes it includes their start-up. Latency: median time of the completed requests. RSS: every "
    "service's process group, summed (per service in the JSON). KV slots: each worker's slots in use once no "
    "request runs and its cache is flushed, before the scenario (idle) and after it (settled). The proxy scenarios "
    "run through an extra router (round-robin) and gateway whose router reaches one worker through the proxy. "
    "Streams through the fault: tokens lost or duplicated count, over completed streams, the log-prob entries the "
    "client got against max_tokens; usage mismatches, streams whose usage.completion_tokens differs from them. Texts "
    "differing: requests streaming at a fault (and others, up to {reference_requests} in all) sent again one at a "
    "time once the cluster is healthy, greedy, compared with what the client got. Streams at the fault: streaming "
    "when a fault step began (each SIGTERM of a rolling restart). Stall: the longest gap between frames of those "
    "streams (the migration's pause as the client sees it), against the median gap between frames of the other "
    "streams (ITL). TTFT after the fault: requests sent within 10 s of a fault step. Router migrations: "
    "radixmesh_router_migrations_total by reason over the routers (a router killed in its scenario loses its count). "
    "The workers run with --drain-timeout-s of the cluster line (--worker-drain-s): a rolling restart's drained "
    "worker hands what still runs after that to the others.")
