"""Gateway configuration: the HTTP-side flags of `radixmesh serve`, frozen once built."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.common.errors import invalid_argument
from radixmesh.common.tls import TlsConfig
from radixmesh.engine.mm.config import ImageLimits
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS, check_num_workers
from radixmesh.gateway.reasoning import check_reasoning_parser
from radixmesh.gateway.tools.registry import check_tool_parser

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DETOKENIZE_MODES = ("local", "service")
"""Where a cluster gateway turns output tokens into text: a copy of the tokenizer here, or the tokenizer service."""
TOKENIZE_MODES = ("local", "service")
"""Where a cluster gateway turns text and chat prompts into token ids (and block hashes): a copy of the tokenizer
here, or the tokenizer service (prompts with images always go to the service)."""


@dataclass(frozen=True)
class GatewayConfig:
    """How the HTTP gateway listens, authenticates and limits load."""

    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 for all)."""
    port: int = 8000
    """TCP port; 0 picks a free one (the printed URL names it)."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every API call needs `Authorization: Bearer <key>` (health and metrics stay open)."""
    api_key_file: str | None = None
    """More keys: a file with one per line, or a directory of such files (a mounted Secret), read as it changes."""
    grpc_port: int | None = None
    """Port of the public gRPC API (InferenceService, health, reflection); 0 picks a free one; None: no gRPC API."""
    tls: TlsConfig | None = None
    """TLS of the HTTP and gRPC ports (cert, key) and mutual TLS of calls to other services (CA); None: plaintext."""
    served_model_name: str | None = None
    """Name clients pass as `model`; defaults to the model's own name."""
    max_queued_requests: int | None = None
    """Sequences allowed to wait beyond the engine's running slots; more get 429. None: unlimited."""
    max_default_tokens: int = 4096
    """Output cap when a chat or native request gives no max_tokens (the context end also applies)."""
    graceful_shutdown_s: float = 5.0
    """On SIGINT/SIGTERM, how long open requests may finish before they are aborted."""
    log_level: str = "warning"
    """Log level of the HTTP server (info also logs each request)."""
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    """What `serve` accepts of images (a gateway leaves images to the tokenizer service and its limits)."""
    tool_call_parser: str | None = None
    """Tool-call syntax (hermes | llama3-json | mistral | json); None: chosen from the model."""
    strict_tools: bool = False
    """Constrain tool_choice auto too: a call, once the model starts one, names a tool and its arguments validate."""
    reasoning_parser: str | None = None
    """Split a thinking model's reasoning from its answer (deepseek-r1 | qwen3); None: no splitting."""
    tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS
    """Threads that tokenize `serve`'s prompts off the event loop (a gateway's with `--tokenize local`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise invalid_argument(f"port must be in [0, 65535] (got {self.port})", "port")
        if self.api_key is not None and not self.api_key.strip():
            raise invalid_argument("api_key must not be empty", "api_key")
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise invalid_argument(f"grpc_port must be in [0, 65535] (got {self.grpc_port})", "grpc_port")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise invalid_argument("max_queued_requests must be >= 0", "max_queued_requests")
        if self.max_default_tokens < 1:
            raise invalid_argument("max_default_tokens must be >= 1", "max_default_tokens")
        if self.graceful_shutdown_s < 0:
            raise invalid_argument("graceful_shutdown_s must be >= 0", "graceful_shutdown_s")
        if self.tool_call_parser is not None:
            object.__setattr__(self, "tool_call_parser", check_tool_parser(self.tool_call_parser))
        if self.reasoning_parser is not None:
            object.__setattr__(self, "reasoning_parser", check_reasoning_parser(self.reasoning_parser))
        check_num_workers(self.tokenizer_workers)
        if self.log_level.lower() not in LOG_LEVELS:
            raise invalid_argument(f"log_level must be one of {', '.join(LOG_LEVELS)}", "log_level")

    @property
    def serves_tls(self) -> bool:
        return self.tls is not None and self.tls.serves_tls

    def url(self, port: int | None = None) -> str:
        """Base URL for clients; a wildcard host is shown as itself."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.serves_tls else 'http'}://{host}:{self.port if port is None else port}"
