"""The engine's hot path never makes the host wait for the device behind its back (GPU).

The scheduler runs in-process (triton backend, CUDA graphs, overlap) under PyTorch's CUDA
sync debug mode, which reports every synchronizing call: blocking copies, `.item()`,
`.tolist()`, stream syncs. The one wait the design allows, on the event recorded after a
batch's result copy (cudaEventSynchronize), is not such a call. Tokens are compared with
the same requests on the CPU reference engine (torch_native, no overlap, no graphs).
"""

from __future__ import annotations

import os
import traceback
import warnings
from types import TracebackType
from typing import Any

import torch

if not torch.cuda.is_available():
    # skipped then; importing the kernels must not fix triton to compiled mode for the CPU tests
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from radixmesh.engine.device_io import HostCopy, copy_to_device, rows_to_device, tensor_to_device, to_device
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from ..unit.scheduler_factory import (
    VOCAB,
    assert_no_leak,
    clone,
    make_requests,
    make_scheduler,
    run_until_idle,
    tiny_model_config,
)

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
EOS = 5
GPU_ENGINE: dict[str, Any] = dict(device="cuda", dtype="float32", attention_backend="triton", overlap_schedule="on",
                                  cuda_graph_max_bs=8)  # the largest batch below (7) replays


class SyncMonitor:
    """Records each synchronizing CUDA call made inside the block, with its Python stack."""

    def __init__(self) -> None:
        self.syncs: list[str] = []
        self._catch = warnings.catch_warnings()

    def __enter__(self) -> SyncMonitor:
        self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # its own first-use warning is not a sync of the code under test
        self._show = warnings.showwarning
        warnings.showwarning = self._record
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(kind, exc, tb)

    def _record(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                file: Any = None, line: str | None = None) -> None:
        if "synchronizing" in str(message):
            self.syncs.append("".join(traceback.format_stack(limit=14)[:-1]))
        else:
            self._show(message, category, filename, lineno, file, line)

    def report(self) -> str:
        """Each distinct place that synchronized, with how often (for the failure message)."""
        counts: dict[str, int] = {}
        for stack in self.syncs:
            counts[stack] = counts.get(stack, 0) + 1
        return "\n".join(f"--- {n} sync(s) at:\n{stack}" for stack, n in counts.items())


def model_config() -> ModelConfig:
    # head_dim 16: the smallest the Triton kernels take
    return tiny_model_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                             eos_token_ids=(EOS,))


def test_monitor_sees_implicit_syncs() -> None:
    x = torch.ones(4, device=DEVICE)
    with SyncMonitor() as monitor:
        x.sum().item()
        torch.tensor([1, 2], device=DEVICE)
    assert len(monitor.syncs) >= 2, "the sync detector is blind: the engine test below would prove nothing"


def test_device_io_never_syncs_and_its_copies_land() -> None:
    a = torch.randn(2048, 2048, device=DEVICE)
    torch.cuda.synchronize()
    with SyncMonitor() as monitor:
        for _ in range(30):  # milliseconds of queued work ahead of every copy below
            a = torch.tanh(a @ a * 1e-3)
        row = a[0, :8] * 2
        copy = HostCopy([row, None])
        packed = rows_to_device([[1, 2, 3], [], [4]], DEVICE)
        scalars = to_device([0.5, 1.5], torch.float32, DEVICE)
        moved = tensor_to_device(torch.arange(5), DEVICE)
        dst = torch.zeros(6, dtype=torch.int64, device=DEVICE)
        copy_to_device(dst[1:4], [7, 8, 9])
        # many short-lived pinned sources while the device is busy: none may be reused early
        many = [to_device([i] * 64, torch.int64, DEVICE) for i in range(200)]
        host_row, nothing = copy.wait()
    assert monitor.syncs == [], monitor.report()
    assert nothing is None and host_row is not None and host_row.is_pinned()
    torch.testing.assert_close(host_row, row.cpu())
    assert [t.tolist() for t in packed] == [[1, 2, 3], [], [4]]
    assert scalars.tolist() == [0.5, 1.5] and moved.tolist() == list(range(5))
    assert dst.tolist() == [0, 7, 8, 9, 0, 0]
    assert all(t.eq(i).all() for i, t in enumerate(many))


