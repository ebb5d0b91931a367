"""Batched LoRA at the Llama-3.1-8B projections: the adapters' cost next to the base GEMMs; JSON lines.

    python -m radixmesh.kernels.bench_lora [--batch 32] [--adapters 16] [--rank 16] [--max-rank 16] \
        [--prefill-segments 512 512 512 512] [--kernels rows grouped fused epilogue] [--check]
    python -m radixmesh.kernels.bench_lora --table lora.jsonl     # a short table of a result file

Cases: `decode` (one row per request, `--batch` rows over `--adapters` adapters, each adapter's rows spread
over the batch), `decode-1` (batch 1 with an adapter), `prefill` (segments of `--prefill-segments` rows,
each its own adapter) and `layer-1` (batch 1 against the fused GEMVs a step runs, `bench_lora_gemv`: the only
case of the "epilogue" set, which has no `lora_apply` of its own; the others skip it). Per projection (q/k/v
stacked, o, gate/up stacked, down): the base GEMM in bf16 (`torch.matmul`, cuBLAS; layer-1: the fused GEMVs), the
LoRA shrink and expand alone and together, and base then LoRA in one graph (`with_lora_us`); `base_share` = base /
with LoRA, the throughput a step made only of these GEMMs keeps. `overlap_us`: base and LoRA with the shrink on a
side stream beside the GEMM (`radixmesh.kernels.lora_overlap`; not for "fused"), `overlap_share` its base share.
Decode cases run once per kernel set of `--kernels` (`radixmesh.kernels.lora.KERNELS`: the per-row launches
"rows", "grouped" by adapter, "fused" shrink+expand, or what "auto" picks), so old and new sit in one table;
a fused launch has no shrink or expand of its own. Prefill segments always take the per-segment launches.
Base weights and adapter buffers are copied until a graph reads several times the L2 cache, so both come
from memory as they do in a step through 32 layers; a `summary` line per case sums the four projections.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable

import torch

from radixmesh.kernels._bench import print_table, run_info, time_us
from radixmesh.kernels.bench_gemv import L2_SPAN_BYTES
from radixmesh.kernels.bench_lora_gemv import LAYER, bench_layer_one
from radixmesh.kernels.lora import (
    KERNELS,
    LoraBatch,
    LoraConfig,
    choose_kernels,
    kernel_config,
    lora_apply,
    lora_expand,
    lora_shrink,
)
from radixmesh.kernels.lora_gemv import EPILOGUE_WIDTH
from radixmesh.kernels.lora_overlap import lora_overlapped
from radixmesh.kernels.lora_ref import lora_ref, row_slots

# (name, in features, output slices) of one Llama-3.1-8B layer
PROJECTIONS = [("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (14336, 14336)),
               ("down", 14336, (4096,))]


def make_batch(case: str, args: argparse.Namespace) -> tuple[int, LoraBatch]:
    """(rows, batch) of a case, the slots on the GPU."""
    if case == "decode-1":
        return 1, LoraBatch.per_row(torch.zeros(1, dtype=torch.int32, device="cuda"))
    if case == "decode":
        gen = torch.Generator().manual_seed(0)
        slots = torch.arange(args.batch, dtype=torch.int32) % args.adapters
        return args.batch, LoraBatch.per_row(slots[torch.randperm(args.batch, generator=gen)].cuda())
    lengths = args.prefill_segments
    starts = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    slots = torch.arange(len(lengths), dtype=torch.int32) % args.adapters
    return sum(lengths), LoraBatch(slots.cuda(), starts.cuda(), max(lengths))


def bench_projection(case: str, name: str, k: int, slices: tuple[int, ...], args: argparse.Namespace,
                     kernels: str) -> dict[str, object]:
    rows, batch = make_batch(case, args)
    n = sum(slices)
    base_copies = max(2, math.ceil(L2_SPAN_BYTES / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(base_copies)]
    num_slots, r = min(args.adapters, batch.num_segments), args.max_rank  # the adapters this batch reads
    adapter_bytes = (len(slices) * r * k + n * r) * 2
    lora_copies = max(2, math.ceil(L2_SPAN_BYTES / (num_slots * adapter_bytes)))
    adapters = [(torch.randn(num_slots, len(slices) * r, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                 torch.randn(num_slots, n, r, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(lora_copies)]
    ranks = torch.full((num_slots,), args.rank, dtype=torch.int32, device="cuda")
    scalings = torch.full((num_slots,), 2.0, dtype=torch.float32, device="cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    kind = choose_kernels(kernels, batch, r)
    cfg = kernel_config(kind, batch, k, slices, r, num_slots, x.device)
    xa = None  # a shrink and an expand, timed alone too (a fused launch has neither)
    if kind != "fused":
        xa = lora_shrink(x, adapters[0][0], batch, ranks, len(slices), config=cfg, kernels=kind)
    count = max(base_copies, lora_copies)  # calls per graph

    def base(i: int) -> Callable[[], object]:
        return functools.partial(torch.matmul, x, weights[i % base_copies].t(), out=ys[i % len(ys)])

    def lora(i: int) -> Callable[[], object]:
        a, b = adapters[i % lora_copies]
        return functools.partial(lora_apply, x, ys[i % len(ys)], a, b, batch, ranks, scalings, slices, cfg, xa,
                                 kind)

    def overlapped(i: int) -> Callable[[], object]:  # the shrink on the side stream beside the GEMM
        a, b = adapters[i % lora_copies]
        w, y = weights[i % base_copies], ys[i % len(ys)]
        return functools.partial(lora_overlapped, x, lambda inp: torch.matmul(inp, w.t(), out=y), a, b, batch,
                                 ranks, scalings, slices, kind)

    pair_us = time_us([call for i in range(count) for call in (base(i), lora(i))])
    row: dict[str, object] = {
        "bench": "lora", "case": case, "projection": name, "kernels": kind, "rows": rows, "in": k,
        "slices": list(slices), "rank": args.rank, "max_rank": r, "adapters": num_slots, "config": vars(cfg),
        "base_us": time_us([base(i) for i in range(count)]),
        "shrink_us": None, "expand_us": None,
        "lora_us": time_us([lora(i) for i in range(count)]),
        "with_lora_us": None if pair_us is None else round(2 * pair_us, 2),  # time_us counts each call of a pair
        "overlap_us": None,
    }
    if xa is not None:
        row["overlap_us"] = time_us([overlapped(i) for i in range(count)])
        row["shrink_us"] = time_us([functools.partial(lora_shrink, x, adapters[i % lora_copies][0], batch, ranks,
                                                      len(slices), xa, cfg, kind) for i in range(count)])
        row["expand_us"] = time_us([functools.partial(lora_expand, xa, adapters[i % lora_copies][1], batch, ranks,
                                                      scalings, ys[i % len(ys)], slices, cfg, kind)
                                    for i in range(count)])
    base_us = row["base_us"]
    for key, share in (("with_lora_us", "base_share"), ("overlap_us", "overlap_share")):
        value = row[key]
        if isinstance(base_us, float) and isinstance(value, float):
            row[share] = round(base_us / value, 3)
    if args.check:
        row["rel_err"] = check(x, weights[0], adapters[0], batch, ranks, scalings, slices, cfg, kind)
    return row


def check(x: torch.Tensor, w: torch.Tensor, adapter: tuple[torch.Tensor, torch.Tensor], batch: LoraBatch,
          ranks: torch.Tensor, scalings: torch.Tensor, slices: tuple[int, ...], cfg: LoraConfig, kind: str) -> float:
    """Relative error of the adapters' contribution against `lora_ref` (float32, on the GPU)."""
    y = x @ w.t()
    slots = row_slots(batch.slots.cpu(), None if batch.seg_starts is None else batch.seg_starts.cpu(), x.shape[0])
    want = lora_ref(x, y, adapter[0], adapter[1], slots, ranks.cpu(), scalings.cpu(), slices)
    got = lora_apply(x, y.clone(), adapter[0], adapter[1], batch, ranks, scalings, slices, cfg, kernels=kind)
    return round(float((got.float() - want).norm() / (want - y.float()).norm()), 5)


