"""Workload registry: a kebab-case id maps to a lazily imported builder (see `base.WorkloadBuilder`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from loadtests.workloads.base import WorkloadBuilder

WORKLOADS: LazyRegistry[WorkloadBuilder] = LazyRegistry("workload", {
    "random": "loadtests.workloads.random_prompts:RANDOM",
    "random-ids": "loadtests.workloads.random_prompts:RANDOM_IDS",
    "random-text-ids": "loadtests.workloads.random_prompts:RANDOM_TEXT_IDS",
    "sharegpt": "loadtests.workloads.sharegpt:SHAREGPT",
    "generated-shared-prefix": "loadtests.workloads.shared_prefix:SHARED_PREFIX",
    "multi-turn": "loadtests.workloads.multi_turn:MULTI_TURN",
    "json-schema": "loadtests.workloads.json_schema:JSON_SCHEMA",
}, param="workload", error=lambda message, param: ValueError(message))
"""Workload id -> "module:attribute" of its builder."""


def get_workload(name: str) -> WorkloadBuilder:
    return WORKLOADS.load(name)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Every workload's flags; builders of one class (the random ones) share theirs."""
    seen: set[type] = set()
    for name in WORKLOADS:
        builder = get_workload(name)
        if type(builder) not in seen:
            seen.add(type(builder))
            builder.add_args(parser)