def _reference_tokens(reqs: list[Req], **overrides: Any) -> dict[str, list[int]]:
    sched, col = make_scheduler(model_config(), **overrides)
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    return col.tokens


def _warm_up(sched: Any) -> None:
    """Compile the Triton kernels and fill the pinned-memory pools outside the monitored block."""
    for req in make_requests(6, seed=99, max_new_tokens=8, prompt_len=(3, 30)):
        sched.add_request(req)
    run_until_idle(sched)


def _run_monitored(sched: Any, reqs: list[Req], abort_at: dict[int, str] | None = None) -> SyncMonitor:
    graphs = sched.runner.graph_runner
    assert graphs is not None, "CUDA graphs are off: the test would not cover the replay path"
    replays, waits = graphs.num_replays, sched.counters.result_wait_s
    with SyncMonitor() as monitor:
        for req in reqs:
            sched.add_request(clone(req))
        steps = 0
        while sched.has_work:
            if abort_at and steps in abort_at:
                sched.abort(abort_at[steps])
            sched.step()
            steps += 1
            assert steps < 2000, "the scheduler did not finish"
    assert monitor.syncs == [], monitor.report()
    assert graphs.num_replays - replays >= 10, "too few graph replays to say anything"
    assert sched.counters.result_wait_s > waits, "results reached the host without the explicit wait"
    assert_no_leak(sched)
    return monitor


def test_decode_with_graphs_and_overlap_never_syncs() -> None:
    """Plain traffic: greedy and sampled rows, batches above and below the largest graph."""
    sched, col = make_scheduler(model_config(), **GPU_ENGINE)
    _warm_up(sched)
    greedy = make_requests(4, seed=1, shared_prefix_len=10, max_new_tokens=24)
    for i, req in enumerate(greedy):  # lengths differ: the batch shrinks through the graph sizes
        req.params = SamplingParams(max_new_tokens=10 + 12 * i, temperature=0.0, ignore_eos=True)
    sampled = [Req(rid=f"s{i}", origin_input_ids=list(range(3, 12 + i)),
                   params=SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, top_k=20, min_p=0.02,
                                         seed=i if i % 2 else None, ignore_eos=True)) for i in range(3)]
    _run_monitored(sched, greedy + sampled)
    assert sched.runner.sampling_cache.num_reuses > 0
    expected = _reference_tokens(greedy)
    for req in greedy:
        assert col.tokens[req.rid] == expected[req.rid], req.rid
    for req in sampled:
        assert len(col.tokens[req.rid]) == 30 and all(0 <= t < VOCAB for t in col.tokens[req.rid])


