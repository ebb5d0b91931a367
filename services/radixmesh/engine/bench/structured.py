"""`radixmesh bench structured`: JSON-schema decoding against the same work unconstrained.

One scheduler, in-process (as `bench offline`), runs the same random prompts twice:

1. constrained: every request asks for JSON matching one schema (its grammar mask applied
   on the device every step, jump-forward when the engine has it on); each output must
   parse and, where `jsonschema` is installed, validate;
2. unconstrained: the same prompts with `ignore_eos` and each request's output length set
   to what the constrained run produced, so both runs decode the same number of tokens in
   batches of the same shapes.

The throughput ratio is the cost of structured outputs; the forward-pass count shows what
jump-forward saved (run once with and once without `--enable-jump-forward`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from typing import Any

from radixmesh.engine.bench.profile import HostPhases
from radixmesh.engine.bench.throughput import StepClock, Timeline, _report, device_info, run_all, settings

SCHEMAS: dict[str, dict[str, Any]] = {
    # free fields: bounded strings, enums, bounded numbers, an array
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "role": {"enum": ["engineer", "doctor", "artist", "teacher"]},
            "verified": {"type": "boolean"},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                       "minItems": 1, "maxItems": 4},
        },
        "required": ["name", "age", "role", "verified", "scores"],
    },
    # forced text dominates: what jump-forward skips
    "long-keys": {
        "type": "object",
        "properties": {
            "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 9},
            "delivery_address_has_been_confirmed_by_the_customer": {"type": "boolean"},
            "preferred_notification_channel_for_shipping_updates": {"enum": ["email_message", "text_message"]},
            "number_of_previous_orders_placed_with_this_account": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["customer_account_identifier", "delivery_address_has_been_confirmed_by_the_customer",
                     "preferred_notification_channel_for_shipping_updates",
                     "number_of_previous_orders_placed_with_this_account"],
    },
}


def build_scheduler_with_tokenizer(args: argparse.Namespace, emit: Timeline) -> tuple[Any, Any]:
    from radixmesh.common.errors import invalid_argument
    from radixmesh.engine.args import engine_kwargs
    from radixmesh.engine.config import EngineConfig
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.loader import prepare_model
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler.core import Scheduler

    kwargs = engine_kwargs(args)
    kwargs["model"] = args.model_shape or args.model or "smollm2-135m"
    config = EngineConfig(**kwargs).resolve()
    prepared = prepare_model(config.model, config.load_format, lend_tokenizer=True, tokenizer=config.tokenizer)
    if prepared.tokenizer_path is None:
        raise invalid_argument(f"model {config.model!r} has no tokenizer; structured outputs need one (pass "
                               "--tokenizer, give a directory with config.json and tokenizer files, or a shape "
                               "of the default model's vocabulary)", "model")
    tokenizer = load_tokenizer(prepared.tokenizer_path)
    runner = ModelRunner(config, prepared)
    return Scheduler(config, runner, tokenizer, emit), tokenizer


def make_prompts(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(input_len)] for _ in range(num)]


def run_requests(sched: Any, timeline: Timeline, prompts: list[list[int]], params: list[Any],
                 tag: str, clock: ModeClock | None = None) -> tuple[float, dict[str, Any]]:
    """Run one request per prompt; (duration in seconds, the finished requests by rid).

    Starts from an empty prefix cache, so every run prefills its prompts (the runs share them).
    """
    from radixmesh.engine.request import Req

    assert sched.flush_cache(), "the scheduler still holds requests: the prefix cache cannot be flushed"
    timeline.reset()
    reqs = [Req(rid=f"{tag}{i}", origin_input_ids=list(p), params=sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    passes_before = sched.counters.num_forward_passes
    if clock is not None:
        clock.clear()
    start = run_all(sched, reqs, clock)
    duration = max(timeline.done_s.values()) - start
    return duration, {"reqs": reqs, "forward_passes": sched.counters.num_forward_passes - passes_before}


def check_outputs(reqs: list[Any], tokenizer: Any, schema: dict[str, Any]) -> dict[str, int]:
    """How many outputs parse as JSON and validate against the schema (validation needs jsonschema)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    num_parsed = num_valid = 0
    for req in reqs:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=True)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue
        num_parsed += 1
        if jsonschema is not None:
            try:
                jsonschema.validate(value, schema)
            except jsonschema.ValidationError:
                continue
            num_valid += 1
    return {"num_outputs": len(reqs), "num_parsed_json": num_parsed,
            "num_schema_valid": num_valid if jsonschema is not None else -1}


class ModeClock(StepClock):
    """A step clock that also notes what each step launched: a decode, a prefill (extend) or nothing."""

    def __init__(self, sched: Any) -> None:
        super().__init__(sched)
        self.modes: list[str] = []
        self._launched = "none"
        launch = sched.launch

        def noted_launch(batch: Any) -> Any:
            self._launched = "decode" if batch.is_decode else "prefill"
            return launch(batch)

        sched.launch = noted_launch

    def step(self) -> None:
        self._launched = "none"
        super().step()
        self.modes.append(self._launched)

    def clear(self) -> None:
        self.steps.clear()
        self.modes.clear()


HOST_PHASES = {"sched": ("schedule",), "results": ("process", "_wait_for_results"), "grammar_hook": ("vocab_mask",),
               "runner": ("forward", "sample"), "grammar": ("build_mask",)}
