"""Routing policies behind a registry of kebab-case ids; implementations are imported lazily."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixmesh.router.policies.base import BaseRoutingPolicy

_FACTORIES: dict[str, str] = {
    "cache-aware": "radixmesh.router.policies.cache_aware:CacheAwarePolicy",
    "approx-tree": "radixmesh.router.policies.approx_tree:ApproxTreePolicy",
    "power-of-two": "radixmesh.router.policies.simple:PowerOfTwoPolicy",
    "round-robin": "radixmesh.router.policies.simple:RoundRobinPolicy",
    "random": "radixmesh.router.policies.simple:RandomPolicy",
}
POLICY_IDS = tuple(_FACTORIES)


def create_policy(policy_id: str, config: Any, **deps: Any) -> BaseRoutingPolicy:
    """Build the policy `policy_id` from a RouterConfig (and deps such as `reader`, a KVIndexReader)."""
    from radixmesh.common.errors import invalid_argument

    target = _FACTORIES.get(policy_id)
    if target is None:
        raise invalid_argument(f"unknown policy {policy_id!r}; choose one of {', '.join(POLICY_IDS)}", "policy")
    module, _, name = target.partition(":")
    factory = getattr(importlib.import_module(module), name)
    policy: BaseRoutingPolicy = factory(config, **deps)
    return policy