def test_every_sampling_feature_stays_sync_free() -> None:
    """Log-probs, top log-probs, prompt log-probs, bias, min_new_tokens, stop ids, penalties
    (they wait for the previous tokens on purpose, through the same event) and an abort."""
    sched, col = make_scheduler(model_config(), **GPU_ENGINE)
    logprob_col: dict[str, list[Any]] = {}

    def emit(outputs: list[Any]) -> None:
        col(outputs)
        for out in outputs:
            logprob_col.setdefault(out.rid, []).append((out.token_ids, out.logprobs, out.top_logprobs,
                                                        out.input_logprobs))

    sched.emit = emit
    _warm_up(sched)
    base = make_requests(7, seed=4, shared_prefix_len=6, max_new_tokens=20)
    settings = [
        dict(logprobs=True, top_logprobs=3),
        dict(logprob_start_len=2, top_logprobs=2, logprobs=True),
        dict(logit_bias={3: 4.0, 8: -100.0}),
        dict(min_new_tokens=15),
        dict(stop_token_ids=(11, 12)),
        dict(frequency_penalty=0.5, repetition_penalty=1.3, max_new_tokens=8),
        dict(max_new_tokens=40),  # aborted mid-decode
    ]
    reqs = []
    for req, extra in zip(base, settings):
        params = dict(max_new_tokens=20, temperature=0.0)
        params.update(extra)  # type: ignore[arg-type]
        reqs.append(Req(rid=req.rid, origin_input_ids=req.origin_input_ids, params=SamplingParams(**params)))
    aborted = reqs[-1].rid
    _run_monitored(sched, reqs, abort_at={12: aborted})
    expected = _reference_tokens(reqs[:-1])
    for req in reqs[:-1]:
        assert col.tokens[req.rid] == expected[req.rid], req.rid
    assert col.finish[aborted] == "abort"
    chunks = logprob_col[reqs[0].rid]
    logprobs = [lp for _, lps, _, _ in chunks for lp in lps or []]
    tops = [row for _, _, rows, _ in chunks for row in rows or []]
    assert len(logprobs) == len(tops) == len(col.tokens[reqs[0].rid])
    for token, lp, top in zip(col.tokens[reqs[0].rid], logprobs, tops):
        assert top[0][0] == token and abs(top[0][1] - lp) < 1e-4  # greedy: the most likely token
    prompt_lps = [lp for _, _, _, ins in logprob_col[reqs[1].rid] for lp in ins or []]
    assert len(prompt_lps) == len(reqs[1].origin_input_ids) - 2


def test_retraction_under_memory_pressure_stays_sync_free() -> None:
    retract = dict(max_total_tokens=90, init_new_token_ratio=0.05, min_new_token_ratio=0.05)
    sched, col = make_scheduler(model_config(), **GPU_ENGINE, **retract)
    _warm_up(sched)
    reqs = make_requests(6, seed=1, shared_prefix_len=10) + make_requests(4, seed=2)
    _run_monitored(sched, reqs)
    assert sched.counters.num_retractions > 0
    expected = _reference_tokens(reqs, **retract)
    for req in reqs:
        assert col.tokens[req.rid] == expected[req.rid], req.rid


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The default model's tokenizer: from RADIXMESH_TEST_TOKENIZER_DIR where the GPU machine has no
    network (scripts/gpu_suite.sh points it at .gpu-model), else the installed default model."""
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.loader import ensure_default_model

    path = os.environ.get("RADIXMESH_TEST_TOKENIZER_DIR")
    return load_tokenizer(path if path else ensure_default_model())


def test_grammar_rows_stay_sync_free(tokenizer: Any) -> None:
    """JSON-schema and regex rows batched with plain ones: masks are filled on the host and copied
    from pinned memory, rows indexed on the device; outputs still follow their grammars."""
    import json
    import re

    vocab = 49152
    mc = tiny_model_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                           vocab_size=vocab, eos_token_ids=(2,))
    sched, col = make_scheduler(mc, tokenizer=tokenizer, **GPU_ENGINE)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    regex = r"(cat|dog)-[0-9]{2,3}"

    def grammar_reqs(tag: str) -> list[Req]:
        reqs = []
        for i in range(6):
            kind = {0: dict(json_schema=json.dumps(schema)), 1: dict(regex=regex)}.get(i % 3, dict(ignore_eos=True))
            reqs.append(Req(rid=f"{tag}{i}", origin_input_ids=[5, 17 + i, 99, 1000 + i],
                            params=SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, **kind)))
        return reqs

    for req in grammar_reqs("warm"):  # compiles the grammars and the kernels outside the monitor
        sched.add_request(req)
    run_until_idle(sched)
    reqs = grammar_reqs("g")
    _run_monitored(sched, reqs)
    assert not col.errors, col.errors
    for i, req in enumerate(reqs):
        text = tokenizer.decode(col.tokens[req.rid], skip_special_tokens=True)
        assert text or i % 3 == 2, (req.rid, col.tokens[req.rid], col.finish.get(req.rid))
        if i % 3 == 0:
            value = json.loads(text)
            assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99, text
        elif i % 3 == 1:
            assert re.fullmatch(regex, text), text
