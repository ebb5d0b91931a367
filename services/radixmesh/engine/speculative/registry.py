"""Proposer id -> lazily imported class; `--speculative-algorithm` and the Helm value use these ids."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:
    from radixmesh.engine.speculative.base import BaseProposer, ProposerContext

PROPOSERS: dict[str, str] = {
    "ngram": "radixmesh.engine.speculative.ngram:NgramProposer",
    "draft": "radixmesh.engine.speculative.draft_model:DraftModelProposer",
}


def create_proposer(name: str, ctx: ProposerContext) -> BaseProposer:
    target = PROPOSERS.get(name)
    if target is None:
        raise invalid_argument(f"unknown speculative algorithm {name!r} (known: {', '.join(sorted(PROPOSERS))})",
                               param="speculative_algorithm")
    module, _, attr = target.partition(":")
    proposer: BaseProposer = getattr(importlib.import_module(module), attr)(ctx)
    return proposer
