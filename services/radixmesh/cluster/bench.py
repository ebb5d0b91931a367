"""`radixmesh bench routing`: routing policies compared on one local CPU/GPU cluster.

Starts Redis, N workers and a tokenizer once; then, per policy, a router and a gateway in
front of them, and runs SGLang's generated-shared-prefix workload through
`radixmesh bench serving` (caches flushed first). Reports, per policy: cache hit rate
(and the ideal: every group's prefix computed once per cluster), throughput, TTFT p50/p99,
and the router's added latency, measured two ways: the router's own histogram (receipt to
the worker call, plus forwarding the first message) and paired 1-token requests sent
directly to a worker and through the router.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

POLICIES = ("cache-aware", "round-robin", "approx-tree")


def register_routing(sub: argparse._SubParsersAction) -> None:
    """Add `routing` to `radixmesh bench`."""
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("routing", help="compare routing policies on a local cluster (generated-shared-prefix)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("--workers", type=int, default=2, help="workers in the cluster")
    cmd.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy ids to compare")
    add_model_args(cmd)
    cmd.add_argument("--worker-args", default="--max-total-tokens 16384", help="extra flags for every worker")
    cmd.add_argument("--gsp-num-groups", type=int, default=8)
    cmd.add_argument("--gsp-prompts-per-group", type=int, default=3)
    cmd.add_argument("--gsp-system-prompt-len", type=int, default=512)
    cmd.add_argument("--gsp-question-len", type=int, default=32)
    cmd.add_argument("--gsp-output-len", type=int, default=8)
    cmd.add_argument("--request-rate", default="inf", help="sessions per second (inf: all at once)")
    cmd.add_argument("--max-concurrency", type=int, default=4)
    cmd.add_argument("--latency-samples", type=int, default=20, help="paired direct/routed requests per policy")
    cmd.add_argument("--seed", type=int, default=1)
    cmd.add_argument("--repeats", type=int, default=1,
                     help="rounds over the policies, alternating their order (the table shows means)")
    cmd.add_argument("--output-dir", type=Path, default=Path("docs/benchmarks"),
                     help="where routing-<device>.json and .md are written")
    cmd.add_argument("--name", default=None, help="file stem (default: routing-cpu or routing-gpu)")
    cmd.set_defaults(func=cmd_routing)


def cmd_routing(args: argparse.Namespace) -> int:
    from radixmesh.cluster.bench_cluster import BenchCluster
    from radixmesh.cluster.spec import ClusterSpec

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    work = Path(tempfile.mkdtemp(prefix="radixmesh-bench-routing-"))
    rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    model_args = ClusterSpec(model=args.model, load_format=args.load_format, tokenizer=args.tokenizer,
                             dtype=args.dtype, context_length=args.context_length).model_args()
    with BenchCluster(args.workers, model_args, args.worker_args, work) as infra:
        print(f"bench routing: {args.workers} workers ready ({infra.startup_s:.0f} s); logs in {work}", flush=True)
        for repeat in range(args.repeats):
            # Alternate the order so a drift in machine load does not favour one policy.
            for policy in policies if repeat % 2 == 0 else policies[::-1]:
                rounds[policy].append(_run_policy(args, infra, policy, work / f"serving-{policy}-{repeat}.json"))
    result = _result(args, rounds, _tokenizer_dir_of(infra))
    stem = args.name or f"routing-{result['device']['kind']}"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.output_dir / f"{stem}.json", args.output_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0


def _run_policy(args: argparse.Namespace, infra: Any, policy: str, output: Path) -> dict[str, Any]:
    with infra.front(policy) as front:
        latency = front.paired_latency(args.latency_samples)
        idle = front.scrape()
        serving = _run_serving(args, front.gateway_url, output)
        router_metrics = front.router_metrics(idle)
    print(f"bench routing: {policy}: hit rate {serving['cache_hit_rate']:.3f}, TTFT p50 {serving['ttft_p50_ms']:.0f} "
          f"ms, router overhead p50 {router_metrics['router_overhead_p50_ms']:.3f} ms", flush=True)
    return {**serving, **latency, **router_metrics}


def _tokenizer_dir_of(infra: Any) -> str | None:
    return getattr(infra, "tokenizer_dir", None)


def _run_serving(args: argparse.Namespace, gateway_url: str, output: Path, flush_cache: bool = True,
                 tokenizer: str | None = None) -> dict[str, Any]:
    """`bench serving` of the workload against `gateway_url` (`flush_cache`: through that URL first)."""
    cmd = [sys.executable, "-m", "radixmesh.cli", "bench", "serving", "--backend", "sglang", "--base-url",
           gateway_url, "--workload", "generated-shared-prefix", "--gsp-num-groups", str(args.gsp_num_groups),
           "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
           "--gsp-system-prompt-len", str(args.gsp_system_prompt_len),
           "--gsp-question-len", str(args.gsp_question_len), "--gsp-output-len", str(args.gsp_output_len),
           "--request-rate", str(args.request_rate), "--max-concurrency", str(args.max_concurrency),
           "--seed", str(args.seed), *(["--flush-cache"] if flush_cache else []), "--disable-tqdm",
           "--output-file", str(output), "--tokenizer", tokenizer or tokenizer_dir_of_gateway(gateway_url)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not output.is_file():
        raise RuntimeError(f"bench serving failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    data = json.loads(output.read_text())
    summary = data["runs"][0]["summary"]
    return {"num_completed": summary["num_completed"], "num_failed": summary["num_failed"],
            "duration_s": summary["duration_s"], "cache_hit_rate": summary["cache_hit_rate"] or 0.0,
            "request_throughput": summary["request_throughput"], "output_throughput": summary["output_throughput"],
            "total_throughput": summary["total_throughput"], "ttft_p50_ms": summary["ttft"]["median_ms"],
            "ttft_p99_ms": summary["ttft"]["p99_ms"], "e2e_p50_ms": summary["e2e"]["median_ms"],
            "total_input_tokens": summary["total_input_tokens"], "command": " ".join(cmd[2:])}


def tokenizer_dir_of_gateway(gateway_url: str) -> str:
    """The served tokenizer (the gateway's /model_info tokenizer_path, else model_path), else the default model's."""
    import urllib.request

    with urllib.request.urlopen(f"{gateway_url}/model_info", timeout=10) as response:
        info = json.loads(response.read())
    for key in ("tokenizer_path", "model_path"):
        path = info.get(key) or ""
        if path and Path(path).is_dir():
            return str(path)
    from radixmesh.engine.loader.default_model import ensure_default_model

    return str(ensure_default_model(progress=False))


def ideal_hit_rate(args: argparse.Namespace, tokenizer: Any) -> float:
    """Cache hit rate of one cache shared by the whole cluster, requests in workload order: each prompt
    reuses its longest common token prefix with any earlier prompt (all but its last token)."""
    from loadtests.workloads import get_workload

    gsp = argparse.Namespace(gsp_num_groups=args.gsp_num_groups, gsp_prompts_per_group=args.gsp_prompts_per_group,
                             gsp_system_prompt_len=args.gsp_system_prompt_len, gsp_question_len=args.gsp_question_len,
                             gsp_output_len=args.gsp_output_len, gsp_range_ratio=1.0, gsp_num_turns=1,
                             gsp_group_distribution="uniform", gsp_zipf_alpha=1.0)
    workload = get_workload("generated-shared-prefix").build(gsp, tokenizer, 0, args.seed)
    prompts = [tokenizer.encode(str(s.turns[0].prompt), add_special_tokens=False) for s in workload.sessions]
    reused = 0
    for i, ids in enumerate(prompts):
        best = max((_common_prefix_len(ids, earlier) for earlier in prompts[:i]), default=0)
        reused += min(best, len(ids) - 1)
    return reused / sum(len(ids) for ids in prompts)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _device() -> dict[str, Any]:
    from radixmesh.engine.config import cuda_available

    try:
        if cuda_available():  # imports torch only where a GPU driver is (this process needs it for nothing else)
            import torch

            return {"kind": "gpu", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    except ImportError:
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"kind": "cpu", "name": cpu, "cores": os.cpu_count(), "load_avg_1m_at_end": load}


def _mean(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float) and v == v]
    return statistics.fmean(numbers) if numbers else None


def summarize_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the rounds of one policy (numbers only); decision counts summed."""
    summary: dict[str, Any] = {}
    for key, value in rounds[0].items():
        if isinstance(value, int | float):
            summary[key] = _mean([r[key] for r in rounds])
    decisions: dict[str, int] = {}
    for r in rounds:
        for k, n in r.get("decisions", {}).items():
            decisions[k] = decisions.get(k, 0) + n
    summary["decisions"] = decisions
    summary["num_rounds"] = len(rounds)
    return summary


def _result(args: argparse.Namespace, rounds: dict[str, list[dict[str, Any]]],
            tokenizer_dir: str | None) -> dict[str, Any]:
    from loadtests.server_info import load_tokenizer

    ideal = ideal_hit_rate(args, load_tokenizer(tokenizer_dir)) if tokenizer_dir else None
    runs = {policy: summarize_rounds(r) for policy, r in rounds.items() if r}
    for run in runs.values():
        run["hit_rate_vs_ideal"] = run["cache_hit_rate"] / ideal if ideal else None
    argv = ["radixmesh", "bench", "routing", *sys.argv[sys.argv.index("routing") + 1:]] \
        if "routing" in sys.argv else ["radixmesh", "bench", "routing"]
    return {"benchmark": "routing-policies", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(argv), "device": _device(), "num_workers": args.workers,
            "model": args.model or "smollm2-135m-instruct", "worker_args": args.worker_args,
            "workload": {"name": "generated-shared-prefix", "num_groups": args.gsp_num_groups,
                         "prompts_per_group": args.gsp_prompts_per_group,
                         "system_prompt_len": args.gsp_system_prompt_len, "question_len": args.gsp_question_len,
                         "output_len": args.gsp_output_len, "request_rate": args.request_rate,
                         "max_concurrency": args.max_concurrency, "seed": args.seed},
            "ideal_hit_rate": ideal, "runs": runs, "rounds": rounds}


def markdown(result: dict[str, Any]) -> str:
    device = result["device"]
    units = "cores" if device["kind"] == "cpu" else "GPUs"
    where = f"{device['name']}, {device.get('cores', device.get('count'))} {units}"
    wl = result["workload"]
    lines = [
        "# Routing policies on a local cluster",
        "",
        f"Device: {device['kind'].upper()} ({where}); {result['num_workers']} workers of {result['model']} "
        f"(`{result['worker_args']}`), Redis, tokenizer, router and gateway on 127.0.0.1.",
        "",
        f"Workload: SGLang's generated-shared-prefix, {wl['num_groups']} groups x {wl['prompts_per_group']} prompts, "
        f"system prompt {wl['system_prompt_len']} tokens, question {wl['question_len']}, output {wl['output_len']}, "
        f"request rate {wl['request_rate']}, max concurrency {wl['max_concurrency']}; caches flushed before each run.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Ideal cache hit rate (one cache for the whole cluster: each prompt reuses its longest prefix shared with "
        f"an earlier one): {_fmt(result['ideal_hit_rate'], 3)}. Figures are means over "
        f"{next(iter(result['runs'].values()))['num_rounds']} round(s), policies in alternating order.",
        "",
        "| policy | hit rate | of ideal | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms "
        "| router overhead p50 ms, idle / loaded | decision p50 ms, idle / loaded | routed - direct p50 ms "
        "| direct TTFT p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, r in result["runs"].items():
        lines.append(f"| {policy} | {_fmt(r['cache_hit_rate'], 3)} | {_fmt(r['hit_rate_vs_ideal'], 2)} "
                     f"| {_fmt(r['request_throughput'], 2)} | {_fmt(r['output_throughput'], 1)} "
                     f"| {_fmt(r['ttft_p50_ms'], 0)} | {_fmt(r['ttft_p99_ms'], 0)} "
                     f"| {_fmt(r.get('router_overhead_idle_p50_ms'), 3)} / {_fmt(r['router_overhead_p50_ms'], 3)} "
                     f"| {_fmt(r.get('decision_idle_p50_ms'), 3)} / {_fmt(r['decision_p50_ms'], 3)} "
                     f"| {_fmt(r['routed_minus_direct_p50_ms'], 2)} | {_fmt(r.get('direct_ttft_p50_ms'), 1)} |")
    lines += [
        "",
        "Router overhead: the router's own histogram `radixmesh_router_overhead_seconds` (receipt of Generate "
        "to the worker call, plus attaching routing info to the first message), p50 interpolated in its buckets; "
        "idle: during the paired 1-token requests (workers nearly idle), loaded: during the workload, when the "
        "workers' model compute occupies the cores that the router and Redis share. "
        "Routed - direct: median of paired differences between a 1-token request through the router and the same "
        "request straight to the chosen worker (cached prompt); on a loaded CPU this is dominated by noise. "
        "Direct TTFT: that 1-token request straight to a worker, a gauge of how busy the machine was.",
        "",
    ]
    return "\n".join(lines)


def _fmt(value: Any, digits: int) -> str:
    if value is None or value != value:
        return "n/a"
    return f"{value:.{digits}f}"


def paired_median(routed_s: list[float], direct_s: list[float]) -> float:
    return statistics.median(r - d for r, d in zip(routed_s, direct_s)) * 1000.0
