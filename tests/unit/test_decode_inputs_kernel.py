"""The one-launch decode input staging kernel vs the PyTorch ops it replaces (`stage_inputs` on CPU).

Without CUDA the kernel runs under the Triton interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.engine.batch import future_index, resolve_futures
from radixmesh.kernels.decode_inputs import stage_decode_inputs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _reference(input_ids, future_rows, prev, slots, padded, req_to_token, pool_rows, positions):
    ids = input_ids.clone()
    plan = future_index(future_rows, prev.shape[0])
    if plan is not None:
        resolve_futures(ids, plan, torch.tensor(plan.index), prev)
    dst = torch.zeros(padded, dtype=torch.int64)
    dst[:len(slots)] = slots
    r2t = req_to_token.clone()
    r2t[pool_rows, positions] = slots
    return ids, dst, r2t


@pytest.mark.parametrize("future_rows,num_prev", [(None, 0), ([0, 1, 2], 3), ([2, -1, 0, -1], 5),
                                                  ([-1, -1], 4), ([0], 1)],
                         ids=["host-ids", "identity", "mixed", "none-future", "batch-1"])
@pytest.mark.parametrize("pad", [0, 3])
def test_stage_decode_inputs_matches_the_torch_ops(future_rows, num_prev, pad):
    n = len(future_rows) if future_rows is not None else 3
    padded = n + pad
    gen = torch.Generator().manual_seed(n * 10 + pad)
    input_ids = torch.randint(100, 200, (padded,), generator=gen)
    if future_rows is not None:
        input_ids[:n] = torch.tensor([0 if r >= 0 else int(input_ids[i]) for i, r in enumerate(future_rows)])
    prev = torch.randint(1000, 2000, (num_prev,), generator=gen)
    pool_rows = torch.randperm(8, generator=gen)[:n]
    positions = torch.randint(0, 32, (n,), generator=gen)
    slots = torch.randperm(50, generator=gen)[:n] + 1
    req_to_token = torch.zeros(8, 32, dtype=torch.int64)
    want_ids, want_dst, want_r2t = _reference(input_ids[:n], future_rows, prev, slots, padded, req_to_token,
                                              pool_rows, positions)

    plan = future_index(future_rows, num_prev)
    ids_dev = input_ids.to(DEVICE)
    gather = torch.tensor(plan.index + [0] * pad).to(DEVICE) if plan is not None else None
    dst = torch.full((padded,), 77, dtype=torch.int64, device=DEVICE)  # stale slots of a larger batch
    r2t = req_to_token.to(DEVICE)
    stage_decode_inputs(ids_dev, gather, prev.to(DEVICE), slots.to(DEVICE), dst, r2t, pool_rows.to(DEVICE),
                        positions.to(DEVICE))
    assert ids_dev[:n].cpu().tolist() == want_ids.tolist()
    assert ids_dev[n:].cpu().tolist() == input_ids[n:].tolist(), "padding rows' ids are left alone"
    assert dst.cpu().tolist() == want_dst.tolist(), "padding rows must get the dummy slot 0"
    assert torch.equal(r2t.cpu(), want_r2t)


def test_stage_decode_inputs_checks_its_inputs():
    ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    r2t = torch.zeros(4, 8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="rows for 2 padded slots"):
        stage_decode_inputs(ids, None, None, ids[:3], ids[:2], r2t, ids, ids)
    with pytest.raises(AssertionError, match="without the previous launch"):
        stage_decode_inputs(ids, ids, None, ids[:1], ids[:2], r2t, ids, ids)
    with pytest.raises(AssertionError, match="req_to_token must be"):
        stage_decode_inputs(ids, None, None, ids[:1], ids[:2], ids, ids, ids)


def test_host_ids_and_futures_launch_the_same_compiled_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose ids are all on the host (nothing was in flight) must not need a kernel variant of its own: the
    warm-up's steps, which read futures, compile the only ones a server launches (one per padded size)."""
    import radixmesh.kernels.decode_inputs as staging

    launches: list[dict[str, object]] = []

    class Recorder:
        def __getitem__(self, grid: object) -> object:
            return lambda *args, **constexprs: launches.append(constexprs)

    monkeypatch.setattr(staging, "_stage_decode_kernel", Recorder())
    ids = torch.zeros(8, dtype=torch.int64, device=DEVICE)  # (the launcher's checks run; the kernel is recorded)
    r2t = torch.zeros(8, 16, dtype=torch.int64, device=DEVICE)
    prev = torch.arange(5, dtype=torch.int64, device=DEVICE)
    stage_decode_inputs(ids, torch.arange(6, dtype=torch.int64, device=DEVICE), prev, ids[:6], ids[:8], r2t, ids, ids)
    stage_decode_inputs(ids, None, None, ids[:6], ids[:8], r2t, ids, ids)
    stage_decode_inputs(ids, None, prev, ids[:3], ids[:8], r2t, ids, ids)
    assert launches == [{"BLOCK": 8}] * 3
