"""Prefill side: compute a prompt (reusing this worker's radix cache), sample its first token, and
expose the KV of the requested suffix to a transport until the decode side has it.

The request runs as an ordinary one-token request. When its last output is emitted the scheduler
has just handed the prompt's KV to the radix tree; the export locks that path (so nothing evicts
it), lets the transport gather the suffix's slots, and sends the chunks to the front end ahead of
the first token. `ReleaseTransferMsg` (or the lease) unlocks it; the KV stays cached here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.disagg.messages import ExportCachedReqMsg, KVExportMsg, PrefillReqMsg
from radixmesh.engine.messages import TokenOut
from radixmesh.engine.request import Req

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.base import BaseKVTransport
    from radixmesh.engine.radix_cache import MatchResult, TreeNode
    from radixmesh.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class HeldTransfer:
    """A prompt's KV locked in the radix tree while a transport exposes it."""

    transfer_id: str
    rid: str
    node: TreeNode
    transport: str
    expires_at: float


class ExportManager:
    def __init__(self, scheduler: Scheduler, transport: Callable[[str], BaseKVTransport],
                 send: Callable[[KVExportMsg], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.sched = scheduler
        self.transport = transport
        self.send = send
        self.clock = clock
        self.requested: dict[str, PrefillReqMsg] = {}
        """rid -> prefill request still computing."""
        self.held: dict[str, HeldTransfer] = {}
        self.counters = {"num_exports": 0, "kv_bytes_exported": 0, "num_transfers_lapsed": 0, "num_export_errors": 0,
                         "num_cached_exports": 0, "cached_tokens_exported": 0}

    def prefill(self, msg: PrefillReqMsg) -> None:
        """Queue the prompt as a one-token request; its KV from `start_pos` on is exported when done."""
        params = msgspec.structs.replace(msg.params, max_new_tokens=1, min_new_tokens=min(msg.params.min_new_tokens, 1),
                                         n=1, logprob_start_len=-1)
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), params=params)
        if not 0 <= msg.start_pos < len(msg.input_ids):
            self.sched._fail(req, f"start_pos {msg.start_pos} is outside the prompt of {len(msg.input_ids)} tokens")
            return
        try:
            self.transport(msg.transport)
        except RadixMeshError as exc:
            self.sched._fail(req, exc.message)
            return
        self.requested[msg.rid] = msg
        self.sched.add_request(req)

    def on_outputs(self, outputs: list[TokenOut]) -> list[TokenOut]:
        """Export the KV of prefill requests that just finished; returns the outputs to emit (a failed
        export turns its output into an error)."""
        if not self.requested:
            return outputs
        result = []
        for out in outputs:
            msg = self.requested.pop(out.rid, None) if out.finish_reason is not None else None
            if msg is not None and out.finish_reason not in ("abort", "error"):
                error = self._export(msg)
                if error is not None:
                    self.counters["num_export_errors"] += 1
                    out = msgspec.structs.replace(out, finish_reason="error", error=error)
            result.append(out)
        return result

    def _export(self, msg: PrefillReqMsg) -> str | None:
        match = self.sched.kv.tree.match_prefix(list(msg.input_ids))
        if len(match.indices) < len(msg.input_ids):
            return ("the prompt's KV is not in the radix cache after prefill "
                    "(a prefill worker needs its radix cache on)")
        error = self._export_match(msg.rid, msg.transfer_id, match, msg.start_pos, msg.transport, msg.lease_s)
        if error is None:
            self.counters["num_exports"] += 1
        return error

    def export_cached(self, msg: ExportCachedReqMsg) -> None:
        """Prefix sharing: send the KV this worker holds of positions start_pos.. of `input_ids`, computing
        nothing, then one TokenOut whose `cached_tokens` is where the sent KV ends (see ExportCachedReqMsg)."""
        match = self.sched.kv.tree.match_prefix(list(msg.input_ids))
        end, error = len(match.indices), None
        try:
            self.transport(msg.transport)
        except RadixMeshError as exc:
            error = exc.message
        if error is None and end > msg.start_pos:
            error = self._export_match(msg.rid, msg.transfer_id, match, msg.start_pos, msg.transport, msg.lease_s)
            if error is None:
                self.counters["num_cached_exports"] += 1
                self.counters["cached_tokens_exported"] += end - msg.start_pos
        self.sched.emit([TokenOut(msg.rid, [], len(msg.input_ids), end if error is None else 0, 0,
                                  finish_reason="error" if error else "length", error=error)])

    def _export_match(self, rid: str, transfer_id: str, match: MatchResult, start_pos: int, transport: str,
                      lease_s: float) -> str | None:
        """Lock the matched path and send the KV of its positions start_pos.. as chunks; an error message or None."""
        self.sched.kv.tree.inc_lock_ref(match.last_node)
        self.held[transfer_id] = HeldTransfer(transfer_id, rid, match.last_node, transport, self.clock() + lease_s)
        try:
            chunks = self.transport(transport).export(transfer_id, match.indices[start_pos:])
        except (RadixMeshError, AssertionError, RuntimeError) as exc:
            self.release(transfer_id)
            logger.warning("request %s: KV export failed: %s", rid, exc)
            return f"KV export failed: {exc}"
        for index, chunk in enumerate(chunks):
            self.send(KVExportMsg(rid, transfer_id, index, len(chunks), chunk))
            self.counters["kv_bytes_exported"] += chunk.num_bytes
        return None

    def release(self, transfer_id: str) -> None:
        held = self.held.pop(transfer_id, None)
        if held is None:
            return
        self.sched.kv.tree.dec_lock_ref(held.node)
        self.transport(held.transport).release(transfer_id)

    def abort(self, rid: str) -> None:
        self.requested.pop(rid, None)  # the scheduler aborts the request itself
        for transfer_id in [t for t, h in self.held.items() if h.rid == rid]:
            self.release(transfer_id)

    def tick(self) -> None:
        now = self.clock()
        for transfer_id in [t for t, h in self.held.items() if h.expires_at < now]:
            logger.warning("transfer %s lapsed before the decode side confirmed it; releasing its KV", transfer_id)
            self.counters["num_transfers_lapsed"] += 1
            self.release(transfer_id)

    def stats(self) -> dict[str, int]:
        return {**self.counters, "num_transfers_held": len(self.held), "num_prefills_running": len(self.requested)}
