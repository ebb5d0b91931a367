"""`radixmesh bench peer-fetch`: TTFT of a long shared prefix fetched from a peer worker vs recomputed.

Starts two workers on this host (on CUDA: worker A on GPU 0, B on GPU 1, each seeing both, for the
cuda-ipc transport; on CPU: two CPU workers), has A compute a shared prefix of `--prefix-len` tokens
once, then sends B prompts made of that prefix plus a distinct question, alternately with
`peer_prefix` naming A (B fetches the prefix's KV: `--peer-fetch always`) and without (B computes
it). B's cache is flushed before every prompt, so each one starts from nothing. Reports the median
TTFT of both, their ratio and the bytes fetched, and ends with one JSON line (--result-file appends
it). Needs two GPUs for the GPU figure (`--device cuda`).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from radixmesh.cluster.processes import grpc_serving, is_alive, log_tail, spawn, stop_group
from radixmesh.index.redis_server import free_port
from radixmesh.protocol import sampling_pb2, worker_pb2, worker_pb2_grpc

START_TIMEOUT_S = 900.0


def register_peer_fetch(sub: argparse._SubParsersAction) -> None:
    from radixmesh.engine.args import add_model_args

    cmd = sub.add_parser("peer-fetch", help="TTFT of a shared prefix fetched from a peer worker vs recomputed",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(cmd)
    cmd.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per worker (needs two)")
    cmd.add_argument("--kv-transport", default=None, help="grpc | cuda-ipc (default: cuda-ipc on cuda, else grpc)")
    cmd.add_argument("--prefix-len", type=int, default=16384, help="tokens of the shared prefix")
    cmd.add_argument("--question-len", type=int, default=32, help="tokens after the prefix, distinct per prompt")
    cmd.add_argument("--output-len", type=int, default=4, help="tokens generated per prompt")
    cmd.add_argument("--samples", type=int, default=5, help="prompts per mode (fetched, recomputed)")
    cmd.add_argument("--worker-args", default="", help="extra flags for both workers")
    cmd.add_argument("--result-file", default=None, help="append the JSON result to this file")
    cmd.set_defaults(func=cmd_peer_fetch)


def _worker_args(args: argparse.Namespace, name: str, port: int, transport: str) -> list[str]:
    model = [f"--{k.replace('_', '-')}={v}" for k, v in (("model", args.model), ("load_format", args.load_format),
                                                         ("tokenizer", args.tokenizer), ("dtype", args.dtype),
                                                         ("context_length", args.context_length)) if v is not None]
    return ["worker", "--host", "127.0.0.1", "--port", str(port), "--worker-id", name, "--device", args.device,
            "--kv-transport", transport, "--peer-fetch", "always", "--metrics-port", "-1", *model,
            *args.worker_args.split()]


def _start_workers(args: argparse.Namespace, log_dir: Path) -> dict[str, tuple[Any, str]]:
    transport = args.kv_transport or ("cuda-ipc" if args.device == "cuda" else "grpc")
    envs = {"a": {"CUDA_VISIBLE_DEVICES": "0,1"}, "b": {"CUDA_VISIBLE_DEVICES": "1,0"}} if args.device == "cuda" \
        else {"a": {"OMP_NUM_THREADS": "1"}, "b": {"OMP_NUM_THREADS": "1"}}
    procs = {}
    for name in ("a", "b"):
        port = free_port()
        procs[name] = (spawn(f"worker-{name}", _worker_args(args, name, port, transport), log_dir, envs[name]),
                       f"127.0.0.1:{port}")
    deadline = time.monotonic() + START_TIMEOUT_S
    for name, (proc, address) in procs.items():
        while not grpc_serving(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start:\n{log_tail(log_dir, f'worker-{name}')}")
            time.sleep(0.5)
    return procs


def _generate(stub: worker_pb2_grpc.WorkerServiceStub, ids: list[int], rid: str, output_len: int,
              peer: worker_pb2.PeerPrefix | None) -> tuple[float, worker_pb2.GenerateResponse]:
    request = worker_pb2.GenerateRequest(request_id=rid, token_ids=ids, sampling_params=sampling_pb2.SamplingParams(
        max_new_tokens=output_len, temperature=0.0, ignore_eos=True))
    if peer is not None:
        request.peer_prefix.CopyFrom(peer)
    start = time.perf_counter()
    first: worker_pb2.GenerateResponse | None = None
    ttft = 0.0
    for msg in stub.Generate(request, timeout=600):
        if first is None and msg.token_ids:
            first, ttft = msg, time.perf_counter() - start
    assert first is not None, "no token came back"
    return ttft, first


def _measure(args: argparse.Namespace, addresses: dict[str, str], vocab: int) -> dict[str, Any]:
    prefix = [1] + [100 + (i * 7919) % (vocab - 200) for i in range(args.prefix_len - 1)]
    stubs = {n: worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(a)) for n, a in addresses.items()}
    _generate(stubs["a"], [*prefix, 5, 6, 7], "warm-a", 1, None)  # A computes the prefix once
    _generate(stubs["b"], [2, 3, 4, 5], "warm-b", 1, None)  # B's first pass (kernels compiled, graphs captured)
    peer = worker_pb2.PeerPrefix(worker_id="a", address=addresses["a"], num_tokens=args.prefix_len)
    ttft: dict[str, list[float]] = {"fetched": [], "recomputed": []}
    fetched_tokens: list[int] = []
    for i in range(2 * args.samples):
        mode = "fetched" if i % 2 == 0 else "recomputed"
        stubs["b"].FlushCache(worker_pb2.FlushCacheRequest(), timeout=60)
        question = [100 + (i * 131 + j * 17) % (vocab - 200) for j in range(args.question_len)]
        seconds, first = _generate(stubs["b"], [*prefix, *question], f"q{i}", args.output_len,
                                   peer if mode == "fetched" else None)
        ttft[mode].append(seconds)
        if mode == "fetched":
            fetched_tokens.append(first.fetched_tokens)
    fetched, recomputed = statistics.median(ttft["fetched"]), statistics.median(ttft["recomputed"])
    return {"median_ttft_fetched_s": round(fetched, 4), "median_ttft_recomputed_s": round(recomputed, 4),
            "ttft_speedup": round(recomputed / fetched, 3), "fetched_tokens": fetched_tokens,
            "ttft_fetched_s": [round(t, 4) for t in ttft["fetched"]],
            "ttft_recomputed_s": [round(t, 4) for t in ttft["recomputed"]]}


def cmd_peer_fetch(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="radixmesh-peer-fetch-"))
    procs: dict[str, tuple[Any, str]] = {}
    try:
        procs = _start_workers(args, log_dir)
        addresses = {name: address for name, (_, address) in procs.items()}
        info = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(addresses["b"])).GetModelInfo(
            worker_pb2.GetModelInfoRequest(), timeout=60)
        result = {"bench": "peer-fetch", "device": args.device, "host": platform.node(), "model": info.model_name,
                  "prefix_len": args.prefix_len, "question_len": args.question_len, "samples": args.samples,
                  "kv_transport": args.kv_transport or ("cuda-ipc" if args.device == "cuda" else "grpc"),
                  "command": " ".join(sys.argv), **_measure(args, addresses, info.vocab_size)}
    finally:
        for proc, _ in procs.values():
            if is_alive(proc.pid):
                stop_group(proc.pid, "radixmesh.cli")
    print(f"TTFT of a {args.prefix_len}-token prefix: fetched {result['median_ttft_fetched_s']} s, recomputed "
          f"{result['median_ttft_recomputed_s']} s (x{result['ttft_speedup']}); logs in {log_dir}")
    line = json.dumps(result)
    print(line)
    if args.result_file:
        with open(args.result_file, "a") as fh:
            fh.write(line + "\n")
    return 0
