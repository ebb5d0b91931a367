"""TLS on radixmesh's ports and mutual TLS between its services, configured by one set of flags.

Every service (and `radixmesh serve`) takes `add_tls_args`:

    --tls-cert, --tls-key   this process's certificate chain and private key (PEM): its gRPC port (and the
                            gateway's HTTP port) serve TLS with them
    --tls-ca                the CA bundle of the cluster's services; it turns on mutual TLS: calls to other
                            radixmesh services use TLS, check the peer's certificate against this CA and
                            present this process's certificate (--tls-client-cert/--tls-client-key, default
                            --tls-cert/--tls-key); internal services require a client certificate it signed.
                            The gateway's public ports never ask clients for certificates (they send API keys).
    --tls-server-name       the name peers' certificates must carry, instead of the host dialled (pods are
                            dialled by IP; the Helm chart gives every service one name)

Each flag defaults to its RADIXMESH_TLS_* variable. Files are checked when the config is built (an error names
the flag and the file); gRPC ports read their certificate again when its files change, so a rotated Secret
(cert-manager) is served without a restart.

Client side: `configure_clients` sets how this process dials other services and exports it to RADIXMESH_TLS_*
so that processes it spawns (a worker's scheduler, which calls the grammar service) dial the same way;
`aio_channel` / `sync_channel` build every channel to another radixmesh service.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixmesh.common.env import env_str
from radixmesh.common.errors import invalid_argument

if TYPE_CHECKING:  # grpc is imported on first use: the CLI imports this module to build its flags
    import grpc
    import grpc.aio

logger = logging.getLogger(__name__)
ChannelOptions = Sequence[tuple[str, Any]]
_CLIENT_ENV = {"ca_file": "TLS_CA", "client_cert_file": "TLS_CLIENT_CERT", "client_key_file": "TLS_CLIENT_KEY",
               "server_name": "TLS_SERVER_NAME"}
"""What `configure_clients` exports (RADIXMESH_ + name) for spawned processes."""


@dataclass(frozen=True)
class TlsConfig:
    """Certificates of one process: what its ports serve and how it dials other radixmesh services."""

    cert_file: str | None = None
    """PEM certificate chain served on this process's ports (None: they serve plaintext)."""
    key_file: str | None = None
    """PEM private key of cert_file."""
    ca_file: str | None = None
    """PEM CA bundle of the cluster's services: turns on mutual TLS (None: calls to other services are plaintext)."""
    client_cert_file: str | None = None
    """Certificate presented when calling other services (None: cert_file)."""
    client_key_file: str | None = None
    """Private key of client_cert_file (None: key_file)."""
    server_name: str | None = None
    """Name checked in peers' certificates instead of the host dialled (None: the host)."""
    _files: dict[str, bytes] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_pair(self.cert_file, self.key_file, "tls_cert", "tls_key")
        _check_pair(self.client_cert_file, self.client_key_file, "tls_client_cert", "tls_client_key")
        for name in ("cert_file", "key_file", "ca_file", "client_cert_file", "client_key_file"):
            path = getattr(self, name)
            if path is not None:
                self._files[name] = _read(path, "tls_" + name.removesuffix("_file"))
        if self.cert_file is not None and self.key_file is not None:
            _check_key_matches(self.cert_file, self.key_file, "tls_cert")
        if self.client_cert_file is not None and self.client_key_file is not None:
            _check_key_matches(self.client_cert_file, self.client_key_file, "tls_client_cert")
        if self.ca_file is not None:
            _check_ca(self.ca_file)
            if self.client_cert_file is None and self.cert_file is None:
                raise invalid_argument("--tls-ca turns on mutual TLS, which needs this process's certificate: give "
                                       "--tls-cert/--tls-key (or --tls-client-cert/--tls-client-key)", "tls_ca")
        if self.server_name is not None and not self.server_name.strip():
            raise invalid_argument("--tls-server-name must not be empty", "tls_server_name")

    @property
    def serves_tls(self) -> bool:
        """Whether this process's ports serve TLS."""
        return self.cert_file is not None

    @property
    def mutual(self) -> bool:
        """Whether calls between services use mutual TLS (and internal ports require client certificates)."""
        return self.ca_file is not None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        """Credentials of a gRPC port; with `require_client_cert`, clients need a certificate from ca_file.
        The certificate files are read again when they change (checked at each new connection)."""
        import grpc

        assert self.cert_file is not None and self.key_file is not None, "server credentials need a certificate"
        if require_client_cert and self.ca_file is None:
            raise invalid_argument("client certificates can only be required with --tls-ca", "tls_ca")
        reloader = _CertificateReloader(self.cert_file, self.key_file,
                                        self.ca_file if require_client_cert else None)
        return grpc.dynamic_ssl_server_credentials(reloader.initial(), reloader.fetch, require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel to another radixmesh service (mutual TLS)."""
        import grpc

        assert self.ca_file is not None, "channel credentials need --tls-ca"
        cert = self._files.get("client_cert_file", self._files.get("cert_file"))
        key = self._files.get("client_key_file", self._files.get("key_file"))
        return grpc.ssl_channel_credentials(root_certificates=self._files["ca_file"], private_key=key,
                                            certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _check_pair(cert: str | None, key: str | None, cert_param: str, key_param: str) -> None:
    if (cert is None) != (key is None):
        given, missing = (cert_param, key_param) if key is None else (key_param, cert_param)
        raise invalid_argument(f"--{given.replace('_', '-')} needs --{missing.replace('_', '-')}", missing)


def _read(path: str, param: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise invalid_argument(f"--{param.replace('_', '-')}: cannot read {path}: {exc.strerror}", param) from None


def _check_key_matches(cert: str, key: str, param: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise invalid_argument(f"--{param.replace('_', '-')} {cert} and its key cannot be used together "
                               f"({exc.reason or exc}): not a PEM certificate chain and the matching private key",
                               param) from None


def _check_ca(path: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise invalid_argument(f"--tls-ca {path} holds no usable CA certificate ({exc.reason or exc})",
                               "tls_ca") from None


class _CertificateReloader:
    """Serves the certificate files as they are now: a changed file (size or mtime) is read again."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str | None) -> None:
        self.paths = [p for p in (cert_file, key_file, ca_file) if p is not None]
        self.cert_file, self.key_file, self.ca_file = cert_file, key_file, ca_file
        self.stamp = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        stats = [os.stat(p) for p in self.paths]
        return tuple((s.st_mtime_ns, s.st_size) for s in stats)

    def _configuration(self) -> Any:
        import grpc

        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def initial(self) -> Any:
        return self._configuration()

    def fetch(self) -> Any:
        """gRPC asks at each handshake: a new configuration when the files changed, else None (keep)."""
        try:
            stamp = self._stamp()
            if stamp == self.stamp:
                return None
            _check_key_matches(self.cert_file, self.key_file, "tls_cert")  # half-written files: retry later
            configuration = self._configuration()
        except Exception as exc:  # never fail a handshake for this: keep serving the last good certificate
            logger.warning("TLS certificate files changed but cannot be loaded yet: %s", exc)
            return None
        self.stamp = stamp
        logger.info("TLS certificate reloaded from %s", self.cert_file)
        return configuration


# ---- flags ----------------------------------------------------------------------------------------
def add_tls_args(parser: argparse.ArgumentParser, public: bool = False) -> None:
    """--tls-cert/--tls-key/--tls-ca/--tls-client-cert/--tls-client-key/--tls-server-name.
    `public`: the gateway's ports (clients are not asked for certificates; --tls-ca is for its own calls)."""
    group = parser.add_argument_group("TLS")
    where = "the HTTP and gRPC ports" if public else "the gRPC port"
    group.add_argument("--tls-cert", default=env_str("TLS_CERT"),
                       help=f"PEM certificate chain: {where} serve TLS (default: $RADIXMESH_TLS_CERT; none: plaintext)")
    group.add_argument("--tls-key", default=env_str("TLS_KEY"), help="PEM private key of --tls-cert "
                                                                     "(default: $RADIXMESH_TLS_KEY)")
    mutual = ("calls to the tokenizer, router and workers use mutual TLS checked against this CA" if public else
              "mutual TLS: calls to other services are checked against this CA, and clients of this service "
              "need a certificate it signed")
    group.add_argument("--tls-ca", default=env_str("TLS_CA"), help=f"PEM CA bundle of the services: {mutual} "
                                                                   "(default: $RADIXMESH_TLS_CA; none: plaintext)")
    group.add_argument("--tls-client-cert", default=env_str("TLS_CLIENT_CERT"),
                       help="certificate presented to other services (default: $RADIXMESH_TLS_CLIENT_CERT, "
                            "else --tls-cert)")
    group.add_argument("--tls-client-key", default=env_str("TLS_CLIENT_KEY"),
                       help="private key of --tls-client-cert (default: $RADIXMESH_TLS_CLIENT_KEY, else --tls-key)")
    group.add_argument("--tls-server-name", default=env_str("TLS_SERVER_NAME"),
                       help="name other services' certificates must carry, instead of the host dialled "
                            "(default: $RADIXMESH_TLS_SERVER_NAME)")


def tls_config_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS config of parsed flags; None when no TLS flag is set."""
    config = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                       client_cert_file=args.tls_client_cert, client_key_file=args.tls_client_key,
                       server_name=args.tls_server_name)
    return None if config == TlsConfig() else config


# ---- clients --------------------------------------------------------------------------------------
_client: TlsConfig | None = None
_client_resolved = False


def configure_clients(tls: TlsConfig | None) -> None:
    """How this process (and the processes it spawns) dials other radixmesh services: mutual TLS when
    `tls` has a CA, else plaintext."""
    global _client, _client_resolved
    _client, _client_resolved = (tls if tls is not None and tls.mutual else None), True
    for env in _CLIENT_ENV.values():
        os.environ.pop(f"RADIXMESH_{env}", None)
    if _client is None:
        return
    effective = {"ca_file": _client.ca_file, "client_cert_file": _client.client_cert_file or _client.cert_file,
                 "client_key_file": _client.client_key_file or _client.key_file,
                 "server_name": _client.server_name}
    for name, env in _CLIENT_ENV.items():
        if effective[name] is not None:
            os.environ[f"RADIXMESH_{env}"] = str(effective[name])


def client_tls() -> TlsConfig | None:
    """This process's way of dialling other services: what `configure_clients` set, else RADIXMESH_TLS_*."""
    global _client, _client_resolved
    if not _client_resolved:
        ca = env_str("TLS_CA")
        if ca:
            _client = TlsConfig(ca_file=ca, client_cert_file=env_str("TLS_CLIENT_CERT") or env_str("TLS_CERT"),
                                client_key_file=env_str("TLS_CLIENT_KEY") or env_str("TLS_KEY"),
                                server_name=env_str("TLS_SERVER_NAME"))
        _client_resolved = True
    return _client


def aio_channel(address: str, options: ChannelOptions = (), interceptors: Sequence[Any] | None = None,
                tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to another radixmesh service: mutual TLS when configured, else plaintext."""
    import grpc.aio

    tls = tls or client_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()],
                                   interceptors=interceptors)


def sync_channel(address: str, options: ChannelOptions = (), tls: TlsConfig | None = None) -> grpc.Channel:
    """A blocking channel to another radixmesh service: mutual TLS when configured, else plaintext."""
    import grpc

    tls = tls or client_tls()
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])
