"""The `dfs-weight` policy: waiting requests in depth-first order of the radix tree.

Each waiting request hangs at the node where its cached prefix ends. A node's weight is
the number of waiting requests at it or below it. The walk starts at the root and visits
each node's children heaviest first, then takes the node's own requests (in arrival order):
requests that share a cached prefix are admitted next to one another while it is locked,
deeper (longer) matches before shallower ones, and requests with nothing cached last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.engine.request import Req

if TYPE_CHECKING:
    from radixmesh.engine.radix_cache import TreeNode


def dfs_weight_order(reqs: list[Req]) -> list[Req]:
    """`reqs` (each matched against the cache in this step) in dfs-weight order.

    Costs O(sum of the matched nodes' depths), whatever the size of the tree.
    """
    at_node: dict[TreeNode, list[Req]] = {}
    for req in reqs:
        assert req.matched_node is not None, "dfs-weight orders matched requests"
        at_node.setdefault(req.matched_node, []).append(req)
    weight: dict[TreeNode, int] = {}
    children: dict[TreeNode, list[TreeNode]] = {}
    roots: list[TreeNode] = []
    for leaf, group in at_node.items():
        node: TreeNode | None = leaf
        while node is not None:
            seen = node in weight
            weight[node] = weight.get(node, 0) + len(group)
            if not seen:
                if node.parent is None:
                    roots.append(node)
                else:
                    children.setdefault(node.parent, []).append(node)
            node = node.parent
    ordered: list[Req] = []
    stack: list[tuple[TreeNode, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            ordered.extend(at_node.get(node, ()))
            continue
        stack.append((node, True))
        # Heaviest child on top of the stack; a stable sort keeps ties in first-seen order.
        kids = sorted(children.get(node, ()), key=lambda c: -weight[c])
        stack.extend((kid, False) for kid in reversed(kids))
    return ordered
