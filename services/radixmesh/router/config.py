"""Router configuration: frozen, checked at build time, one docstring per field."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.common.errors import invalid_argument
from radixmesh.common.lane import GENERATE_TRANSPORTS
from radixmesh.wire.block_hash import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class HealthConfig:
    """Active health checking of workers."""

    interval_s: float = 1.0
    """Seconds between two probes of one worker."""
    timeout_s: float = 1.0
    """A probe that takes longer fails."""
    failure_threshold: int = 2
    """Consecutive failed probes that mark a healthy worker unhealthy."""
    success_threshold: int = 1
    """Consecutive passed probes that mark an unhealthy worker healthy."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise invalid_argument("health interval_s and timeout_s must be > 0", "health")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise invalid_argument("health thresholds must be >= 1", "health")


@dataclass(frozen=True)
class BreakerConfig:
    """Per-worker circuit breaker on request failures."""

    failure_threshold: int = 3
    """Consecutive failed requests that open the circuit."""
    open_s: float = 5.0
    """How long an open circuit refuses requests before letting one trial through."""
    max_open_s: float = 60.0
    """Each reopening after a failed trial doubles the open time, up to this."""

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.open_s <= 0 or self.max_open_s < self.open_s:
            raise invalid_argument("breaker needs failure_threshold >= 1 and 0 < open_s <= max_open_s", "breaker")


@dataclass(frozen=True)
class RetryConfig:
    """Retries of a request on another worker, only before its first token was forwarded."""

    max_attempts: int = 3
    """Tries per request, the first one included."""
    base_backoff_s: float = 0.02
    """Backoff before the second try; doubles per try, with full jitter."""
    max_backoff_s: float = 0.5
    """Cap of one backoff."""
    wait_for_worker_s: float = 5.0
    """A request that finds no healthy worker waits up to this long for one before failing UNAVAILABLE (health
    probes bring workers back after a blip, e.g. probes that timed out on a loaded node)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_backoff_s < 0 or self.max_backoff_s < self.base_backoff_s:
            raise invalid_argument("retry needs max_attempts >= 1 and 0 <= base_backoff_s <= max_backoff_s", "retry")
        if self.wait_for_worker_s < 0:
            raise invalid_argument("retry needs wait_for_worker_s >= 0", "retry")


@dataclass(frozen=True)
class MigrationConfig:
    """Moving a stream that broke after its first token (its worker died, drained or failed) to another worker."""

    enabled: bool = True
    """Continue such streams elsewhere from the tokens already sent (off: they end with the error)."""
    max_per_request: int = 3
    """Most migrations of one request; the next break ends it with the error."""

    def __post_init__(self) -> None:
        if self.max_per_request < 0:
            raise invalid_argument("max_migrations must be >= 0", "max_migrations")

    @property
    def may_migrate(self) -> bool:
        return self.enabled and self.max_per_request > 0


@dataclass(frozen=True)
class ScoringConfig:
    """How cache-aware policies weigh cached prefix against load."""

    cache_threshold: float = 0.3
    """Below this cached fraction of the prompt on every worker, the prompt counts as a new prefix."""
    load_weight: float = 0.7
    """Score = cached fraction - load_weight * load, where load is in [0, 1]."""
    prefill_norm_tokens: int = 8192
    """Queued prefill tokens that count as a fully loaded worker."""
    balance_abs_reqs: int = 16
    """Load is badly imbalanced (and alone decides) when the busiest worker has this many more requests..."""
    balance_rel: float = 2.0
    """...and this many times as many as the idlest one."""
    approx_blocks_per_worker: int = 65536
    """approx-tree: blocks remembered per worker (least recently routed forgotten first)."""
    host_hit_weight: float = 0.5
    """A cached token in a worker's host tier counts this much of one on its device (0 < w < 1: below a
    device hit, above a miss); the host copy loads faster than a prefill but is not free."""

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1 or self.load_weight < 0 or self.prefill_norm_tokens < 1:
            raise invalid_argument("scoring needs cache_threshold in [0, 1], load_weight >= 0, "
                                   "prefill_norm_tokens >= 1", "scoring")
        if self.balance_abs_reqs < 0 or self.balance_rel < 1 or self.approx_blocks_per_worker < 1:
            raise invalid_argument("scoring needs balance_abs_reqs >= 0, balance_rel >= 1, "
                                   "approx_blocks_per_worker >= 1", "scoring")
        if not 0 < self.host_hit_weight < 1:
            raise invalid_argument(f"host_hit_weight must be in (0, 1) (got {self.host_hit_weight:g})",
                                   "host_hit_weight")


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation: when a decode worker gets a prefill worker."""

    min_prefill_tokens: int = 256
    """A prompt with fewer tokens than this uncached on the chosen decode worker goes to it alone (it
    computes them itself: a transfer would cost more than it saves); 0 sends every prompt to a prefill worker."""

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0:
            raise invalid_argument("pd min_prefill_tokens must be >= 0", "pd_min_prefill_tokens")


