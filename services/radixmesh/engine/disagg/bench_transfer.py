"""`radixmesh bench kv-transfer`: moving a prompt's KV from a prefill to a decode process with a real KV transport.

This process is the prefill side: a KV pool filled with random data and the transport's export. A
spawned process is the decode side (`bench_transfer_peer`): its own pool and the transport's receive.
On CUDA the sender's pool is on GPU 0 and the receiver's on GPU 1, each process seeing both (cuda-ipc
matches GPUs by UUID); on CPU both pools are in host memory. For each `--num-tokens` both sides draw
random distinct slots (as a worker's allocator hands out), then every repeat times:
  export    the transport's export, device work synchronized (cuda-ipc direct: copy the slot indices
            into the shared slot ring and record an IPC event; cuda-ipc staging: gather into a staging
            buffer and share its IPC handle; grpc: gather and copy to the host);
  handoff   the chunks' messages to the receiver and its reply (round trip less the receiver's work);
            cuda-ipc sends handles (direct: the pool's, the ring's and the event's), grpc the KV bytes;
  receive   receive and finish on the receiver, synchronized (cuda-ipc direct: wait on the event and one
            kernel pulling every layer's rows over NVLink, the pool mapped at the first transfer (a
            warm-up one); staging: open the handle, peer copy, scatter);
  total     export to reply; the sender then releases the transfer, as a prefill worker does when the
            decode worker is done (cuda-ipc direct: frees the ring region; staging: the staging buffer
            stays alive until the receiver dropped it).
nixl: the export describes the rows (or gathers them into its staging buffer when too fragmented), the
receive READs them over NIXL/UCX with the transport's own agents (the receiver's metadata request as a
decode worker's grant makes it: the sender's metadata goes once), then scatters when it staged.
`--mode` picks cuda-ipc's mode (direct by default; staging to compare with the older path) or nixl's
(auto by default: stage rows too fragmented for their descriptors; direct; staging). `--slots contiguous`
draws each size's slots as one run on both sides (a fresh pool) instead of scattered (a busy one).
The KV at the receiver's slots must equal the sender's (an exact per-layer checksum) or the command
fails. Baseline: a plain copy of as many bytes, GPU 0 to GPU 1 (on CPU: host memory to host memory);
with nixl also a bare NIXL READ of as many bytes as one block over the same UCX settings
(`bench_transfer_nixl`; UCX reads UCX_TLS and the rest from the environment, e.g. UCX_TLS=tcp,cuda_copy).
Prints a table; one JSON line per size goes to --result-file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.engine.disagg.transport.choice import decode_receiver_info
from radixmesh.engine.disagg.transport.nixl_lib import NIXL_MODES
from radixmesh.engine.disagg.transport.registry import CUDA_IPC_MODES, KV_TRANSPORT_IDS, check_transport_device

PHASES = ("export", "handoff", "receive", "total")
DEFAULT_NUM_TOKENS = (1024, 4096, 16384)


class KVMismatchError(Exception):
    """The receiver's KV differs from the sender's."""


def register_kv_transfer(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser("kv-transfer", help="prefill-to-decode KV transfer between two processes vs a plain copy",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("--device", default=None, choices=("cuda", "cpu"),
                     help="cuda: sender on GPU 0, receiver on GPU 1 (needs two); default cuda when available")
    cmd.add_argument("--transport", default=None, choices=KV_TRANSPORT_IDS,
                     help="KV transport (default: cuda-ipc on cuda, else grpc)")
    cmd.add_argument("--mode", default=None, choices=sorted({*CUDA_IPC_MODES, *NIXL_MODES}),
                     help="cuda-ipc: the decode GPU pulls the rows from the prefill pool (direct, the default), or "
                          "copies a gathered staging buffer (staging); nixl: READ the rows in place (direct), through "
                          "staging buffers (staging), or staged only when too fragmented (auto, the default)")
    cmd.add_argument("--slots", default="random", choices=("random", "contiguous"),
                     help="each size's slots on both sides: scattered (a busy pool) or one run (a fresh pool)")
    cmd.add_argument("--no-bare-read", dest="bare_read", action="store_false",
                     help="nixl: skip the bare NIXL READ of the same bytes as one block")
    cmd.add_argument("--num-tokens", type=int, nargs="+", default=list(DEFAULT_NUM_TOKENS),
                     help="prompt lengths whose KV is moved")
    cmd.add_argument("--repeats", type=int, default=10, help="timed transfers per size")
    cmd.add_argument("--warmup", type=int, default=2, help="untimed transfers per size first")
    cmd.add_argument("--num-layers", type=int, default=32, help="default: the Llama-3.1-8B KV shape")
    cmd.add_argument("--kv-heads", type=int, default=8)
    cmd.add_argument("--head-dim", type=int, default=128)
    cmd.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "float8_e4m3fn"))
    cmd.add_argument("--seed", type=int, default=0)
    cmd.add_argument("--result-file", default=None, help="append one JSON line per size to this file")
    cmd.set_defaults(func=cmd_kv_transfer)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("repeats", "num_layers", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            raise invalid_argument(f"--{name.replace('_', '-')} must be at least 1", name)
    if args.warmup < 0:
        raise invalid_argument("--warmup must be at least 0", "warmup")
    if min(args.num_tokens) < 1:
        raise invalid_argument("--num-tokens must all be at least 1", "num_tokens")
    if args.mode is not None and args.transport in ("cuda-ipc", "nixl"):
        modes = CUDA_IPC_MODES if args.transport == "cuda-ipc" else NIXL_MODES
        if args.mode not in modes:
            raise invalid_argument(f"--mode {args.mode} is not one of {args.transport}'s ({', '.join(modes)})", "mode")


def _resolve(args: argparse.Namespace) -> tuple[str, str, str, str]:
    """(device type, transport, sender device, receiver device); UNSUPPORTED when this machine cannot run them."""
    import torch

    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    transport_id = args.transport or ("cuda-ipc" if kind == "cuda" else "grpc")
    check_transport_device(transport_id, kind)
    if kind == "cpu":
        return kind, transport_id, "cpu", "cpu"
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus < 2:
        raise unsupported(f"bench kv-transfer on cuda needs two GPUs (sender on GPU 0, receiver on GPU 1); "
                          f"{num_gpus} visible", "device")
    return kind, transport_id, "cuda:0", "cuda:1"


def cmd_kv_transfer(args: argparse.Namespace) -> int:
    from radixmesh.engine.disagg import bench_transfer_peer as peer

    _check_args(args)
    kind, transport_id, sender_device, receiver_device = _resolve(args)
    mode = (args.mode or ("direct" if transport_id == "cuda-ipc" else "auto")) if transport_id != "grpc" else ""
    shape = (2 * max(args.num_tokens), args.num_layers, args.kv_heads, args.head_dim, args.dtype, transport_id, mode)
    receiver = peer.Receiver(peer.PoolSpec(receiver_device, *shape))  # starts while this side fills its pool
    pool, transport = peer.open_side(peer.PoolSpec(sender_device, *shape))
    peer.fill_random(pool, args.seed)
    bare = None
    if transport_id == "nixl" and args.bare_read:
        from radixmesh.engine.disagg.bench_transfer_nixl import BareSender

        bare = BareSender(sender_device)
    sides = _Sides(pool, transport, receiver, receiver_device, bare)
    info = _info(kind, sender_device, receiver_device, transport_id, args)
    _print_header(info, pool.bytes_per_token(args.num_layers, args.kv_heads, args.head_dim, pool.dtype))
    try:
        for num_tokens in args.num_tokens:
            result = {**info, **_measure(args, sides, num_tokens)}
            _print_row(result)
            if args.result_file:
                with open(args.result_file, "a") as fh:
                    fh.write(json.dumps(result) + "\n")
    except KVMismatchError as exc:
        print(f"radixmesh: error: {exc}", file=sys.stderr)
        return 1
    finally:
        receiver.stop()
    return 0


@dataclass
class _Sides:
    """The sender's pool and transport (this process), and the receiver process with its device."""

    pool: Any
    transport: Any
    receiver: Any
    receiver_device: str
    bare: Any = None
    """nixl: the bare READ's sending side (None: no such baseline)."""
    receiver_info: Any = None
    """How the receiver last described itself (a ReceiverInfo, as a decode worker's grant carries)."""


