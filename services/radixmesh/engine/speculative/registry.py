"""Proposer id -> lazily imported class; `--speculative-algorithm` and the Helm value use these ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from radixmesh.engine.speculative.base import BaseProposer, ProposerContext

PROPOSERS: LazyRegistry[type[BaseProposer]] = LazyRegistry("speculative algorithm", {
    "ngram": "radixmesh.engine.speculative.ngram:NgramProposer",
    "draft": "radixmesh.engine.speculative.draft_model:DraftModelProposer",
    "eagle": "radixmesh.engine.speculative.eagle:EagleProposer",
    "eagle3": "radixmesh.engine.speculative.eagle:EagleProposer",
    "oracle": "radixmesh.engine.speculative.oracle:OracleProposer",  # benchmarks only (bench speculative --oracle)
}, param="speculative_algorithm")


def create_proposer(name: str, ctx: ProposerContext) -> BaseProposer:
    proposer: BaseProposer = PROPOSERS.create(name, ctx)
    return proposer
