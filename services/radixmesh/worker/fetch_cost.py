"""When fetching a prompt prefix's KV from a peer beats computing it: a cost model from measured rates.

    fetch_s   = overhead_s + kv_bytes / transfer_bytes_s      (a gRPC round trip, a reservation, the copy)
    compute_s = tokens / prefill_tok_s                          (this worker's own prefill rate)

Both rates are exponentially weighted means of what this worker measured: its prefill rate from
requests it served (uncached prompt tokens over admission-to-first-token time; under load that time
includes other work, which errs towards fetching), the transfer rate from the fetches it made.
Until the first measurement a prior per device and transport stands in.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_ALPHA = 0.2
"""Weight of a new measurement."""
MIN_PREFILL_SAMPLE_TOKENS = 32
"""Prefills of fewer computed tokens are too noisy to measure a rate."""
MIN_FETCH_SAMPLE_BYTES = 64 * 1024
"""Fetches of fewer bytes measure the round trip, not the bandwidth."""
PREFILL_PRIOR_TOK_S = {"cuda": 8000.0, "cpu": 300.0}
TRANSFER_PRIOR_BYTES_S = {"grpc": 300e6, "cuda-ipc": 10e9, "nixl": 1e9}
"""Until measured; auto (and any other id) starts from grpc's, the slowest."""
OVERHEAD_S = 0.005


@dataclass
class FetchDecision:
    fetch: bool
    fetch_s: float
    """Estimated seconds to fetch."""
    compute_s: float
    """Estimated seconds to compute the same tokens here."""


class FetchCostModel:
    def __init__(self, device_type: str, transport: str, kv_bytes_per_token: int) -> None:
        assert kv_bytes_per_token > 0, "a KV token has bytes"
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_tok_s = PREFILL_PRIOR_TOK_S.get(device_type, PREFILL_PRIOR_TOK_S["cpu"])
        self.transfer_bytes_s = TRANSFER_PRIOR_BYTES_S.get(transport, TRANSFER_PRIOR_BYTES_S["grpc"])
        self.overhead_s = OVERHEAD_S
        self.num_prefill_samples = 0
        self.num_fetch_samples = 0

    def decide(self, num_tokens: int) -> FetchDecision:
        fetch_s = self.overhead_s + num_tokens * self.kv_bytes_per_token / self.transfer_bytes_s
        compute_s = num_tokens / self.prefill_tok_s
        return FetchDecision(fetch_s < compute_s, fetch_s, compute_s)

    def observe_prefill(self, computed_tokens: int, seconds: float) -> None:
        if computed_tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            self.prefill_tok_s = _ewma(self.prefill_tok_s, computed_tokens / seconds, self.num_prefill_samples)
            self.num_prefill_samples += 1

    def observe_fetch(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= MIN_FETCH_SAMPLE_BYTES and seconds > 0:
            rate = num_bytes / max(seconds - self.overhead_s, seconds / 2)
            self.transfer_bytes_s = _ewma(self.transfer_bytes_s, rate, self.num_fetch_samples)
            self.num_fetch_samples += 1

    def stats(self) -> dict[str, float]:
        return {"peer_fetch_prefill_tok_s": round(self.prefill_tok_s, 1),
                "peer_fetch_transfer_bytes_s": round(self.transfer_bytes_s, 1)}


def _ewma(current: float, sample: float, num_samples: int) -> float:
    """The first sample replaces the prior; later ones are averaged in."""
    return sample if num_samples == 0 else (1 - EWMA_ALPHA) * current + EWMA_ALPHA * sample
