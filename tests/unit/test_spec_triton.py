"""Verify passes through the Triton extend kernel (CPU: the Triton interpreter, tiny shapes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton (radixmesh.kernels): @triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from .scheduler_factory import clone, make_requests, make_scheduler, run_until_idle, tiny_model_config
from .spec_factory import OracleProposer, oracle

__all__ = ["oracle"]  # the fixture


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scheduler factory runs on CPU: triton needs the interpreter")
def test_verify_with_the_triton_backend_matches_plain_torch_native(oracle: type[OracleProposer]) -> None:
    reqs = make_requests(3, seed=21, shared_prefix_len=6, max_new_tokens=7)
    model = tiny_model_config(head_dim=16)
    outputs = {}
    for name, overrides in (("plain", {"attention_backend": "torch-native"}),
                            ("spec", {"attention_backend": "triton", "speculative_algorithm": "oracle",
                                      "disable_speculative_backoff": True})):
        sched, col = make_scheduler(model, **overrides)
        for req in reqs:
            sched.add_request(clone(req))
        run_until_idle(sched)
        outputs[name] = col.tokens
        if name == "plain":
            oracle.reference = dict(col.tokens)
        else:
            assert sched.stats()["spec_num_accepted_tokens"] > 0
    assert outputs["spec"] == outputs["plain"]
