"""`radixmesh bench lora`: many LoRA adapters in one batch against the base model (issue 46's targets).

Random PEFT adapters of the model's shape (rank `--rank`, every projection targeted) are written to a temporary
directory. On one model without LoRA, then one with `--num-adapters` slots: decode throughput of a batch of
`--batch-size` where request i uses adapter i mod N, against the same batch of base requests on the model without
LoRA; batch-1 decode with and without an adapter; and the time to load one more adapter at run time (files read
and checked, then written into a device slot). With several `--lora-overlap` settings the mixed batch runs on one
LoRA engine per setting (`lora_batch_tok_s_by_overlap`), the other figures on the first. With `--profile-bs1`
(CUDA) also a kernel table of batch-1 decode steps on the base engine and on the first LoRA engine with one adapter
(`base_bs1_profile`, `lora_bs1_profile`). Prints each figure and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from radixmesh.engine.bench.graph_profile import profile_decode_steps
from radixmesh.engine.bench.throughput import (
    Timeline,
    _common,
    _report,
    build_scheduler,
    device_info,
    make_reqs,
    run_all,
    settings,
)
from radixmesh.engine.lora.options import LORA_OVERLAP

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROFILE_SKIP, PROFILE_STEPS, PROFILE_TOP = 4, 16, 40  # --profile-bs1: steps before, steps traced, kernels listed


def write_random_adapters(config: Any, root: Path, num: int, rank: int, seed: int = 0) -> list[Path]:
    """`num` PEFT adapters (adapter_config.json + adapter_model.safetensors) of random bf16 weights."""
    import json

    import torch
    from safetensors.torch import save_file

    from radixmesh.engine.lora.adapter import module_shapes

    shapes = module_shapes(config)
    paths = []
    for i in range(num):
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(config.num_layers):
            for module in TARGETS:
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                fan_in, fan_out = shapes[module]
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).bfloat16()
        path = root / f"adapter{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
        paths.append(path)
    return paths


def _decode_tok_s(sched: Any, timeline: Timeline, args: argparse.Namespace, batch: int, loras: list[str | None],
                  seed: int) -> float:
    """Decode throughput (output tokens/s after every request's first token) of one batch."""
    vocab = sched.runner.model_config.vocab_size

    def reqs(n_out: int, tag: str, s: int) -> list[Any]:
        made = make_reqs([(args.input_len, n_out)] * batch, vocab, s, tag)
        for i, req in enumerate(made):
            req.lora_name = loras[i % len(loras)]
        return made

    run_all(sched, reqs(4, "warm", seed))
    timeline.reset()
    run_all(sched, reqs(args.output_len, "r", seed + 1))
    decode_s = max(timeline.done_s.values()) - max(timeline.first_token_s.values())
    return batch * max(args.output_len - 1, 1) / decode_s


def _profile_bs1(sched: Any, args: argparse.Namespace, lora: str | None, result: dict[str, Any], key: str) -> None:
    """--profile-bs1: the kernels of whole batch-1 decode steps (one request, adapter `lora`) under a heading,
    their summary into `result[key]`; off CUDA a line saying it is skipped."""
    device = sched.runner.device.type
    if device != "cuda":
        print(f"--profile-bs1: needs CUDA; skipped ({key}, device {device})", file=sys.stderr)
        return
    vocab = sched.runner.model_config.vocab_size
    req = make_reqs([(args.input_len, PROFILE_SKIP + PROFILE_STEPS + 8)], vocab, 11, f"prof-{key}-")[0]
    req.lora_name = lora
    print(f"{key}: batch-1 decode step kernels{f' with adapter {lora}' if lora else ''}, {args.input_len} input "
          f"tokens, {PROFILE_STEPS} steps after {PROFILE_SKIP} (device us and calls per step, top {PROFILE_TOP})")
    result[key] = profile_decode_steps(sched, [req], skip=PROFILE_SKIP, steps=PROFILE_STEPS, top=PROFILE_TOP)


def _release_memory() -> None:
    """Free the device memory of a scheduler no longer referenced (its pools and graphs)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measure_base(args: argparse.Namespace, timeline: Timeline, result: dict[str, Any]) -> Any:
    """The model without LoRA: the batch and batch-1 figures (and the batch-1 kernels with --profile-bs1); returns
    its model config (the scheduler is dropped)."""
    base = build_scheduler(args, timeline)
    result.update(device_info(base))
    result["base_batch_tok_s"] = round(_decode_tok_s(base, timeline, args, args.batch_size, [None], 1), 1)
    result["base_bs1_tok_s"] = round(_decode_tok_s(base, timeline, args, 1, [None], 3), 1)
    if args.profile_bs1:
        _profile_bs1(base, args, None, result, "base_bs1_profile")
    base.runner.close()
    return base.runner.model_config


def cmd_lora(args: argparse.Namespace) -> int:
    timeline = Timeline()
    overlaps: list[str] = list(args.lora_overlap)
    args.lora_overlap = overlaps[0]  # the base engine's (it has no adapters)
    result: dict[str, Any] = {"bench": "lora", "num_adapters": args.num_adapters, "rank": args.rank,
                              "batch_size": args.batch_size, "input_len": args.input_len,
                              "output_len": args.output_len, "lora_kernels": args.lora_kernels,
                              "lora_overlap": overlaps[0]}
    model_config = _measure_base(args, timeline, result)
    _release_memory()
    with tempfile.TemporaryDirectory(prefix="radixmesh-lora-") as tmp:
        paths = write_random_adapters(model_config, Path(tmp), args.num_adapters + 1, args.rank)
        args.enable_lora, args.max_loras_per_batch, args.max_lora_rank = True, args.num_adapters, args.rank
        args.lora_paths = [f"a{i}={p}" for i, p in enumerate(paths[:-1])]
        by_overlap: dict[str, float] = {}
        for i, overlap in enumerate(overlaps):  # the first setting also gives the other figures
            args.lora_overlap = overlap
            sched = build_scheduler(args, timeline)
            by_overlap[overlap] = _measure_lora(sched, timeline, args, result, str(paths[-1]) if i == 0 else None)
            if i == 0:
                result.update(settings(sched, args))
            sched.runner.close()
            del sched
            _release_memory()
        result["lora_batch_tok_s_by_overlap"] = by_overlap
        result["lora_batch_vs_base_by_overlap"] = {k: round(v / result["base_batch_tok_s"], 4)
                                                   for k, v in by_overlap.items()}
    _report(result, args)
    return 0


def _measure_lora(sched: Any, timeline: Timeline, args: argparse.Namespace, result: dict[str, Any],
                  load_path: str | None) -> float:
    """The batch of mixed adapters on a LoRA engine; with `load_path` (the first engine) also its figures for base
    requests, batch 1 (and its kernels with --profile-bs1) and a run-time load, into `result`. Returns the mixed
    batch's tokens/s."""
    names: list[str | None] = [f"a{i}" for i in range(args.num_adapters)]
    lora_tok_s = _decode_tok_s(sched, timeline, args, args.batch_size, names, 1)
    if load_path is None:
        return round(lora_tok_s, 1)
    result["lora_batch_tok_s"] = round(lora_tok_s, 1)
    result["lora_batch_vs_base"] = round(lora_tok_s / result["base_batch_tok_s"], 4)
    result["lora_engine_base_batch_tok_s"] = round(_decode_tok_s(sched, timeline, args, args.batch_size,
                                                                 [None], 5), 1)
    bs1 = _decode_tok_s(sched, timeline, args, 1, ["a0"], 7)
    result["lora_bs1_tok_s"] = round(bs1, 1)
    result["lora_bs1_vs_base_bs1"] = round(bs1 / result["base_bs1_tok_s"], 4)
    if args.profile_bs1:
        _profile_bs1(sched, args, "a0", result, "lora_bs1_profile")
    result["load_adapter_s"] = round(_time_load(sched, f"a{args.num_adapters}", load_path), 4)
    return round(lora_tok_s, 1)


def _time_load(sched: Any, name: str, path: str) -> float:
    """Seconds to load an adapter at run time: read and check its files, then write it into a device slot."""
    import torch

    from radixmesh.engine.lora.hook import LoraHook

    hook = sched.hooks.get(LoraHook)
    assert hook is not None, "LoRA is on: the scheduler has its hook"
    start = time.perf_counter()
    hook.manager.load(name, path)
    hook.manager.slot_for(name, busy=set())
    if sched.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def register_lora(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("lora", help="many LoRA adapters in one batch vs the base model; adapter load time",
                              conflict_handler="resolve")  # --lora-overlap below takes several settings
    _common(parser)
    parser.set_defaults(model_shape="llama-3.1-8b", cuda_graph_max_bs=64)
    parser.add_argument("--num-adapters", type=int, default=16, help="adapters mixed in the batch")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--lora-overlap", nargs="+", default=["auto"], choices=LORA_OVERLAP,
                        help="the adapters beside the base GEMM (auto | on | side | off); several: the mixed batch "
                             "on one LoRA engine per setting, against the same base figures (the first gives the "
                             "others)")
    parser.add_argument("--profile-bs1", action="store_true",
                        help="CUDA only: also record the kernels of batch-1 decode steps (torch.profiler, "
                             f"{PROFILE_STEPS} whole steps, the top {PROFILE_TOP} by device time) on the base engine "
                             "and on the LoRA engine with one adapter (base_bs1_profile, lora_bs1_profile)")
    parser.set_defaults(func=cmd_lora)
