"""Engine benchmarks: `radixmesh bench one-batch` and `radixmesh bench offline`.

Both drive the scheduler in-process (model, KV pools, scheduling, sampling; no HTTP
or IPC front end), print the device and settings, and end with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.bench.graph_profile import profile_decode_steps, profile_graph

DEFAULT_SHAPE = "llama-3.2-1b"


@dataclass
class Timeline:
    """When each request produced tokens (host time after the device finished them)."""

    first_token_s: dict[str, float] = field(default_factory=dict)
    done_s: dict[str, float] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.first_token_s.clear()
        self.done_s.clear()
        self.num_tokens.clear()

    def __call__(self, outputs: list[Any]) -> None:
        now = time.perf_counter()
        for out in outputs:
            if out.token_ids:
                self.first_token_s.setdefault(out.rid, now)
                self.num_tokens[out.rid] = out.completion_tokens
            if out.finish_reason:
                self.done_s[out.rid] = now
                if out.error:
                    raise RuntimeError(f"request {out.rid} failed: {out.error}")


def build_scheduler(args: argparse.Namespace, emit: Timeline) -> Any:
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler.core import Scheduler

    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_shape or args.model or DEFAULT_SHAPE
    config = EngineConfig(**kwargs).resolve()
    prepared = prepare_model(config.model, config.load_format, lend_tokenizer=False)
    runner = ModelRunner(config, prepared)
    return Scheduler(config, runner, None, emit)


def make_reqs(lengths: list[tuple[int, int]], vocab: int, seed: int, tag: str) -> list[Any]:
    from radixmesh.engine.request import Req
    from radixmesh.wire.sampling import SamplingParams

    rng = random.Random(seed)
    return [Req(rid=f"{tag}{i}", origin_input_ids=[rng.randrange(100, vocab - 1) for _ in range(in_len)],
                params=SamplingParams(max_new_tokens=out_len, temperature=0, ignore_eos=True))
            for i, (in_len, out_len) in enumerate(lengths)]


class StepClock:
    """Host time of each scheduler step, less the eager model forward and the waits for device results.

    On a CPU the model forward is compute and is left out; on a GPU it is launch time (eager
    passes; a graph replay is not a model call). The wait is `Scheduler.result_wait_s`. Wall
    time, and the thread's CPU time (steadier on a shared machine: time other processes
    take is not counted; a GPU wait spins, so only the wall figure leaves it out cleanly).
    """

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.steps: list[tuple[float, float, float, float, float]] = []  # wall, model, wait, cpu, model cpu
        self._model_s = self._model_cpu_s = 0.0
        self._model_start = self._model_cpu_start = 0.0
        model = sched.runner.model
        model.register_forward_pre_hook(self._model_begin)
        model.register_forward_hook(self._model_end)

    def _model_begin(self, *_: Any) -> None:
        self._model_start, self._model_cpu_start = time.perf_counter(), time.thread_time()

    def _model_end(self, *_: Any) -> None:
        self._model_s += time.perf_counter() - self._model_start
        self._model_cpu_s += time.thread_time() - self._model_cpu_start

    def step(self) -> None:
        model_s, model_cpu_s, wait_s = self._model_s, self._model_cpu_s, getattr(self.sched, "result_wait_s", 0.0)
        start, cpu_start = time.perf_counter(), time.thread_time()
        self.sched.step()
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        self.steps.append((wall, self._model_s - model_s, getattr(self.sched, "result_wait_s", 0.0) - wait_s,
                           cpu, self._model_cpu_s - model_cpu_s))

    def decode_summary(self) -> dict[str, float]:
        """Means over decode steps: all but the first two (prefill launch, its result) and the last (drain)."""
        steps = self.steps[2:-1] or self.steps
        n = len(steps)
        host = [wall - model - wait for wall, model, wait, _, _ in steps]
        host_cpu = [cpu - model_cpu for _, _, _, cpu, model_cpu in steps]
        return {"host_ms_per_decode_step": round(1000 * sum(host) / n, 4),
                "host_ms_per_decode_step_median": round(1000 * statistics.median(host), 4),
                "host_cpu_ms_per_decode_step_median": round(1000 * statistics.median(host_cpu), 4),
                "wait_ms_per_decode_step": round(1000 * sum(s[2] for s in steps) / n, 4),
                "eager_model_ms_per_decode_step": round(1000 * sum(s[1] for s in steps) / n, 4),
                "num_timed_steps": n}


def run_all(sched: Any, reqs: list[Any], clock: StepClock | None = None, on_start: Any = None) -> float:
    sync = _sync_fn(sched)
    sync()
    start = time.perf_counter()
    if on_start is not None:
        on_start()
    for req in reqs:
        sched.add_request(req)
    step = clock.step if clock is not None else sched.step
    while sched.has_work:
        step()
    sync()
    return start


def _sync_fn(sched: Any) -> Any:
    import torch

    if sched.runner.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def device_info(sched: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": str(sched.runner.device), "host": platform.node()}
    if sched.runner.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    info["torch"] = torch.__version__
    return info


def _pdl_on(device: Any) -> bool:
    from radixmesh.kernels._pdl import pdl_enabled

    return pdl_enabled(device)


def settings(sched: Any, args: argparse.Namespace) -> dict[str, Any]:
    cfg = sched.config
    return {"model": cfg.model, "load_format": cfg.load_format, "dtype": cfg.dtype, "tp_size": cfg.tp_size,
            "ep_size": cfg.ep_size, "dp_attention": cfg.enable_dp_attention,
            "custom_all_reduce": cfg.enable_custom_all_reduce, "gemv_fusion": not cfg.disable_gemv_fusion,
            "decode_rope_fusion": not cfg.disable_decode_rope_fusion,
            "fp8_quant_fusion": bool(cfg.quantization) and not cfg.disable_fp8_quant_fusion,
            "dense_prefill": cfg.enable_dense_prefill,
            "pdl": _pdl_on(sched.runner.device), "attention_backend": cfg.attention_backend,
            "overlap_schedule": cfg.overlap_schedule,
            **sched.runner.memory_info(),
            "cuda_graph": sched.runner.graph_runner is not None, "max_total_tokens": sched.kv.capacity,
            "max_running_requests": sched.runner.plan.max_running_requests,
            "chunked_prefill_size": cfg.chunked_prefill_size, **_decode_fp8_settings(), **_gemv_tiles_settings(),
            "command": " ".join(sys.argv)}


def _gemv_tiles_settings() -> dict[str, Any]:
    """The batch-1 GEMV tiles set through the environment (RADIXMESH_GEMV_TILES as given; nothing when unset)."""
    from radixmesh.common.env import gemv_tiles

    value = gemv_tiles()
    return {} if value is None else {"gemv_tiles": value}


def _decode_fp8_settings() -> dict[str, Any]:
    """The FP8 decode tiles and widening set through the environment (nothing when unset)."""
    from radixmesh.common.env import decode_fp8_tuning

    tuning = decode_fp8_tuning()
    return {} if tuning.is_default else {"decode_fp8_tiles": tuning.tiles, "decode_fp8_widen": tuning.widen}


def gpu_memory(sched: Any) -> dict[str, Any]:
    """The device's memory after a run: what the KV pool took and how close the run came to the end
    (the headroom `--mem-fraction-static` leaves for activations, graphs and library workspaces)."""
    device = sched.runner.device
    if device.type != "cuda":
        return {}
    import torch

    free, total = torch.cuda.mem_get_info(device)
    kv_pool = sched.runner.kv_pool
    pool = sum(b.numel() * b.element_size() for b in (*kv_pool.k_buffers, *kv_pool.v_buffers))
    gib = 2**30
    return {"gpu_memory_gib": {"total": round(total / gib, 2), "kv_pool": round(pool / gib, 2),
                               "peak_allocated": round(torch.cuda.max_memory_allocated(device) / gib, 2),
                               "peak_reserved": round(torch.cuda.max_memory_reserved(device) / gib, 2),
                               "free_at_end": round(free / gib, 2)}}


def cmd_one_batch(args: argparse.Namespace) -> int:
    """One batch per `--input-len` on one loaded model: a JSON line each."""
    timeline = Timeline()
    sched = build_scheduler(args, timeline)
    for batch_size in args.batch_size:
        one = argparse.Namespace(**{**vars(args), "batch_size": batch_size})
        for seed, input_len in enumerate(args.input_len):
            _one_batch(sched, timeline, one, input_len, 3 * seed + 1)
    return 0


def _one_batch(sched: Any, timeline: Timeline, args: argparse.Namespace, input_len: int, seed: int) -> None:
    vocab = sched.runner.model_config.vocab_size
    run_all(sched, make_reqs([(input_len, min(args.output_len, 4))] * args.batch_size, vocab, seed, "warm"))
    timeline.reset()
    reqs = make_reqs([(input_len, args.output_len)] * args.batch_size, vocab, seed + 1, "r")
    clock = StepClock(sched)
    start = run_all(sched, reqs, clock)
    prefill_s = max(timeline.first_token_s.values()) - start
    decode_s = max(timeline.done_s.values()) - max(timeline.first_token_s.values())
    steps = max(args.output_len - 1, 1)
    result = {
        "bench": "one-batch", **device_info(sched), **settings(sched, args),
        "batch_size": args.batch_size, "input_len": input_len, "output_len": args.output_len,
        "prefill_latency_s": round(prefill_s, 5),
        "prefill_throughput_tok_s": round(args.batch_size * input_len / prefill_s, 1),
        "decode_step_latency_ms": round(1000 * decode_s / steps, 4),
        "decode_throughput_tok_s": round(args.batch_size * steps / decode_s, 1),
        "per_request_decode_tok_s": round(steps / decode_s, 1),
        **clock.decode_summary(),
    }
    graphs = sched.runner.graph_runner
    if graphs is not None and sched.config.tp_size == 1:  # (a lone replay on rank 0 would leave the other ranks out)
        # the device floor of a step: the captured forward alone, at the mean decode length
        seq_len = input_len + args.output_len // 2
        replay_ms = graphs.time_replay_ms(args.batch_size, seq_len)
        result["graph_replay_ms"] = round(replay_ms, 4) if replay_ms is not None else None
        if args.profile_graph and replay_ms is not None:
            result.update(profile_graph(graphs, args.batch_size, seq_len))
    if args.profile_graph and graphs is not None:
        result.update(profile_decode_steps(sched, make_reqs([(input_len, 24)] * args.batch_size, vocab, seed + 2, "p")))
    if args.profile_prefill and sched.runner.device.type != "cuda":
        print("--profile-prefill times device kernels and needs a CUDA device: skipped", file=sys.stderr)
    elif args.profile_prefill:
        from radixmesh.engine.bench.profile import profile_prefill

        result.update(profile_prefill(sched, lambda i: make_reqs([(input_len, 1)], vocab, seed + 10 + i, f"pp{i}-")[0]))
    if args.bandwidth_floor and args.batch_size == 1:
        from radixmesh.engine.bench.floor import bandwidth_floor

        result.update(bandwidth_floor(sched, result["decode_throughput_tok_s"], input_len + args.output_len // 2))
    _report(result, args)


def random_lengths(num: int, max_in: int, max_out: int, ratio: float, seed: int) -> list[tuple[int, int]]:
    """Input and output lengths uniform in [max(1, ratio * max), max], like SGLang's random dataset."""
    rng = random.Random(seed)
    return [(rng.randint(max(1, int(max_in * ratio)), max_in), rng.randint(max(1, int(max_out * ratio)), max_out))
            for _ in range(num)]