def _measure(args: argparse.Namespace, sides: _Sides, num_tokens: int) -> dict[str, Any]:
    """Timings of one size and of its copy baseline, once the receiver's KV is checked."""
    from radixmesh.engine.disagg import bench_transfer_peer as peer

    pool, transport = sides.pool, sides.transport
    contiguous = getattr(args, "slots", "random") == "contiguous"
    prepared = sides.receiver.request(peer.PrepareMsg(num_tokens, 2 * (args.seed + num_tokens) + 1, contiguous))
    slots = peer.random_slots(pool, num_tokens, 2 * (args.seed + num_tokens), contiguous)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    num_chunks = 0
    sides.receiver_info = decode_receiver_info(prepared.transport_params)
    for i in range(args.warmup + args.repeats):
        once, num_chunks = _transfer_once(sides, slots, f"bench-{num_tokens}-{i}")
        if i >= args.warmup:
            for phase, seconds in once.items():
                times[phase].append(seconds)
    received = sides.receiver.request(peer.CheckMsg()).sums
    sent = peer.fingerprint(pool, slots)
    bad = [layer for layer, (a, b) in enumerate(zip(sent, received)) if a != b]
    if bad or len(sent) != len(received):
        raise KVMismatchError(f"the receiver's KV of {num_tokens} tokens differs from the sender's "
                              f"(layers {bad or 'missing'}): the {transport.transport_id} transfer is wrong")
    num_bytes = num_tokens * pool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
    copy_s = _copy_baseline(num_bytes, str(pool.device), sides.receiver_device, args)
    result = {"num_tokens": num_tokens, "num_bytes": num_bytes, "num_chunks": num_chunks,
              **_summarize(num_bytes, times, copy_s), "verified": True}
    if sides.bare is not None:
        bare_s = sides.receiver.request(sides.bare.message(num_bytes, args.warmup, args.repeats)).times_s
        result["bare_read_ms_median"] = round(1e3 * statistics.median(bare_s), 4)
        result["bare_read_gbps"] = round(num_bytes / statistics.median(bare_s) / 1e9, 3)
        result["bare_ratio"] = round(result["transfer_gbps"] / result["bare_read_gbps"], 4)
    if hasattr(transport, "stats"):
        result["transport_stats"] = {k: v for k, v in transport.stats().items() if isinstance(v, int)}
    return result


