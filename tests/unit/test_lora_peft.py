"""LoRA adapters end to end in the scheduler on a tiny random Llama: greedy tokens equal Hugging Face PEFT's
(random adapters of ranks 8 and 64, rsLoRA, a subset of targets, mixed in one batch with base requests), and
the radix cache keeps adapters' prefixes apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from .lora_factory import peft_greedy, write_random_adapter
from .scheduler_factory import assert_no_leak, run_until_idle
from .tp_factory import make_tp_scheduler, write_tiny_checkpoint

pytest.importorskip("peft")

PROMPTS = [[5, 17, 3, 99, 42, 8, 61], [7, 7, 12, 88, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = write_tiny_checkpoint(root / "tiny")
    return {"model": model,
            "r8": write_random_adapter(model, root / "r8", rank=8, seed=1),
            "r64": write_random_adapter(model, root / "r64", rank=64, seed=2, alpha=32, use_rslora=True,
                                        targets=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path]) -> dict[tuple[str | None, int], list[int]]:
    return {(name, i): peft_greedy(dirs["model"], dirs[name] if name else None, prompt, MAX_NEW)
            for name in (None, "r8", "r64") for i, prompt in enumerate(PROMPTS)}


def _scheduler(dirs: dict[str, Path], **overrides: object):
    settings = dict(lora_paths=(f"r8={dirs['r8']}", f"r64={dirs['r64']}"), max_lora_rank=64, chunked_prefill_size=8)
    settings.update(overrides)
    return make_tp_scheduler(dirs["model"], 1, **settings)


def _req(rid: str, prompt: list[int], lora: str | None) -> Req:
    return Req(rid=rid, origin_input_ids=list(prompt), params=SamplingParams(max_new_tokens=MAX_NEW, temperature=0,
                                                                              ignore_eos=True), lora_name=lora)


def test_adapters_differ_from_base(reference: dict[tuple[str | None, int], list[int]]) -> None:
    for i in range(len(PROMPTS)):
        assert len({tuple(reference[(name, i)]) for name in (None, "r8", "r64")}) == 3, "adapters must matter"


@pytest.mark.parametrize("slots", [3, 1])
def test_mixed_batch_matches_peft(dirs: dict[str, Path], reference: dict[tuple[str | None, int], list[int]],
                                  slots: int) -> None:
    """Every (adapter, prompt) pair at once; with one slot the adapters take turns on it."""
    sched, col = _scheduler(dirs, max_loras_per_batch=slots)
    for name in (None, "r8", "r64"):
        for i, prompt in enumerate(PROMPTS):
            sched.add_request(_req(f"{name}-{i}", prompt, name))
    run_until_idle(sched)
    assert not col.errors, col.errors
    for (name, i), tokens in reference.items():
        assert col.tokens[f"{name}-{i}"] == tokens, (name, i)
    assert_no_leak(sched)


def test_cache_isolation_between_adapters(dirs: dict[str, Path],
                                          reference: dict[tuple[str | None, int], list[int]]) -> None:
    """The same prompt under another adapter finds nothing cached; under its own adapter, its prefix."""
    sched, col = _scheduler(dirs)
    prompt = PROMPTS[2]
    for rid, lora in (("first", "r8"), ("other", "r64"), ("base", None), ("again", "r8")):
        sched.add_request(_req(rid, prompt, lora))
        run_until_idle(sched)
    assert col.cached["first"] == 0 and col.cached["other"] == 0 and col.cached["base"] == 0
    assert col.cached["again"] == len(prompt) - 1
    assert col.tokens["again"] == col.tokens["first"] == reference[("r8", 2)]
    assert col.tokens["other"] == reference[("r64", 2)] and col.tokens["base"] == reference[(None, 2)]


def test_unknown_adapter_fails_naming_it(dirs: dict[str, Path]) -> None:
    sched, col = _scheduler(dirs)
    sched.add_request(_req("x", PROMPTS[0], "nope"))
    run_until_idle(sched)
    assert "'nope'" in col.errors["x"] and col.finish["x"] == "error"


def test_host_memory_keeps_the_most_recent_adapters_and_never_drops_one_in_use(dirs: dict[str, Path]) -> None:
    from radixmesh.engine.lora.hook import LoraHook
    from radixmesh.wire.messages import LoraListReqMsg, LoraLoadReqMsg, LoraUnloadReqMsg

    sched, col = _scheduler(dirs, lora_paths=(f"r8={dirs['r8']}",), max_loaded_loras=1)
    hook = sched.hooks.get(LoraHook)
    assert hook is not None
    replies: dict[str, dict] = {}

    def ask(msg: object) -> dict:
        hook.handle(msg, lambda qid, result: replies.__setitem__(qid, result))  # type: ignore[arg-type]
        return replies[msg.query_id]  # type: ignore[attr-defined]

    sched.add_request(_req("waits", PROMPTS[0], "r8"))  # queued: r8 is in use
    busy = ask(LoraLoadReqMsg("q1", "r64", str(dirs["r64"])))
    assert busy["code"] == "invalid_argument" and "in use" in busy["error"]
    assert "in use" in ask(LoraUnloadReqMsg("q2", "r8"))["error"]
    run_until_idle(sched)
    assert ask(LoraLoadReqMsg("q3", "r64", str(dirs["r64"])))["rank"] == 64  # r8 leaves host memory
    assert [a["name"] for a in ask(LoraListReqMsg("q4"))["adapters"]] == ["r64"]
    sched.add_request(_req("gone", PROMPTS[0], "r8"))
    run_until_idle(sched)
    assert "'r8'" in col.errors["gone"]