def cmd_offline(args: argparse.Namespace) -> int:
    if args.dataset != "random":
        print(f"radixmesh: error: dataset {args.dataset!r} is not supported here (random)", file=sys.stderr)
        return 2
    timeline = Timeline()
    sched = build_scheduler(args, timeline)
    vocab = sched.runner.model_config.vocab_size
    run_all(sched, make_reqs([(64, 8)] * 4, vocab, 1, "warm"))
    timeline.reset()
    lengths = random_lengths(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, args.seed)
    profiler = _offline_profiler(sched) if args.profile else None
    start = run_all(sched, make_reqs(lengths, vocab, args.seed, "r"), on_start=profiler.begin if profiler else None)
    duration = max(timeline.done_s.values()) - start
    out_tokens = sum(timeline.num_tokens.values())
    in_tokens = sum(i for i, _ in lengths)
    ttfts = [timeline.first_token_s[r] - start for r in timeline.first_token_s]
    result = {
        "bench": "offline", **device_info(sched), **settings(sched, args),
        "num_prompts": args.num_prompts, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens, "duration_s": round(duration, 3),
        "request_throughput_req_s": round(args.num_prompts / duration, 3),
        "input_throughput_tok_s": round(in_tokens / duration, 1),
        "output_throughput_tok_s": round(out_tokens / duration, 1),
        "median_time_to_first_token_s": round(statistics.median(ttfts), 3),
        "num_retractions": sched.counters.num_retractions,
        **gpu_memory(sched),
    }
    if profiler is not None:
        from radixmesh.engine.bench.profile import print_profile

        mc = sched.runner.model_config
        result["profile"] = profiler.summary(2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
                                             * sched.runner.kv_pool.k_buffers[0].element_size())
        print_profile(result["profile"])
    _report(result, args)
    return 0


