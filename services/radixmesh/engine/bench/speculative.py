"""`radixmesh bench speculative`: decode throughput with and without speculative decoding.

Two engines are built side by side, a plain one and one with the `--speculative-*` flags given.
For each batch size the same greedy requests (every prompt, that many at a time) run on both,
round by round and alternating which goes first, so that a machine whose load drifts (a shared
CPU) slows both alike. Prints decode tokens per second (wall clock, and on a CPU also per second
of this thread's CPU time, which other processes do not inflate), the speedup, the mean acceptance
length and whether the outputs were identical; one JSON line per batch size.
Workloads: `copy` (rewrite or extend a passage, edit code; the model's tokenizer and chat
template) or `random` (random token ids; any shape, e.g. `--model-shape llama-3.1-8b`).
`--oracle` measures the machinery's ceiling: every prompt first runs on the plain engine and its
output is recorded; the speculative engine's oracle proposer replays it (speculative/oracle.py),
at the cost of `--speculative-draft-model` if given, and `--oracle-acceptance 1.0,0.7` repeats
the measurement with a seeded fraction of the proposals spoiled. Random weights in bf16 have near-ties
that the decode and verify kernels break differently; `--oracle-tie-margin` lets a verify row emit the
recorded token when it is that close to the row's maximum logit (counted as `oracle_snapped`), so the
run stays on its recording and its outputs equal the plain engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.bench.throughput import DEFAULT_SHAPE, _report, device_info, settings

SPEC_STATS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_passes",
              "spec_num_verified_requests", "spec_num_backoff_steps", "spec_oracle_diverged",
              "spec_oracle_snapped")


@dataclass
class Clocks:
    """Wall and thread CPU time when each request got its first token and its last."""

    first: dict[str, tuple[float, float]] = field(default_factory=dict)
    done: dict[str, tuple[float, float]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    def __call__(self, outputs: list[Any]) -> None:
        now = (time.perf_counter(), time.thread_time())
        for out in outputs:
            if out.error:
                raise RuntimeError(f"request {out.rid} failed: {out.error}")
            if out.token_ids:
                self.first.setdefault(out.rid, now)
                self.tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish_reason:
                self.done[out.rid] = now


@dataclass
class Totals:
    """One engine's sums over the rounds of one batch size."""

    decode_wall_s: float = 0.0
    decode_cpu_s: float = 0.0
    e2e_wall_s: float = 0.0
    decoded: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPEC_STATS, 0.0))


def _build(args: argparse.Namespace, speculative: bool) -> Any:
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler.core import Scheduler

    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_shape or args.model or (DEFAULT_SHAPE if args.workload == "random" else None)
    if args.model_shape:
        kwargs["load_format"] = "dummy"
    if args.oracle:
        kwargs["speculative_algorithm"] = "oracle"
    config = EngineConfig(**kwargs)
    if not speculative:
        config = dataclasses.replace(config, speculative_algorithm=None, speculative_draft_model=None,
                                     speculative_num_steps=None, speculative_eagle_topk=1)
    config = config.resolve()
    prepared = prepare_model(config.model, config.load_format, lend_tokenizer=args.workload == "copy")
    tokenizer = load_tokenizer(prepared.tokenizer_path) if prepared.tokenizer_path else None
    return Scheduler(config, ModelRunner(config, prepared), tokenizer, Clocks())


def _prompts(args: argparse.Namespace, sched: Any, count: int = 0, seed: int | None = None) -> list[list[int]]:
    """The copy workload's prompts, or `count` random prompts (default: the largest batch size)."""
    import random

    if args.workload == "copy":
        from radixmesh.engine.bench.spec_workload import copy_heavy_messages
        from radixmesh.engine.hf_tokenizer import encode_chat

        if sched.tokenizer is None:
            raise SystemExit("radixmesh: error: --workload copy needs a model with a tokenizer and chat template")
        return [encode_chat(sched.tokenizer, messages) for messages in copy_heavy_messages()]
    rng = random.Random(args.seed if seed is None else seed)
    vocab = sched.runner.model_config.vocab_size
    return [[rng.randrange(100, vocab - 1) for _ in range(args.input_len)]
            for _ in range(count or max(args.batch_sizes))]


