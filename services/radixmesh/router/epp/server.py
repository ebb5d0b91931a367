"""The endpoint picker's port: Envoy's ExternalProcessor/Process, grpc.health.v1 and reflection of the latter.

The ext_proc service is registered under Envoy's own name (radixmesh's messages are wire-compatible copies in
a package of their own, radixmesh.protocol.ext_proc_pb2). Health: the service names "" and
envoy.service.ext_proc.v3.ExternalProcessor are SERVING while at least one worker can be picked (the reason is
in the `radixmesh-not-ready` trailer otherwise), `liveness` while the process serves: the Deployment's
readiness and liveness probes, and the proxy's own health checks of its picker. With the router's
--tls-cert/--tls-key the port serves TLS, without asking proxies for a client certificate.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixmesh.common.errors import invalid_argument
from radixmesh.common.grpc_server import LIVENESS_SERVICE, MAX_MESSAGE_BYTES, ReadinessHealthServicer
from radixmesh.common.readiness import Readiness
from radixmesh.common.tls import TlsConfig
from radixmesh.protocol import ext_proc_pb2 as pb
from radixmesh.router.epp.service import ExtProcService

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class EppServer:
    """One grpc.aio server for the picker; `readiness` decides its health."""

    def __init__(self, host: str, port: int, service: ExtProcService, readiness: Readiness,
                 tls: TlsConfig | None = None) -> None:
        self.host, self.requested_port, self.tls = host, port, tls
        self.port = 0
        self.readiness = readiness
        self.server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                               ("grpc.so_reuseport", 0)])
        process = grpc.stream_stream_rpc_method_handler(service.process,
                                                        request_deserializer=pb.ProcessingRequest.FromString,
                                                        response_serializer=pb.ProcessingResponse.SerializeToString)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(EXT_PROC_SERVICE,
                                                                                   {"Process": process}),))
        self.health = ReadinessHealthServicer(readiness)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                             reflection.SERVICE_NAME], self.server)
        self._started = False
        self._tasks: set[asyncio.Task[None]] = set()
        readiness.on_change(self._on_readiness)

    @property
    def serves_tls(self) -> bool:
        return self.tls is not None and self.tls.serves_tls

    async def start(self) -> int:
        """Listen and serve; returns the bound port."""
        address = f"{self.host}:{self.requested_port}"
        try:
            if self.tls is not None and self.tls.serves_tls:
                self.port = self.server.add_secure_port(address, self.tls.server_credentials(require_client_cert=False))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise invalid_argument(f"cannot listen on {address}: {exc}", "epp_port") from None
        await self.server.start()
        self._started = True
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._sync()
        security = " (TLS)" if self.serves_tls else ""
        print(f"radixmesh router: endpoint picker (ext_proc) on port {self.port}{security}", flush=True)
        return self.port

    def _on_readiness(self, readiness: Readiness) -> None:
        if not self._started:
            return
        task = asyncio.get_running_loop().create_task(self._sync())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sync(self) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if self.readiness.ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", EXT_PROC_SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING, then let open streams finish within `grace_s`."""
        if not self._started:
            return
        self._started = False
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