def _offline_profiler(sched: Any) -> Any:
    from radixmesh.engine.bench.profile import OfflineProfiler

    return OfflineProfiler(sched)


def _report(result: dict[str, Any], args: argparse.Namespace) -> None:
    width = max(len(k) for k in result)
    for key, value in result.items():
        if key != "command":
            print(f"{key:<{width}}  {value}")
    line = json.dumps(result)
    print(line)
    if args.result_file:
        with open(args.result_file, "a") as fh:
            fh.write(line + "\n")


def _common(parser: argparse.ArgumentParser) -> None:
    from radixmesh.engine.args import add_engine_args

    add_engine_args(parser)
    parser.set_defaults(load_format="dummy")
    parser.add_argument("--model-shape", default=None,
                        help=f"named shape for random weights (default {DEFAULT_SHAPE})")
    parser.add_argument("--result-file", default=None, help="append the JSON result to this file")


def register_one_batch(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("one-batch", help="prefill and decode latency of one batch")
    _common(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1],
                        help="requests per batch; several: each in turn, on the same loaded model")
    parser.add_argument("--input-len", type=int, nargs="+", default=[1024],
                        help="prompt length; several: one batch each, on the same loaded model")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profile-graph", action="store_true",
                        help="also list the kernels of one decode graph replay (torch.profiler)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="also time one request's prefill alone and list its kernels by kind (CUDA)")
    parser.add_argument("--bandwidth-floor", action="store_true",
                        help="batch 1: also the weight bytes a token reads (MoE: its active experts) over the "
                             "device's measured copy bandwidth, and decode's share of that floor (CUDA, TP 1)")
    parser.set_defaults(func=cmd_one_batch)


def register_offline(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("offline", help="offline throughput over many random requests")
    _common(parser)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--dataset", default="random")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=1024)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true",
                        help="time every batch on the device (extend vs decode, idle gaps, decode KV bandwidth) "
                             "and trace a few windows of kernels (radixmesh.engine.bench.profile)")
    parser.set_defaults(func=cmd_offline)
