"""One Generate call's phases, timed in the worker front end: queue wait, prefill, decode.

The scheduler process is not traced: it stamps when it first admitted the request
(`TokenOut.admitted_at`), and the front end, which sees every output message arrive, turns
arrival -> admission -> first token -> last token into the queue-time and inter-token
metrics and, when tracing is on, into three spans with explicit times under the call's
server span (`radixmesh serve` uses the same, under its HTTP span).

KV reservation and transfer (prefill/decode tiers) report through `record_kv_transfer`
(metrics and span) or `record_kv_transfer_span` (span only).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from radixmesh.common import tracing
from radixmesh.wire.messages import TokenOut
from radixmesh.worker import metrics

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class Observer(Protocol):
    """Where a duration goes (a prometheus_client Histogram)."""

    def observe(self, amount: float) -> None: ...


class RequestTimeline:
    """Feed every output message to `on_output`, then call `close` once (also on errors and cancellation).

    `queue_time` and `itl` receive the queue wait and the inter-token gaps (None: not observed);
    the spans are named `<span_prefix>.queue|prefill|decode`.
    """

    def __init__(self, rid: str, prompt_len: int, attributes: dict[str, Any] | None = None,
                 queue_time: Observer | None = metrics.QUEUE_TIME, itl: Observer | None = metrics.ITL,
                 span_prefix: str = "worker") -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.attributes = attributes or {}
        self.queue_time = queue_time
        self.itl = itl
        self.span_prefix = span_prefix
        self.arrival_ns = time.time_ns()
        self.admitted_ns: int | None = None
        self.first_token_ns: int | None = None
        self.last_token_ns: int | None = None
        self.cached_tokens = 0
        self.host_load: tuple[float, float, int] | None = None
        self.num_output_tokens = 0
        self.finish_reason = ""
        self.parent: Span | None = None
        if tracing.enabled():
            from opentelemetry import trace

            self.parent = trace.get_current_span()  # the call's server span: later spans hang under it

    def on_output(self, out: TokenOut) -> None:
        now = time.time_ns()
        if self.admitted_ns is None and out.admitted_at is not None:
            self.admitted_ns = max(self.arrival_ns, tracing.epoch_ns(out.admitted_at))
            if self.queue_time is not None:
                self.queue_time.observe((self.admitted_ns - self.arrival_ns) / 1e9)
        if out.token_ids:
            if self.last_token_ns is not None and self.itl is not None:
                gap_s = (now - self.last_token_ns) / 1e9 / len(out.token_ids)
                for _ in out.token_ids:
                    self.itl.observe(gap_s)
            if self.first_token_ns is None:
                self.first_token_ns = now
            self.last_token_ns = now
        self.cached_tokens = out.cached_tokens
        self.host_load = self.host_load or out.host_load
        self.num_output_tokens = out.completion_tokens
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason

    def close(self) -> None:
        """Emit the phase spans (no-op when tracing is off); phases never reached are left out."""
        if not tracing.enabled():
            return
        end_ns = time.time_ns()
        finish = self.finish_reason or "abort"  # left early: cancelled by the caller
        base = {"radixmesh.request_id": self.rid, **self.attributes}
        admitted = self.admitted_ns if self.admitted_ns is not None else end_ns
        prefix = self.span_prefix
        tracing.record_span(f"{prefix}.queue", self.arrival_ns, admitted, base, self.parent)
        if self.host_load is not None:  # the prefix's load from the host tier, during the queue wait
            start_s, end_s, tokens = self.host_load
            tracing.record_span(f"{prefix}.hicache_load", tracing.epoch_ns(start_s), tracing.epoch_ns(end_s),
                                {**base, "hicache.tokens": tokens}, self.parent)
        if self.admitted_ns is None:
            return
        prefill_end = self.first_token_ns if self.first_token_ns is not None else end_ns
        tracing.record_span(f"{prefix}.prefill", self.admitted_ns, prefill_end, {
            **base, "prefill.prompt_tokens": self.prompt_len, "prefill.cached_tokens": self.cached_tokens,
            "prefill.host_cached_tokens": self.host_load[2] if self.host_load else 0,
            "prefill.computed_tokens": self.prompt_len - self.cached_tokens}, self.parent)
        if self.first_token_ns is None:
            return
        tracing.record_span(f"{prefix}.decode", self.first_token_ns, self.last_token_ns or end_ns, {
            **base, "decode.output_tokens": self.num_output_tokens, "decode.finish_reason": finish}, self.parent)


def record_kv_transfer_span(name: str, start_s: float, end_s: float, transport: str, num_bytes: int,
                            parent: Span | None = None, attributes: Mapping[str, Any] | None = None) -> None:
    """A KV reservation or transfer (name: worker.kv_reserve | worker.kv_transfer) timed with time.time();
    a child of `parent` (default: the current span, e.g. the Generate or Prefill call's server span, which
    carries the router's trace context). For the prefill/decode tiers; no-op when tracing is off."""
    if not tracing.enabled():
        return
    tracing.record_span(name, tracing.epoch_ns(start_s), tracing.epoch_ns(end_s),
                        {"kv.transport": transport, "kv.bytes": num_bytes, **(attributes or {})}, parent)


def record_kv_transfer(transport: str, direction: str, num_bytes: int, start_s: float, end_s: float,
                       parent: Span | None = None, attributes: Mapping[str, Any] | None = None) -> None:
    """One request's KV transfer, done: radixmesh_kv_transfer_bytes/_seconds{transport, direction} and the
    `worker.kv_transfer` span (direction: send on the prefill side, receive on the decode side)."""
    metrics.observe_kv_transfer(transport, direction, num_bytes, max(0.0, end_s - start_s))
    record_kv_transfer_span("worker.kv_transfer", start_s, end_s, transport, num_bytes, parent,
                            {"kv.direction": direction, **(attributes or {})})