def _run_round(sched: Any, prompts: list[list[int]], output_len: int, tag: str, totals: Totals) -> None:
    """All `prompts` at once (greedy, exactly `output_len` tokens each), added to `totals`."""
    import torch

    from radixmesh.engine.request import Req
    from radixmesh.wire.sampling import SamplingParams

    reqs = [Req(rid=f"{tag}{i}", origin_input_ids=list(ids),
                params=SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True))
            for i, ids in enumerate(prompts)]
    clocks = sched.emit = Clocks()
    before = sched.stats()
    cuda = sched.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for req in reqs:
        sched.add_request(req)
    while sched.has_work:
        sched.step()
    if cuda:
        torch.cuda.synchronize()
    first = max(clocks.first.values())
    done = max(clocks.done.values())
    totals.decode_wall_s += done[0] - first[0]
    totals.decode_cpu_s += done[1] - first[1]
    totals.e2e_wall_s += done[0] - start
    totals.decoded += sum(len(t) for t in clocks.tokens.values()) - len(reqs)
    totals.outputs += [clocks.tokens[r.rid] for r in reqs]
    after = sched.stats()
    for key in SPEC_STATS:
        totals.stats[key] += after.get(key, 0) - before.get(key, 0)


def _decoder(sched: Any) -> Any:
    """The speculative engine's `SpecDecoder` hook."""
    from radixmesh.engine.speculative.decoder import SpecDecoder

    decoder = sched.hooks.get(SpecDecoder)
    assert decoder is not None, "the speculative engine has no SpecDecoder"
    return decoder


def _record(args: argparse.Namespace, plain: Any, spec: Any, prompts: list[list[int]], batch_size: int,
            output_len: int) -> None:
    """--oracle: the plain engine's greedy output of each prompt, handed to the oracle proposer."""
    if not args.oracle:
        return
    proposer = _decoder(spec).proposer
    unique = [p for p in dict.fromkeys(tuple(p) for p in prompts) if len(proposer.recordings.get(p, ())) < output_len]
    for start in range(0, len(unique), batch_size):
        chunk = [list(p) for p in unique[start:start + batch_size]]
        totals = Totals()
        _run_round(plain, chunk, output_len, f"rec{batch_size}-{start}-", totals)
        for prompt, output in zip(chunk, totals.outputs):
            proposer.record(prompt, output)


def _compare(args: argparse.Namespace, plain: Any, spec: Any, prompts: list[list[int]],
             batch_size: int) -> tuple[Totals, Totals]:
    """Every request of this batch size on both engines, round by round, alternating which goes first.
    Random prompts are new for each batch size (none cached); a short warm-up round at this batch size
    on both engines first compiles what this size needs, then the back-off forgets it and learns anew."""
    num = args.num_prompts or (len(prompts) if args.workload == "copy" else args.rounds * batch_size)
    if args.workload == "random":
        work = _prompts(args, plain, num, seed=args.seed * 1000 + batch_size)
        warm = _prompts(args, plain, batch_size, seed=args.seed * 1000 + batch_size + 500)
        _record(args, plain, spec, warm, batch_size, 8)
        for sched in (plain, spec):
            _run_round(sched, warm, 8, f"warm{batch_size}-", Totals())
        _decoder(spec).policy.reset()
    else:
        work = [prompts[i % len(prompts)] for i in range(num)]
    _record(args, plain, spec, work, batch_size, args.output_len)
    totals = (Totals(), Totals())
    for round_index, start in enumerate(range(0, num, batch_size)):
        order = (0, 1) if round_index % 2 == 0 else (1, 0)
        for which in order:
            _run_round((plain, spec)[which], work[start:start + batch_size], args.output_len,
                       f"b{batch_size}-r{round_index}-", totals[which])
    return totals


