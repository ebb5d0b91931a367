"""Workload registry: a kebab-case id maps to a lazily imported builder (see `base.WorkloadBuilder`)."""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtests.workloads.base import WorkloadBuilder

WORKLOADS: dict[str, str] = {
    "random": "loadtests.workloads.random_prompts:RANDOM",
    "random-ids": "loadtests.workloads.random_prompts:RANDOM_IDS",
    "sharegpt": "loadtests.workloads.sharegpt:SHAREGPT",
    "generated-shared-prefix": "loadtests.workloads.shared_prefix:SHARED_PREFIX",
    "multi-turn": "loadtests.workloads.multi_turn:MULTI_TURN",
    "json-schema": "loadtests.workloads.json_schema:JSON_SCHEMA",
}
"""Workload id -> "module:attribute" of its builder."""


def get_workload(name: str) -> WorkloadBuilder:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    module, _, attr = WORKLOADS[name].partition(":")
    builder: WorkloadBuilder = getattr(importlib.import_module(module), attr)
    return builder


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Every workload's flags; builders of one class (random, random-ids) share theirs."""
    seen: set[type] = set()
    for name in WORKLOADS:
        builder = get_workload(name)
        if type(builder) not in seen:
            seen.add(type(builder))
            builder.add_args(parser)
