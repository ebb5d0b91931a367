"""Endpoint-picker configuration: frozen, checked at build time, one docstring per field."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.common.errors import invalid_argument


@dataclass(frozen=True)
class EppConfig:
    """How the router serves as an inference pool's endpoint picker (`router --epp-port`)."""

    port: int
    """Port of the ext_proc service and its grpc.health.v1 (0 picks a free one)."""
    tokenizer: str | None = None
    """host:port of the tokenizer service that turns prompts into token ids and block hashes; None: prompts
    sent as text are picked by load alone (token ids in a body are still hashed here)."""
    fallbacks: int = 0
    """Endpoints after the pick in the header and the metadata, for proxies that retry down the list (Envoy's
    override-host policy); 0: the pick alone, which a proxy's ORIGINAL_DST cluster reads as one address."""
    max_queue_per_worker: int = 0
    """Shed (HTTP 429) when every candidate has at least this many requests waiting: its last reported
    queue plus the picks sent to it since that report; 0: never shed."""
    tokenize: str = "local"
    """How prompts become tokens: local (a copy of the tokenizer service's tokenizer in this process, no round
    trip per pick; Tokenize calls until it is loaded) | service (a Tokenize call per pick)."""
    tokenize_timeout_s: float = 2.0
    """A Tokenize call that takes longer is given up: the request is picked by load alone."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Larger buffered bodies are not parsed: picked by load alone."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise invalid_argument(f"epp port must be in [0, 65535] (got {self.port})", "epp_port")
        if not 0 <= self.fallbacks <= 16:
            raise invalid_argument(f"epp fallbacks must be in [0, 16] (got {self.fallbacks})", "epp_fallbacks")
        if self.max_queue_per_worker < 0:
            raise invalid_argument("epp max_queue_per_worker must be >= 0", "epp_max_queue_per_worker")
        if self.tokenize not in ("local", "service"):
            raise invalid_argument(f"epp tokenize must be local or service (got {self.tokenize!r})", "epp_tokenize")
        if self.tokenize_timeout_s <= 0 or self.max_body_bytes < 1:
            raise invalid_argument("epp tokenize_timeout_s and max_body_bytes must be > 0", "epp_tokenize_timeout_s")