def summary(case: str, rows: list[dict[str, object]]) -> dict[str, object]:
    def total(key: str) -> float | None:
        values = [r.get(key) for r in rows]
        numbers = [v for v in values if isinstance(v, float)]
        return round(sum(numbers), 2) if len(numbers) == len(values) else None

    base, with_lora, overlap = total("base_us"), total("with_lora_us"), total("overlap_us")
    width = {"epilogue_width": rows[0]["epilogue_width"]} if "epilogue_width" in rows[0] else {}
    return {"bench": "lora", "case": case, "projection": "layer", "kernels": rows[0]["kernels"], **width,
            "rows": rows[0]["rows"], "rank": rows[0]["rank"],
            "adapters": rows[0]["adapters"], "base_us": base, "lora_us": total("lora_us"),
            "with_lora_us": with_lora, "base_share": round(base / with_lora, 3) if base and with_lora else None,
            "overlap_us": overlap, "overlap_share": round(base / overlap, 3) if base and overlap else None}


COLUMNS = [("case", "case"), ("proj", "projection"), ("kernels", "kernels"), ("width", "epilogue_width"),
           ("rows", "rows"), ("adapters", "adapters"), ("base_us", "base_us"), ("shrink", "shrink_us"),
           ("expand", "expand_us"), ("lora_us", "lora_us"),
           ("with_lora", "with_lora_us"), ("base_share", "base_share"), ("overlap", "overlap_us"),
           ("overlap_share", "overlap_share"), ("rel_err", "rel_err")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=("decode", "decode-1", "prefill", "layer-1"),
                   default=["decode", "decode-1", "prefill", "layer-1"])
    p.add_argument("--batch", type=int, default=32, help="decode rows")
    p.add_argument("--adapters", type=int, default=16, help="distinct adapters (slots)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-rank", type=int, default=None, help="the slot buffers' rank (default: --rank)")
    p.add_argument("--prefill-segments", nargs="+", type=int, default=[512, 512, 512, 512])
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=["rows", "grouped", "fused", "epilogue"],
                   help="decode kernel sets to time, each in turn (prefill: the per-segment launches once)")
    p.add_argument("--epilogue-widths", nargs="+", type=int, default=[EPILOGUE_WIDTH], metavar="W",
                   help="layer-1's epilogue kernel set once per width: partial sums a row (the shrink's splits "
                        "times the rank's power of 2; default %(default)s)")
    p.add_argument("--check", action="store_true", help="compare each projection with lora_ref")
    p.add_argument("--table", nargs="+", metavar="JSONL", help="print a table of earlier results and exit")
    args = p.parse_args(argv)
    args.max_rank = args.max_rank or args.rank
    if args.table:
        print_table(args.table, "lora", COLUMNS)
        return 0
    if not 1 <= args.rank <= args.max_rank or min(args.batch, args.adapters, *args.prefill_segments) < 1:
        p.error("need 1 <= --rank <= --max-rank and positive --batch, --adapters, --prefill-segments")
    if not torch.cuda.is_available():
        print("bench_lora needs a CUDA device", file=sys.stderr)
        return 2
    info = run_info("radixmesh.kernels.bench_lora")
    for case in args.cases:
        for kernels in case_kernels(case, args.kernels):
            widths = args.epilogue_widths if case == "layer-1" and kernels in ("epilogue", "auto") else [None]
            for width in widths:
                rows = []
                for name, k, slices, kind in LAYER if case == "layer-1" else [(*p, "") for p in PROJECTIONS]:
                    rows.append(bench_layer_one(name, k, slices, kind, kernels, args.rank, args.max_rank, args.check,
                                                width or EPILOGUE_WIDTH)
                                if case == "layer-1" else bench_projection(case, name, k, slices, args, kernels))
                    print(json.dumps({**rows[-1], **info}), flush=True)
                    torch.cuda.empty_cache()
                print(json.dumps({**summary(case, rows), **info}), flush=True)
    return 0


def case_kernels(case: str, kernels: list[str]) -> list[str]:
    """The kernel sets a case times: prefill the per-segment launches once; epilogue only in layer-1."""
    if case == "prefill":
        return ["rows"]
    return kernels if case == "layer-1" else [k for k in kernels if k != "epilogue"]


if __name__ == "__main__":
    sys.exit(main())
