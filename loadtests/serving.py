"""`radixmesh bench serving`: benchmark an OpenAI-compatible or SGLang-native endpoint.

Example:
    radixmesh bench serving --backend sglang --port 30000 --workload generated-shared-prefix \\
        --gsp-num-groups 4 --gsp-prompts-per-group 4 --request-rate 4 --output-file gsp.json --plot
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loadtests.workloads import WORKLOADS, add_workload_args

if TYPE_CHECKING:
    from loadtests.compare import EndpointSpec
    from loadtests.workloads.base import Workload

BACKEND_IDS = ("sglang", "openai", "openai-chat", "grpc", "grpc-chat")
"""Backend ids (see loadtests.client.BACKENDS and GRPC_BACKEND_IDS)."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serving", help="benchmark a serving endpoint with a generated workload",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serving_args(parser)
    parser.set_defaults(func=cmd_serving)


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("endpoint")
    target.add_argument("--backend", choices=BACKEND_IDS, default="sglang",
                        help="sglang: POST /generate; openai: /v1/completions; openai-chat: /v1/chat/completions; "
                             "grpc / grpc-chat: the gRPC API's StreamComplete / StreamChat (--grpc-target)")
    target.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000, help="server port (radixmesh serve's default)")
    target.add_argument("--model", default=None, help="model name sent to OpenAI endpoints (default: GET /v1/models)")
    target.add_argument("--endpoint", action="append", default=[], metavar="LABEL=URL[,backend=ID][,model=M]"
                        "[,header=K:V]", help="compare mode: run the workload against each endpoint (repeat)")
    target.add_argument("--grpc-target", default=None, metavar="HOST:PORT",
                        help="the server's public gRPC API, for --backend grpc and grpc-chat (radixmesh serve or "
                             "gateway --grpc-port)")
    target.add_argument("--grpc-ca", default=None, help="CA bundle (PEM) when the gRPC API serves TLS")
    target.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` (gRPC: metadata)")
    target.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or Hugging Face name (default: what the server's GET /model_info "
                             "names as tokenizer_path or model_path, when this machine has it)")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", "--dataset-name", dest="workload", choices=sorted(WORKLOADS), default="random")
    work.add_argument("--num-prompts", type=int, default=1000, help="sessions to send (one request each unless "
                      "multi-turn; generated-shared-prefix uses groups x prompts per group)")
    work.add_argument("--seed", type=int, default=1, help="seeds the workload and the arrival times")
    work.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    add_workload_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="sessions per second, Poisson arrivals; inf (default) sends all at once")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--warmup-requests", type=int, default=1, help="untimed requests sent first")
    load.add_argument("--request-timeout-s", type=float, default=600.0, help="time allowed to one request")
    load.add_argument("--flush-cache", action="store_true",
                      help="POST /flush_cache after the warm-up (SGLang-native servers), for a cold prefix cache")
    load.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out = parser.add_argument_group("output")
    out.add_argument("--output-file", default=None,
                     help="JSON with every request's timings (default bench-serving-WORKLOAD-TIME.json)")
    out.add_argument("--output-details", action="store_true", help="also store each request's generated text")
    out.add_argument("--plot", action="store_true", help="write latency CDF and throughput PNGs beside the JSON")


def cmd_serving(args: argparse.Namespace) -> int:
    try:
        return run_serving(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"bench serving: error: {exc}", file=sys.stderr)
        return 2


def run_serving(args: argparse.Namespace) -> int:
    from loadtests.compare import check_unique_labels, run_endpoints
    from loadtests.report import format_table, to_json, write_json
    from loadtests.runner import LoadConfig
    from loadtests.server_info import load_tokenizer, tokenizer_dir
    from loadtests.workloads import get_workload

    load = LoadConfig(request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                      num_warmup=args.warmup_requests, seed=args.seed, request_timeout_s=args.request_timeout_s,
                      show_progress=not args.disable_tqdm, flush_cache=args.flush_cache)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    endpoints = resolve_endpoints(args)
    check_unique_labels(endpoints)
    path, source = tokenizer_dir(args.tokenizer, endpoints[0].base_url)
    print(f"tokenizer: {path} (from {source})", file=sys.stderr)
    tokenizer = load_tokenizer(path, source)
    workload = get_workload(args.workload).build(args, tokenizer, args.num_prompts, args.seed)
    if args.disable_ignore_eos:
        workload = _without_ignore_eos(workload)
    print(f"workload: {workload.name}, {len(workload.sessions)} sessions, {workload.num_requests} requests, "
          f"{workload.total_prompt_len} new prompt tokens", file=sys.stderr)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    runs = run_endpoints(workload, endpoints, load, count_tokens)
    print(format_table(runs, workload, load))
    output = Path(args.output_file or f"bench-serving-{workload.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(output, to_json(runs, workload, load, with_text=args.output_details))
    print(f"wrote {output}")
    if args.plot:
        from loadtests.plots import write_plots

        for plot in write_plots(runs, output.with_suffix("")):
            print(f"wrote {plot}")
    return 0 if all(run.summary.num_completed for run in runs) else 1


def resolve_endpoints(args: argparse.Namespace) -> list[EndpointSpec]:
    from loadtests.compare import EndpointSpec, parse_endpoint
    from loadtests.server_info import served_model

    if args.endpoint:
        endpoints = [parse_endpoint(spec, args.backend, args.model, args.grpc_target, args.grpc_ca)
                     for spec in args.endpoint]
    else:
        base_url = args.base_url or f"http://{args.host}:{args.port}"
        endpoints = [EndpointSpec(label="default", base_url=base_url.rstrip("/"), backend=args.backend,
                                  model=args.model, grpc_target=args.grpc_target, grpc_ca=args.grpc_ca)]
    if args.api_key:
        endpoints = [dataclasses.replace(e, headers={"Authorization": f"Bearer {args.api_key}", **e.headers})
                     for e in endpoints]
    return [e if e.model or e.backend == "sglang" else dataclasses.replace(e, model=served_model(e.base_url))
            for e in endpoints]


def _without_ignore_eos(workload: Workload) -> Workload:
    from loadtests.workloads.base import Session

    sessions = tuple(Session(session_id=s.session_id, group_id=s.group_id,
                             turns=tuple(dataclasses.replace(t, ignore_eos=False) for t in s.turns))
                     for s in workload.sessions)
    return dataclasses.replace(workload, sessions=sessions)
