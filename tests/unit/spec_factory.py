"""Factories for speculative-decoding tests: tiny draft models on disk and a scripted proposer."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, ClassVar

import pytest

from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.engine.speculative.base import BaseProposer, Proposal, ProposerContext
from radixmesh.engine.speculative.decoder import SpecDecoder
from radixmesh.engine.speculative.registry import PROPOSERS
from tests.unit.scheduler_factory import VOCAB, Collector, make_scheduler

TINY_HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 256,
}
"""config.json of the scheduler factory's tiny model (`tiny_model_config()`)."""


def write_model_dir(path: Path, **overrides: Any) -> Path:
    """A directory holding only a config.json: a model for `--load-format dummy`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **overrides}))
    return path


def draft_scheduler(draft_dir: Path, same_weights: bool = False, **overrides: Any) -> tuple[Scheduler, Collector]:
    """A tiny scheduler speculating with a draft model from `draft_dir` (random weights, or a copy of
    the target's so that every greedy draft is accepted)."""
    sched, col = make_scheduler(speculative_algorithm="draft", speculative_draft_model=str(draft_dir),
                                speculative_draft_load_format="dummy", **overrides)
    if same_weights:
        spec = sched.hooks.get(SpecDecoder)
        assert spec is not None
        draft = spec.proposer.runner.model  # type: ignore[attr-defined]
        draft.load_state_dict(sched.runner.model.state_dict())
    return sched, col


def draft_values(proposal: Proposal) -> list[list[int]]:
    """Each request's drafts, read from the device when they stayed there (`Proposal.device_drafts`)."""
    if proposal.device_drafts is None:
        return [list(d) for d in proposal.drafts]
    flat = proposal.device_drafts.tolist()
    return [flat[first:first + len(d)] for first, d in zip(proposal.prob_rows, proposal.drafts)]


class OracleProposer(BaseProposer):
    """Proposes each request's known greedy continuation, with one token spoiled at a position that
    depends on the request's prompt and progress (reproducibly), so that acceptance lengths vary
    from 0 to all."""

    id = "oracle"
    reference: ClassVar[dict[str, list[int]]] = {}
    """Output of each request id without speculation."""

    def __init__(self, ctx: ProposerContext) -> None:
        self.vocab = ctx.target.model_config.vocab_size
        self.released: list[str] = []

    def propose(self, reqs: list[Req], max_drafts: list[int]) -> Proposal:
        drafts = []
        for req, limit in zip(reqs, max_drafts):
            done = len(req.output_ids)
            tokens = list(self.reference.get(req.rid, [])[done:done + limit])
            spoil = zlib.crc32(f"{req.origin_input_ids}:{done}".encode()) % (limit + 2)  # not the rid: random
            if spoil < len(tokens):
                tokens[spoil] = (tokens[spoil] + 1) % self.vocab
            drafts.append(tokens)
        return Proposal(drafts)

    def release(self, req: Req) -> None:
        self.released.append(req.rid)


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> type[OracleProposer]:
    """Registers `OracleProposer` as --speculative-algorithm oracle for one test."""
    monkeypatch.setitem(PROPOSERS, "oracle", "tests.unit.spec_factory:OracleProposer")
    OracleProposer.reference = {}
    return OracleProposer
