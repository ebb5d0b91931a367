"""EAGLE and EAGLE-3 heads (published checkpoint layouts, written by eagle_factory) drafting for the tiny target on
the CPU (fp32): they load, their features line up with the target's, and greedy output is plain decoding's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.models.eagle import Eagle3Draft, EagleDraft
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.eagle import EagleProposer
from radixmesh.wire.sampling import SamplingParams

from .eagle_factory import write_eagle, write_eagle3
from .scheduler_factory import VOCAB, Collector, assert_no_leak, clone, make_requests, make_scheduler, run_until_idle
from .spec_factory import draft_values


def _run(sched: Scheduler, col: Collector, reqs: list[Req]) -> dict[str, list[int]]:
    for req in reqs:
        sched.add_request(clone(req))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return {r.rid: col.tokens[r.rid] for r in reqs}


def _head_dir(tmp_path: Path, algorithm: str, identity: bool = False) -> Path:
    if algorithm == "eagle":
        return write_eagle(tmp_path / "eagle", seed=3, identity=identity)
    target = make_scheduler()[0].runner.model if identity else None  # the same seeded weights as every target
    return write_eagle3(tmp_path / "eagle3", seed=4, identity_of=target, draft_vocab=VOCAB if identity else 64)


def _eagle_scheduler(head: Path, algorithm: str, **overrides: Any) -> tuple[Scheduler, Collector, EagleProposer]:
    settings: dict[str, Any] = dict(speculative_algorithm=algorithm, speculative_draft_model=str(head),
                                    disable_speculative_backoff=True)
    sched, col = make_scheduler(**{**settings, **overrides})
    spec = sched.hooks.get(SpecDecoder)
    assert spec is not None and isinstance(spec.proposer, EagleProposer)
    return sched, col, spec.proposer


def _assert_clean(sched: Scheduler, proposer: EagleProposer) -> None:
    assert_no_leak(sched)
    assert sched.flush_cache()
    kv = proposer.kv
    assert kv.allocator.available_size() == kv.capacity, "head KV slots leaked"
    assert kv.req_pool.available_size() == kv.req_pool.size, "head rows leaked"


def test_eagle_head_loads_in_the_published_layout(tmp_path: Path) -> None:
    sched, _, proposer = _eagle_scheduler(write_eagle(tmp_path / "h", seed=1), "eagle")
    head = proposer.head
    assert type(head) is EagleDraft and head.config.architecture == "LlamaForCausalLMEagle"
    assert sorted(head.missing_optional) == ["embed_tokens.weight", "lm_head.weight"]
    target = sched.runner.model
    assert torch.equal(head.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    assert head.fc.bias is not None and head.fc.weight.shape == (32, 64)
    capture = target.model.capture
    assert capture is not None and capture.layers == () and capture.pool.shape[1] == 32


def test_eagle3_head_loads_its_vocabulary_map(tmp_path: Path) -> None:
    sched, _, proposer = _eagle_scheduler(write_eagle3(tmp_path / "h", seed=2, draft_vocab=40), "eagle3")
    head = proposer.head
    assert type(head) is Eagle3Draft and head.draft_vocab == 40 and head.lm_head.weight.shape == (40, 32)
    assert head.missing_optional == ["embed_tokens.weight"]
    targets = head.draft_to_target(torch.arange(40))
    assert len(set(targets.tolist())) == 40 and bool(head.t2d[targets].all()) and int(head.t2d.sum()) == 40
    capture = sched.runner.model.model.capture
    assert capture is not None and capture.layers == (1, 1, 2) and capture.pool.shape[1] == 96


def test_a_head_missing_a_weight_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = write_eagle(tmp_path / "h")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 weights"):
        _eagle_scheduler(path, "eagle")


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_identity_heads_draft_the_targets_greedy_token(tmp_path: Path, algorithm: str) -> None:
    """A head that passes the target's features through has the target's logits at the feature's position: its
    first draft must be the token the target chose there, i.e. the request's last token (then repeated). This
    fails when the features, the shifted tokens or the vocabulary map are off by one position or id."""
    sched, col, proposer = _eagle_scheduler(_head_dir(tmp_path, algorithm, identity=True), algorithm,
                                            speculative_num_draft_tokens=3)
    seen: list[tuple[int, list[int]]] = []
    propose = proposer.propose

    def spy(reqs: list[Req], max_drafts: list[int]) -> Any:
        proposal = propose(reqs, max_drafts)
        seen.extend((req.all_ids[-1], d) for req, d in zip(reqs, draft_values(proposal)) if d)
        return proposal

    proposer.propose = spy  # type: ignore[method-assign]
    reqs = make_requests(4, seed=21, max_new_tokens=12)
    expected = _run(*make_scheduler(), reqs)
    assert _run(sched, col, reqs) == expected
    assert len(seen) >= 8
    assert all(drafts == [last] * len(drafts) for last, drafts in seen), seen[:4]
    _assert_clean(sched, proposer)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
@pytest.mark.parametrize("overrides", [
    {},
    {"chunked_prefill_size": 8},
    {"max_total_tokens": 200, "max_running_requests": 8},  # retractions
    {"speculative_num_steps": 2, "speculative_num_draft_tokens": 6},
], ids=["default", "chunked", "tight-kv", "steps"])
def test_greedy_output_is_plain_decoding(tmp_path: Path, algorithm: str, overrides: dict[str, Any]) -> None:
    reqs = make_requests(8, seed=22, shared_prefix_len=5, max_new_tokens=18)
    plain_overrides = {k: v for k, v in overrides.items() if not k.startswith("speculative")}
    expected = _run(*make_scheduler(**plain_overrides), reqs)
    sched, col, proposer = _eagle_scheduler(_head_dir(tmp_path, algorithm), algorithm, **overrides)
    assert _run(sched, col, reqs) == expected
    stats = sched.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_draft_passes"] > 0
    assert stats["spec_draft_device_proposals"] > 0  # greedy: the drafts went to the verify pass on the device
    if "speculative_num_steps" in overrides:
        assert sched.config.speculative_max_drafts == 2
    _assert_clean(sched, proposer)


def test_sampled_requests_with_a_seed_are_reproducible(tmp_path: Path) -> None:
    head = _head_dir(tmp_path, "eagle3")
    reqs = make_requests(4, seed=23, max_new_tokens=14)
    for req in reqs:
        req.params = SamplingParams(max_new_tokens=14, temperature=0.9, seed=7)
    outs = [_run(*_eagle_scheduler(head, "eagle3")[:2], reqs) for _ in range(2)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("overrides, message", [
    ({"speculative_algorithm": "eagle"}, "--speculative-algorithm eagle needs --speculative-draft-model"),
    ({"speculative_algorithm": "ngram", "speculative_num_steps": 3}, "go with --speculative-algorithm eagle"),
    ({"speculative_algorithm": "ngram", "speculative_eagle_topk": 2}, "go with --speculative-algorithm eagle"),
    ({"speculative_algorithm": "eagle", "speculative_draft_model": "x", "speculative_eagle_topk": 9},
     "speculative_eagle_topk must be"),
])
def test_bad_eagle_options_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(RadixMeshError, match=message):
        make_scheduler(**overrides)