"""What `--profile-host` times: scheduling, result processing (and its wait for the device), the grammar hook's
masks (which first read the previous step's tokens under overlap), the runner's forward and sampling, and the
grammar manager's mask filling."""


def host_phase_owners(sched: Any) -> dict[str, Any]:
    """The objects of HOST_PHASES that are not attributes of the scheduler."""
    from radixmesh.engine.grammar.hook import GrammarHook

    hook = sched.hooks.get(GrammarHook)
    return {"grammar_hook": hook, "grammar": hook.manager}


def host_fields(phases: HostPhases, prefix: str, clock: ModeClock) -> dict[str, Any]:
    """The run's host time per phase and every decode step's time; the phases' totals start again."""
    result: dict[str, Any] = {f"{prefix}_host_s_{name.strip('_')}": round(total, 4)
                              for name, total in sorted(phases.take().items())}
    result[f"{prefix}_decode_step_ms"] = [round(s[0] * 1000, 1) for s, mode in zip(clock.steps, clock.modes)
                                          if mode == "decode"]
    return result


def step_times(clock: ModeClock, prefix: str) -> dict[str, Any]:
    """Wall time per scheduler step by what it launched (a one-off cost shows in the slowest steps)."""
    if not clock.steps:
        return {}
    walls = [s[0] * 1000 for s in clock.steps]
    result: dict[str, Any] = {}
    for mode in ("prefill", "decode", "none"):
        mine = [w for w, m in zip(walls, clock.modes) if m == mode]
        if mine:
            result[f"{prefix}_{mode}_steps"] = len(mine)
            result[f"{prefix}_{mode}_steps_s"] = round(sum(mine) / 1000, 4)
            result[f"{prefix}_{mode}_step_ms_median"] = round(statistics.median(mine), 3)
    result[f"{prefix}_step_ms_slowest"] = [round(w, 2) for w in sorted(walls, reverse=True)[:3]]
    result[f"{prefix}_step_cpu_ms_median"] = round(1000 * statistics.median(s[3] for s in clock.steps), 3)
    return result


def cmd_structured(args: argparse.Namespace) -> int:
    from radixmesh.wire.sampling import SamplingParams

    schema = SCHEMAS[args.schema]
    timeline = Timeline()
    sched, tokenizer = build_scheduler_with_tokenizer(args, timeline)
    vocab = sched.runner.model_config.vocab_size
    warm = make_prompts(args.num_prompts, 32, vocab, 7)  # the batch size of the runs: its kernels and graphs
    run_requests(sched, timeline, warm, [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0,
                                                        json_schema=json.dumps(schema))] * len(warm), "warm")
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    constrained = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 json_schema=json.dumps(schema))
    clock = ModeClock(sched)
    phases = HostPhases(sched, HOST_PHASES, host_phase_owners(sched)) if args.profile_host else None
    c_s, c_run = run_requests(sched, timeline, prompts, [constrained] * len(prompts), "json", clock)
    constrained_steps = step_times(clock, "constrained")
    out_lens = [len(r.output_ids) for r in c_run["reqs"]]
    finish = [r.finish_reason.value if r.finish_reason else "" for r in c_run["reqs"]]
    result: dict[str, Any] = {
        "bench": "structured", **device_info(sched), **settings(sched, args), "schema": args.schema,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "total_output_tokens": sum(out_lens),
        "constrained_duration_s": round(c_s, 4),
        "constrained_output_tok_s": round(sum(out_lens) / c_s, 1),
        "constrained_forward_passes": c_run["forward_passes"],
        "finish_reasons": {reason: finish.count(reason) for reason in sorted(set(finish))},
        **check_outputs(c_run["reqs"], tokenizer, schema), **constrained_steps,
        **(host_fields(phases, "constrained", clock) if phases is not None else {}),
    }
    if not args.skip_unconstrained:
        free = [SamplingParams(max_new_tokens=max(n, 1), temperature=args.temperature, ignore_eos=True)
                for n in out_lens]
        u_s, u_run = run_requests(sched, timeline, prompts, free, "free", clock)
        result.update({
            "unconstrained_duration_s": round(u_s, 4),
            "unconstrained_output_tok_s": round(sum(out_lens) / u_s, 1),
            "unconstrained_forward_passes": u_run["forward_passes"],
            "throughput_loss": round(1 - (sum(out_lens) / c_s) / (sum(out_lens) / u_s), 4),
            **step_times(clock, "unconstrained"),
            **(host_fields(phases, "unconstrained", clock) if phases is not None else {}),
        })
    _report(result, args)
    return 0


def register_structured(bench: argparse._SubParsersAction) -> None:
    from radixmesh.engine.args import add_engine_args

    parser = bench.add_parser("structured", help="JSON-schema decoding vs the same work unconstrained")
    add_engine_args(parser)
    parser.set_defaults(load_format="dummy", func=cmd_structured)
    parser.add_argument("--model-shape", default=None,
                        help="named shape for random weights (its vocabulary must be the default model's); "
                             "or give --model DIR with config.json and tokenizer files")
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="person")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests, all sent at once (the batch)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile-host", action="store_true",
                        help="also report host time in the scheduler's phases and every decode step's time")
    parser.add_argument("--skip-unconstrained", action="store_true",
                        help="only the constrained run (e.g. to compare jump-forward on and off)")
    parser.add_argument("--result-file", default=None, help="append the JSON result to this file")