def _row(p: Totals, s: Totals, cpu: bool) -> dict[str, Any]:
    stats = s.stats
    drafts, accepted, verified = (int(stats[k]) for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens",
                                                         "spec_num_verified_requests"))
    row: dict[str, Any] = {
        "plain_decode_tok_s": round(p.decoded / p.decode_wall_s, 2),
        "spec_decode_tok_s": round(s.decoded / s.decode_wall_s, 2),
        "speedup": round((s.decoded / s.decode_wall_s) / (p.decoded / p.decode_wall_s), 3),
    }
    if cpu:  # per second of this thread's CPU time: what other processes' load does not change
        row["plain_decode_tok_per_cpu_s"] = round(p.decoded / p.decode_cpu_s, 2)
        row["spec_decode_tok_per_cpu_s"] = round(s.decoded / s.decode_cpu_s, 2)
        row["speedup_cpu_time"] = round((s.decoded / s.decode_cpu_s) / (p.decoded / p.decode_cpu_s), 3)
    if "spec_oracle_diverged" in s.stats:  # requests whose output left the recording (bf16 rounding)
        row["oracle_diverged"] = int(s.stats["spec_oracle_diverged"])
        row["oracle_snapped"] = int(s.stats.get("spec_oracle_snapped", 0))
    same = sum(a == b for a, b in zip(p.outputs, s.outputs))
    row.update({
        "plain_e2e_s": round(p.e2e_wall_s, 3), "spec_e2e_s": round(s.e2e_wall_s, 3),
        "draft_tokens": drafts, "accepted_tokens": accepted,
        "accept_rate": round(accepted / drafts, 4) if drafts else 0.0,
        "mean_accept_length": round((accepted + verified) / verified, 3) if verified else 0.0,
        "verify_passes": int(stats["spec_num_verify_passes"]), "backoff_steps": int(stats["spec_num_backoff_steps"]),
        "num_requests": len(p.outputs), "identical_outputs": f"{same}/{len(p.outputs)}"})
    return row


def cmd_speculative(args: argparse.Namespace) -> int:
    args.oracle = args.oracle or args.oracle_acceptance is not None
    if args.oracle and args.speculative_algorithm not in (None, "oracle"):
        raise SystemExit("radixmesh: error: --oracle replaces --speculative-algorithm (the draft's cost: "
                         "--speculative-draft-model)")
    if args.speculative_algorithm is None and not args.oracle:
        raise SystemExit("radixmesh: error: bench speculative needs --speculative-algorithm or --oracle")
    acceptances = args.oracle_acceptance or [1.0]
    if any(not 0.0 <= a <= 1.0 for a in acceptances):
        raise SystemExit("radixmesh: error: --oracle-acceptance values must be in [0, 1]")
    plain = _build(args, speculative=False)
    spec = _build(args, speculative=True)
    prompts = _prompts(args, plain)
    _record(args, plain, spec, prompts[:2], 2, 8)
    for sched in (plain, spec):  # kernels compile, graphs warm; the back-off starts fresh per batch size
        _run_round(sched, prompts[:2], 8, "warm-", Totals())
    _decoder(spec).policy.reset()
    cfg = spec.config
    common = {"bench": "speculative", **device_info(spec), **settings(spec, args), "workload": args.workload,
              "speculative_algorithm": cfg.speculative_algorithm,
              "speculative_draft_model": cfg.speculative_draft_model,
              "speculative_num_draft_tokens": cfg.speculative_num_draft_tokens,
              "speculative_num_steps": cfg.speculative_num_steps, "speculative_eagle_topk": cfg.speculative_eagle_topk,
              "backoff": not cfg.disable_speculative_backoff, "output_len": args.output_len}
    cpu = spec.runner.device.type == "cpu"
    for acceptance in acceptances if args.oracle else [None]:
        extra: dict[str, Any] = {}
        if acceptance is not None:
            _decoder(spec).proposer.set_acceptance(acceptance, args.seed)
            _decoder(spec).proposer.set_tie_margin(args.oracle_tie_margin)
            extra = {"oracle_acceptance": acceptance, "oracle_tie_margin": args.oracle_tie_margin}
        for b in args.batch_sizes:
            p, s = _compare(args, plain, spec, prompts, b)
            row = {**common, **extra, "batch_size": b, **_row(p, s, cpu)}
            if args.profile_cycles and not cpu:
                row.update(_profile_cycles(args, plain, spec, b))
            _report(row, args)
    return 0