INDEX_LOOKUPS = ("inline", "async")


@dataclass(frozen=True)
class AdapterConfig:
    """Where adapters' files are, and when a hot adapter spreads to another worker."""

    lora_paths: tuple[tuple[str, str], ...] = ()
    """(name, path on the workers) of adapters the router may load onto a worker."""
    spread_ratio: float = 2.0
    """A hot adapter spreads when its least busy holder runs this many times the requests of the least busy
    LoRA-serving worker without it ..."""
    spread_slack: int = 4
    """... plus this many."""


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs besides its server address."""

    policy: str = "cache-aware"
    """Routing policy id: cache-aware | approx-tree | power-of-two | round-robin | random."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per block of the prompts' hashes (as the tokenizer and workers use)."""
    redis_url: str | None = None
    """Redis of the KV-cache index; cache-aware without it runs as approx-tree."""
    index_namespace: str = "radixmesh"
    """Key prefix of the index in Redis."""
    index_lookup: str = "inline"
    """How a request's index lookup waits for Redis: inline (a blocking round trip on the event loop, which
    does not queue behind the streams the loop relays; at most 0.1 s while Redis hangs, then the fallback) |
    async (awaited)."""
    generate_transport: str = "lane"
    """How Generate reaches the workers: lane (a worker's Generate lane when it advertises one) | grpc."""
    redis_probe_s: float = 1.0
    """How often the router pings Redis: while it is up (to notice it gone without a failed request) and
    while it is down (to notice it back)."""
    sweep_interval_s: float = 10.0
    """How often the router cleans stale index entries (0 turns it off)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Active health checks."""
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    """Per-worker circuit breakers."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """Retries before the first token."""
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    """Migration of streams that broke after their first token."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Cache-aware scoring."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    """Prefill/decode disaggregation (used when decode and prefill workers are discovered)."""
    peer_fetch_min_tokens: int = 512
    """cache-aware: name a peer holding at least this many more prompt tokens on its device than the chosen
    worker holds, so that it may fetch their KV instead of computing them (0: never)."""
    seed: int | None = None
    """Seed of the random and power-of-two policies (None: from the OS)."""
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    """LoRA adapters: where their files are on the workers, when a hot one spreads (router/adapters.py)."""

    def __post_init__(self) -> None:
        from radixmesh.router.policies import ROUTING_POLICIES

        ROUTING_POLICIES.check(self.policy)
        if self.block_size < 1:
            raise invalid_argument("block_size must be >= 1", "block_size")
        if self.peer_fetch_min_tokens < 0:
            raise invalid_argument("peer_fetch_min_tokens must be >= 0", "peer_fetch_min_tokens")
        if self.index_lookup not in INDEX_LOOKUPS:
            raise invalid_argument(f"index_lookup must be one of {', '.join(INDEX_LOOKUPS)}", "index_lookup")
        if self.generate_transport not in GENERATE_TRANSPORTS:
            raise invalid_argument(f"generate_transport must be one of {', '.join(GENERATE_TRANSPORTS)}",
                                   "generate_transport")
        if self.redis_probe_s <= 0 or self.sweep_interval_s < 0:
            raise invalid_argument("redis_probe_s must be > 0 and sweep_interval_s >= 0", "redis_probe_s")