def _transfer_once(sides: _Sides, slots: Any, transfer_id: str) -> tuple[dict[str, float], int]:
    from radixmesh.engine.disagg import bench_transfer_peer as peer

    start = time.perf_counter()
    chunks = sides.transport.export(transfer_id, slots, sides.receiver_info)
    chunks = sides.transport.ready_to_send(transfer_id) or chunks  # nixl: waits for its gather, then final
    peer.synchronize(sides.pool.device)
    exported = time.perf_counter()
    for index, chunk in enumerate(chunks):
        sides.receiver.send(peer.ChunkMsg(chunk, last=index == len(chunks) - 1))
    reply = sides.receiver.reply()  # sent once the receiver finished and let go of the chunks
    total_s, receive_s = time.perf_counter() - start, reply.receive_s
    sides.receiver_info = decode_receiver_info(reply.transport_params) or sides.receiver_info
    sides.transport.release(transfer_id)  # cuda-ipc: the ring region (or staging buffer) is freed only now
    export_s = exported - start
    return {"export": export_s, "handoff": total_s - export_s - receive_s, "receive": receive_s,
            "total": total_s}, len(chunks)


def _summarize(num_bytes: int, times: dict[str, list[float]], copy_s: list[float]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for phase, values in (*times.items(), ("copy", copy_s)):
        result[f"{phase}_ms_median"] = round(1e3 * statistics.median(values), 4)
        result[f"{phase}_ms_min"] = round(1e3 * min(values), 4)
    transfer_gbps = num_bytes / statistics.median(times["total"]) / 1e9
    copy_gbps = num_bytes / statistics.median(copy_s) / 1e9
    return {**result, "transfer_gbps": round(transfer_gbps, 3), "copy_gbps": round(copy_gbps, 3),
            "bandwidth_ratio": round(transfer_gbps / copy_gbps, 4)}


def _copy_baseline(num_bytes: int, src_device: str, dst_device: str, args: argparse.Namespace) -> list[float]:
    """Seconds of plain copies of `num_bytes` from the sender's device to the receiver's."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8, device=src_device)  # written: no untouched zero pages on CPU
    dst = torch.zeros(num_bytes, dtype=torch.uint8, device=dst_device)

    def sync() -> None:
        for device in {src.device, dst.device}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    seconds = []
    warmup = max(args.warmup, 1)
    for i in range(warmup + args.repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def _info(kind: str, sender_device: str, receiver_device: str, transport_id: str,
          args: argparse.Namespace) -> dict[str, Any]:
    import torch

    def name(device: str) -> str:
        return torch.cuda.get_device_name(device) if kind == "cuda" else platform.processor() or platform.machine()

    mode = (args.mode or ("direct" if transport_id == "cuda-ipc" else "auto")) if transport_id != "grpc" else None
    ucx = {k: v for k, v in os.environ.items() if k in ("UCX_TLS", "UCX_NET_DEVICES")} if transport_id == "nixl" else {}
    return {"bench": "kv-transfer", "transport": transport_id, "mode": mode, "device": kind, "ucx": ucx,
            "slots": getattr(args, "slots", "random"), "bare_read": transport_id == "nixl" and args.bare_read,
            "sender_device": sender_device, "receiver_device": receiver_device,
            "sender_device_name": name(sender_device), "receiver_device_name": name(receiver_device),
            "num_layers": args.num_layers, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup,
            "torch": torch.__version__, "host": platform.node(), "command": " ".join(sys.argv)}


COLUMNS = (("tokens", 8), ("MiB", 9), ("export ms", 10), ("handoff ms", 11), ("receive ms", 11), ("total ms", 10),
           ("total min", 10), ("GB/s", 8), ("copy ms", 9), ("copy GB/s", 10), ("ratio", 7))
BARE_COLUMNS = (("bare ms", 9), ("bare GB/s", 10), ("vs bare", 8))


def _print_header(info: dict[str, Any], token_bytes: int) -> None:
    mode = f" ({info['mode']})" if info["mode"] else ""
    ucx = "".join(f", {k}={v}" for k, v in info["ucx"].items())
    print(f"kv-transfer over {info['transport']}{mode}: {info['sender_device']} ({info['sender_device_name']}) -> "
          f"{info['receiver_device']} ({info['receiver_device_name']}), torch {info['torch']}{ucx}")
    print(f"KV {info['num_layers']} layers x {info['kv_heads']} heads x {info['head_dim']} {info['dtype']} = "
          f"{token_bytes / 1024:g} KiB per token, {info['slots']} slots; median of {info['repeats']} after "
          f"{info['warmup']} warm-up; copy: plain copy of as many bytes"
          + ("; bare: one NIXL READ of as many bytes as one block" if info["bare_read"] else ""))
    columns = COLUMNS + (BARE_COLUMNS if info["bare_read"] else ())
    print("".join(f"{title:>{width}}" for title, width in columns))


def _print_row(result: dict[str, Any]) -> None:
    values = (result["num_tokens"], f"{result['num_bytes'] / 2**20:.1f}", *(
        f"{result[f'{phase}_ms_median']:.3f}" for phase in PHASES), f"{result['total_ms_min']:.3f}",
        f"{result['transfer_gbps']:.2f}", f"{result['copy_ms_median']:.3f}", f"{result['copy_gbps']:.2f}",
        f"{result['bandwidth_ratio']:.3f}")
    columns: tuple[tuple[str, int], ...] = COLUMNS
    if "bare_read_gbps" in result:
        values += (f"{result['bare_read_ms_median']:.3f}", f"{result['bare_read_gbps']:.2f}",
                   f"{result['bare_ratio']:.3f}")
        columns += BARE_COLUMNS
    print("".join(f"{value:>{width}}" for value, (_, width) in zip(values, columns)), flush=True)
