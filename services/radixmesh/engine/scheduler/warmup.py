"""Projections at every row count (gemm_warmup.py), prefills of many lengths and decode batches of many sizes
before a CUDA server reports ready, so its first requests run at full speed.

A prefill's GEMMs pick a library kernel by row count, and each kernel is loaded on its first use (CUDA loads
modules lazily, from library files a fresh machine has not read yet); the eager layers' Triton kernels get a
compiled variant per kind of argument. One prefill per length of WARMUP_LENGTHS (up to the chunk size), each
generating one token and then dropped from the prefix cache, loads them before the first request.

A long and a short prompt are then prefilled in one pass (MIXED_PAIR). The decode step's own small kernels
outside the CUDA graphs (staging a step's inputs, the greedy argmax, the KV index lists of a multi-request
prefill) get a variant per power-of-two batch bucket. On a fresh machine each variant compiled while serving
stalled the step that needed it by ~75 ms (six in the first half minute of a run at 1 req/s, H100,
`RADIXMESH_WATCH_COMPILES=1`: twelfth session). So batches of DECODE_BATCHES short requests are
then prefilled together and decoded for a few steps each.

Measured on H100s (8B, 100 prompts at 1 req/s through `serve`; docs/benchmarks/README.md, 2026-11-27 eleventh
session): without it, the first run on a fresh machine took 21 ms longer to the first token in its first 20
requests than a later server on the same machine did for the same prompts (median TTFT 78.5 vs 73.4 ms); with it,
on another fresh machine, those requests were 4.5 and 9.9 ms (mean per ten) over that later run (one sample).
With the decode batches too (twelfth session, a fresh machine's first server): no kernel compiled while serving,
and its first 20 requests were 1.5 ms (mean) under a second server's on another machine for the same prompts.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.gemm_warmup import warm_up_gemms
from radixmesh.wire.sampling import SamplingParams

if TYPE_CHECKING:
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)

WARMUP_LENGTHS = (1, 7, 16, 33, 64, 100, 128, 200, 256, 384, 512, 700, 1024, 1500, 2048, 3000, 4096, 6000, 8192)
"""Prompt lengths prefilled once each (those above the chunk size or the context length are left out): every
power of two a GEMM library tiles by, and odd lengths between them (ragged tiles, unaligned arguments)."""


DECODE_BATCHES = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)
"""Batch sizes decoded once each (past the server's running limit or pool: left out, and its largest batch
added): one in every power-of-two bucket the step's kernels compile for."""
DECODE_PROMPT_LEN = 8
DECODE_NEW_TOKENS = 4
MIXED_PAIR = (2048, 33)
"""A long and a short prompt prefilled in one pass: with `--enable-dense-prefill` the long one goes to cuDNN and
the short one to the Triton kernel's variant for the rows a dense plan leaves (compiled while serving otherwise:
1.6 s, H100, twelfth session)."""


def _longest_prompt(chunked_prefill_size: int, context_len: int, capacity: int) -> int:
    """The most prompt tokens one warm-up pass may hold: one chunk, within the context and the pool."""
    return min(chunked_prefill_size if chunked_prefill_size > 0 else context_len, context_len - 2, capacity - 2)


def warmup_lengths(chunked_prefill_size: int, context_len: int, capacity: int) -> list[int]:
    top = _longest_prompt(chunked_prefill_size, context_len, capacity)
    return [n for n in WARMUP_LENGTHS if n <= top]


def decode_batches(max_running_requests: int, capacity: int) -> list[int]:
    top = min(max_running_requests, (capacity - 2) // (DECODE_PROMPT_LEN + DECODE_NEW_TOKENS))
    sizes = [n for n in DECODE_BATCHES if n <= top]
    if top >= 1 and (not sizes or sizes[-1] < top):
        sizes.append(top)
    return sizes


def wants_warmup(config: EngineConfig, scheduler: Scheduler) -> bool:
    """On CUDA unless `--disable-prefill-warmup`; not with speculative decoding, the host KV tier (their own
    state would keep the prompts) or a multimodal model (random ids could hold its image tokens)."""
    return (scheduler.runner.device.type == "cuda" and not config.disable_prefill_warmup
            and not config.speculative_algorithm and not config.enable_hierarchical_cache
            and scheduler.runner.mm is None)


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    """Ids that differ from prompt to prompt from the first token on (in a real model's vocabulary), so a
    long prompt never finds another's prefix in the cache."""
    return [(seed * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(n)]


def _run_together(scheduler: Scheduler, prompts: list[tuple[int, int]], new_tokens: int) -> None:
    """Submit prompts of (seed, length) at once, greedy, and step until all of them finished."""
    vocab = scheduler.runner.model_config.vocab_size
    for seed, n in prompts:
        scheduler.add_request(Req(rid=f"warmup-{seed}", origin_input_ids=_ids(seed, n, vocab),
                                  params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)))
    while scheduler.has_work:
        scheduler.step()


def warm_up_prefill(scheduler: Scheduler) -> float:
    """Run the prefills and the decode batches, then leave the scheduler as it was (empty cache, counters at
    zero); seconds taken."""
    start = time.perf_counter()
    cfg, capacity = scheduler.config, scheduler.kv.rank_capacity  # (one rank's pool under data-parallel attention)
    lengths = warmup_lengths(cfg.chunk_size, scheduler.context_len, capacity)
    batches = decode_batches(scheduler.runner.plan.max_running_requests, capacity)
    runner = scheduler.runner
    warm_up_gemms(runner.model, _longest_prompt(cfg.chunk_size, scheduler.context_len, capacity),
                  runner.dtype, runner.device)  # every row count's GEMM kernels first (gemm_warmup.py)
    emit, scheduler.emit = scheduler.emit, lambda outputs: None  # nobody asked for these tokens
    try:
        for n in lengths:  # the seed is the length: every prompt starts differently
            _run_together(scheduler, [(n, n)], 1)
        if sum(MIXED_PAIR) <= _longest_prompt(cfg.chunk_size, scheduler.context_len, capacity):
            _run_together(scheduler, [(n + 1, n) for n in MIXED_PAIR], 1)
        for size in batches:
            _run_together(scheduler, [(10_000 + size * 1000 + i, DECODE_PROMPT_LEN) for i in range(size)],
                          DECODE_NEW_TOKENS)
    finally:
        scheduler.emit = emit
    flushed = scheduler.flush_cache()
    assert flushed, "the warm-up prefills left KV in use"
    scheduler.reset_counters()
    seconds = time.perf_counter() - start
    logger.info("warm-up: prefills of %d lengths up to %d tokens, decode batches of %d sizes up to %d, in %.2f s",
                len(lengths), max(lengths, default=0), len(batches), max(batches, default=0), seconds)
    return seconds
