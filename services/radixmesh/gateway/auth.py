"""The gateway's API keys, checked the same way on HTTP (`Authorization: Bearer <key>`) and gRPC
(`authorization: Bearer <key>` metadata).

Keys come from `--api-key` (one) and `--api-key-file`: a file with one key per line (blank lines and
`#` comments skipped), or a directory whose every file holds keys, as a Kubernetes Secret mounted as a
volume is. The file is read again every `reload_interval_s`, so a rotated Secret applies without a
restart. A presented key is compared with every key by SHA-256 digest with `hmac.compare_digest`: the
time taken depends neither on which key matched nor on how much of one did. Keys are never logged, and
no error repeats what the client sent.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.gateway.config import GatewayConfig

logger = logging.getLogger(__name__)
RELOAD_INTERVAL_S = 5.0
"""How often the key file is read again."""


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeys:
    """The accepted keys; `check` is cheap (a stat-free clock check, then one digest per key)."""

    def __init__(self, keys: Sequence[str] = (), key_file: str | None = None,
                 reload_interval_s: float = RELOAD_INTERVAL_S) -> None:
        for key in keys:
            if not key.strip():
                raise invalid_argument("an API key must not be empty", "api_key")
        self._fixed = [_digest(key.strip()) for key in keys]
        self.key_file = key_file
        self.reload_interval_s = reload_interval_s
        self._from_file: list[bytes] = []
        self._loaded_at = 0.0
        if key_file is not None:
            try:
                self._from_file = [_digest(k) for k in read_keys(key_file)]
            except OSError as exc:
                raise invalid_argument(f"--api-key-file: cannot read {key_file}: {exc.strerror or exc}",
                                       "api_key_file") from None
            if not self._from_file:
                raise invalid_argument(f"--api-key-file {key_file} holds no key (one key per line)", "api_key_file")
            self._loaded_at = time.monotonic()
        if not self._fixed and not self._from_file:
            raise invalid_argument("no API key given", "api_key")

    @property
    def num_keys(self) -> int:
        self._maybe_reload()
        return len(self._fixed) + len(self._from_file)

    def check(self, authorization: str | bytes | None, how: str) -> RadixMeshError | None:
        """None when `authorization` ("Bearer <key>") names an accepted key; else the UNAUTHENTICATED error.
        `how` says where the key goes ("'Authorization: Bearer <key>'" for HTTP)."""
        if authorization is None:
            return RadixMeshError(ErrorCode.UNAUTHENTICATED, f"Missing API key: send it as {how}")
        if isinstance(authorization, str):
            authorization = authorization.encode("utf-8", "replace")
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not self._accepts(token.strip()):
            return RadixMeshError(ErrorCode.UNAUTHENTICATED, "Incorrect API key provided")
        return None

    def _accepts(self, token: bytes) -> bool:
        self._maybe_reload()
        given = _digest(token)
        matched = False
        for key in (*self._fixed, *self._from_file):  # every key, whatever matched: constant time
            matched |= hmac.compare_digest(given, key)
        return matched

    def _maybe_reload(self) -> None:
        if self.key_file is None or time.monotonic() - self._loaded_at < self.reload_interval_s:
            return
        self._loaded_at = time.monotonic()
        try:
            keys = read_keys(self.key_file)
        except OSError as exc:
            logger.warning("API key file %s cannot be read (%s); keeping the keys read before", self.key_file,
                           exc.strerror or type(exc).__name__)
            return
        if not keys:
            logger.warning("API key file %s holds no key; keeping the keys read before", self.key_file)
            return
        self._from_file = [_digest(k) for k in keys]


def read_keys(path: str) -> list[str]:
    """Keys of a key file, or of every file of a directory (a mounted Secret; its hidden `..data` entries
    skipped): one per line, blank lines and `#` comments skipped."""
    source = Path(path)
    files = [source] if not source.is_dir() else sorted(
        p for p in source.iterdir() if not p.name.startswith(".") and p.is_file())
    keys: list[str] = []
    for file in files:
        for line in file.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return keys


def api_keys_of(config: GatewayConfig) -> ApiKeys | None:
    """The gateway's keys (--api-key, --api-key-file); None when neither is given (the API is open)."""
    if config.api_key is None and config.api_key_file is None:
        return None
    return ApiKeys([config.api_key] if config.api_key is not None else [], config.api_key_file)