def _profile_cycles(args: argparse.Namespace, plain: Any, spec: Any, batch_size: int) -> dict[str, Any]:
    """--profile-cycles: 16 steps of a recorded batch, timed (wall per step) and then traced (device kernel time
    per step): what a speculative cycle costs on the device and how much of it the device waits for the host."""
    import time

    import torch

    from radixmesh.engine.bench.graph_profile import profile_decode_steps
    from radixmesh.engine.request import Req
    from radixmesh.wire.sampling import SamplingParams

    prompts = _prompts(args, plain, batch_size, seed=args.seed * 1000 + batch_size + 700)
    _record(args, plain, spec, prompts, batch_size, args.output_len)
    out: dict[str, Any] = {}
    for phase in ("timed", "traced"):
        reqs = [Req(rid=f"prof-{phase}{batch_size}-{i}", origin_input_ids=list(ids),
                    params=SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True))
                for i, ids in enumerate(prompts)]
        if phase == "traced":
            out.update(profile_decode_steps(spec, reqs, skip=4, steps=16))
            continue
        for req in reqs:
            spec.add_request(req)
        for _ in range(4):
            spec.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(16):
            spec.step()
        torch.cuda.synchronize()
        out["cycle_wall_ms"] = round((time.perf_counter() - start) / 16 * 1000, 3)
        while spec.has_work:
            spec.step()
    device_ms = out.get("step_kernel_us_per_replay", 0.0) / 1000
    out["cycle_device_ms"] = round(device_ms, 3)
    print(f"cycle: {out['cycle_wall_ms']:.2f} ms wall, {device_ms:.2f} ms of kernels on the device")
    return out


def register_speculative(bench: argparse._SubParsersAction) -> None:
    from radixmesh.engine.args import add_engine_args

    parser = bench.add_parser("speculative", help="decode throughput with and without speculative decoding")
    add_engine_args(parser)
    parser.add_argument("--model-shape", default=None, help="named shape for random weights (with --load-format dummy)")
    parser.add_argument("--workload", choices=("copy", "random"), default="copy",
                        help="copy: rewrite/extend passages and edit code (chat template); random: random token ids")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                        help="comma-separated batch sizes, e.g. 1,8,32")
    parser.add_argument("--input-len", type=int, default=512, help="random workload: prompt length")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="requests per batch size, run batch-size at a time (default: every copy prompt once; "
                             "random: one batch; more rounds average out noise)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="random workload without --num-prompts: batches per batch size (noise averages out)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--oracle", action="store_true",
                        help="benchmark-only drafts: the target's own greedy output, recorded on the plain engine "
                             "first (acceptance 1.0); at the cost of --speculative-draft-model when given")
    parser.add_argument("--oracle-acceptance", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="with --oracle: comma-separated accept rates, e.g. 1.0,0.7 (a seeded fraction of the "
                             "proposals is spoiled so that accepted / proposed is this in expectation)")
    parser.add_argument("--oracle-tie-margin", type=float, default=1.0,
                        help="with --oracle: a verify row emits the recorded token when its logit is within this of "
                             "the row's maximum (random weights in bf16 have near-ties that the decode and verify "
                             "kernels break differently, which would leave the recording within a few tokens); 0: "
                             "exact argmax only. Rows it changed are reported as oracle_snapped")
    parser.add_argument("--profile-cycles", action="store_true",
                        help="CUDA: after each batch size, 16 steps timed and traced (wall and kernel time per step, "
                             "the top kernels)")
    parser.add_argument("--result-file", default=None, help="append the JSON results to this file")
    parser.set_defaults(func=cmd_speculative)
