"""Routing policies behind a registry of kebab-case ids; implementations are imported lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from radixmesh.router.policies.base import BaseRoutingPolicy

ROUTING_POLICIES: LazyRegistry[type[BaseRoutingPolicy]] = LazyRegistry("policy", {
    "cache-aware": "radixmesh.router.policies.cache_aware:CacheAwarePolicy",
    "approx-tree": "radixmesh.router.policies.approx_tree:ApproxTreePolicy",
    "power-of-two": "radixmesh.router.policies.simple:PowerOfTwoPolicy",
    "round-robin": "radixmesh.router.policies.simple:RoundRobinPolicy",
    "random": "radixmesh.router.policies.simple:RandomPolicy",
}, param="policy")
POLICY_IDS = ROUTING_POLICIES.ids


def create_policy(policy_id: str, config: Any, **deps: Any) -> BaseRoutingPolicy:
    """Build the policy `policy_id` from a RouterConfig (and deps such as `reader`, a KVIndexReader)."""
    policy: BaseRoutingPolicy = ROUTING_POLICIES.create(policy_id, config, **deps)
    return policy
